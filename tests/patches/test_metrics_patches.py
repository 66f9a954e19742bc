"""The training-metric patches against verl 0.9.1: upstream still has the code they adapt, and they work."""

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import verl

from patches import file_logger_resume, training_metrics
from search_env.retriever_guard import RetrieverDown


def test_pinned_verl_version():
    assert verl.__version__ == "0.9.1", "patches target verl 0.9.1: re-check every patch before moving"


def test_upstream_file_logger_still_truncates():
    from verl.utils import tracking

    src = inspect.getsource(tracking)
    assert 'self.fp = open(self.filepath, "wb", buffering=0)' in src
    assert src.count('"wb"') == 1, "another 'wb' open appeared: the append mapping would catch it too"
    assert 'data = {"step": step, "data": data}' in src  # the file as shipped, not the patched class


def _log_steps(path, steps, monkeypatch):
    from verl.utils import tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = tracking.FileLogger("p", "e")
    for step in steps:
        logger.log({"reward/mean": step / 10}, step)
    logger.finish()


def test_file_logger_appends_and_dedupes_on_resume(tmp_path, monkeypatch):
    file_logger_resume.install()
    path = tmp_path / "metrics.jsonl"
    _log_steps(path, [1, 2, 3], monkeypatch)  # first run, killed after logging step 3
    with path.open("ab") as fp:
        fp.write(b'{"step": 4, "da')  # torn line from the kill
    _log_steps(path, [3, 4, 5], monkeypatch)  # resumed from the step-2 checkpoint
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    _log_steps(path, [6], monkeypatch)  # a clean resume keeps everything
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_the_resume_rewrite_is_fsynced_before_it_replaces_the_log(tmp_path, monkeypatch):
    """A power loss right after the rename must not leave an empty metrics.jsonl: the rewritten
    temp file is fsynced before os.replace puts it in place."""
    import os

    file_logger_resume.install()
    path = tmp_path / "metrics.jsonl"
    _log_steps(path, [1, 2, 3], monkeypatch)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (events.append(f"replace {Path(b).name}"), real_replace(a, b))[1]
    )
    _log_steps(path, [2, 3], monkeypatch)  # resumed from the step-1 checkpoint: a rewrite
    assert "replace metrics.jsonl" in events
    assert events.index("fsync") < events.index("replace metrics.jsonl")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_kept_lines_drops_foreign_and_later_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "data": {}}\nnot json\n{"step": 5, "data": {}}\n{"step": 2, "data": {}}')
    kept, dropped = file_logger_resume.kept_lines(path, 3)
    assert kept == [b'{"step": 1, "data": {}}\n'] and dropped


def test_upstream_compute_metrics_signature_and_logging_path():
    from verl.trainer.ppo.v1 import trainer_base

    assert list(inspect.signature(trainer_base.PPOTrainer._compute_metrics).parameters) == [
        "self",
        "batch",
        "metrics",
        "timing_raw",
        "global_steps",
        "epoch",
    ]
    fit = inspect.getsource(trainer_base.PPOTrainer)
    call = "self._compute_metrics(batch, metrics, self.timing_raw, global_steps=self.global_steps, epoch=current_epoch)"
    assert call in fit
    assert fit.index(call) < fit.index("tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)")
    assert fit.index(call) < fit.index("self.logger.log(data=metrics, step=self.global_steps)")
    from verl.trainer.ppo.v1 import agent_loop_tq

    postprocess = inspect.getsource(agent_loop_tq.AgentLoopWorkerTQ._agent_loop_postprocess)
    assert 'keys.append(f"{uid}_{session_id}_{i}")' in postprocess  # group_of() parses this key


def test_compute_metrics_wrapper_adds_rollout_metrics(monkeypatch):
    import transfer_queue as tq
    from verl.trainer.ppo.v1 import trainer_base

    training_metrics.install()
    assert getattr(trainer_base.PPOTrainer._compute_metrics, training_metrics.PATCHED_FLAG)
    extra = [
        {"termination": "answer", "answered": True, "searches": 1, "reward_extra_info": {"score": 1.0}},
        {"termination": "length_cap", "answered": False, "searches": 2, "reward_extra_info": {"score": 0.0}},
        {"termination": "answer", "answered": True, "searches": 0, "reward_extra_info": {"score": 0.5}},
    ]

    class Fetched(dict):
        pass

    def fake_get(keys, partition_id, select_fields):
        assert select_fields == ["extra_fields"]
        return Fetched(extra_fields=SimpleNamespace(tolist=lambda: extra))

    monkeypatch.setattr(tq, "kv_batch_get", fake_get)

    def fake_original(self, batch, metrics, timing_raw, global_steps, epoch):
        metrics["response_length/clip_ratio"] = 1.0  # upstream's never-zero value

    batch = SimpleNamespace(
        keys=["u1_0_0", "u1_1_0", "pad_0_0"],
        partition_id="train",
        tags=[{}, {}, {"is_padding": True}],
    )
    metrics = {}
    trainer = SimpleNamespace(config=_trainer_config())
    training_metrics._wrap(fake_original)(trainer, batch, metrics, {}, global_steps=1, epoch=0)
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics["rollout/searches_mean"] == pytest.approx(1.5)
    assert metrics["rollout/length_clip_ratio"] == metrics["response_length/clip_ratio"] == 0.5
    assert metrics["grpo/zero_variance_group_frac"] == 0.0


def _trainer_config(max_failed_steps: int = 2, tool_config_path: str | None = None):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "retriever": {"max_failed_steps": max_failed_steps},
            "actor_rollout_ref": {"rollout": {"multi_turn": {"tool_config_path": tool_config_path}}},
        }
    )


class _Logger:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))


def _step(trainer, step: int, failures: list[int], capsys) -> str:
    rows = [{"searches": 2, "search_errors": f, "retrieval_failures": f} for f in failures]
    metrics = {"rollout/retrieval_failures": float(sum(failures)), "reward/mean": 0.1}
    training_metrics.check_retriever(trainer, rows, metrics, step)
    return capsys.readouterr().err


def test_retriever_stop_rule_raises_in_the_driver_after_k_failing_steps(tmp_path, monkeypatch, capsys):
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: search_env.tool.SearchTool\n"
        "    config: {retrieval_urls: ['http://127.0.0.1:18450', 'http://h2:8000']}\n"
    )
    monkeypatch.setenv("RLVR_RETRIEVER_LOG", "/runs/demo/retriever.log")
    trainer = SimpleNamespace(config=_trainer_config(2, str(tools)), logger=_Logger())
    assert _step(trainer, 1, [0, 0], capsys) == ""
    warned = _step(trainer, 2, [1, 0], capsys)  # a blip: warned, not stopped
    assert "step 2: 1 of 4 searches failed against http://127.0.0.1:18450, http://h2:8000" in warned
    assert _step(trainer, 3, [0, 0], capsys) == ""  # the streak ends
    _step(trainer, 4, [2, 2], capsys)
    with pytest.raises(RetrieverDown) as info:
        _step(trainer, 5, [2, 1], capsys)
    message = str(info.value)
    for part in (
        "2 consecutive training steps",
        "retriever.max_failed_steps=2",
        "http://127.0.0.1:18450, http://h2:8000",
        "steps 4 (4 of 4 searches), 5 (3 of 4 searches)",
        "/runs/demo/retriever.log",
        "curl <url>/health",
        "run the same command again",
    ):
        assert part in message, part
    assert trainer.logger.logged == [(5, {"rollout/retrieval_failures": 3.0, "reward/mean": 0.1})]
    assert "ERROR: retriever down:" in capsys.readouterr().err


def test_retriever_stop_rule_off_only_warns(capsys):
    trainer = SimpleNamespace(config=_trainer_config(0), logger=_Logger())
    for step in range(1, 6):
        assert "retriever.max_failed_steps=0: the run goes on" in _step(trainer, step, [1], capsys)
    assert trainer.logger.logged == []


@pytest.mark.parametrize("bad", [-1, True, "2", 1.5])
def test_max_failed_steps_must_be_a_count(bad, capsys):
    trainer = SimpleNamespace(config=_trainer_config(bad))
    with pytest.raises(ValueError, match="retriever.max_failed_steps must be an integer >= 0"):
        _step(trainer, 1, [0], capsys)
