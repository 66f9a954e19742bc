"""The evaluation runner's steady rollout pool, its in-order append-only writer, resume after a
failure, and several processes evaluating one run into one results folder — all with a fake
engine (a backend whose rollouts the test controls), so no model runs."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from eval.run import checkpoints as ckpts
from eval.run import pool, runner, settings
from eval.run.backends import EngineSettings, VLLMBackend, VLLMEngineClient, vllm_engine_kwargs
from eval.run.rollout import Limits
from eval.run.store import InOrderWriter, RowStore
from eval.run.suite import load_suite

# ---- rollout_pool ------------------------------------------------------------------------------


async def _settle() -> None:
    """Let every runnable task run until it blocks again (pure scheduling, no clock)."""
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.parametrize("size", [1, 3, 8])
def test_pool_stays_full_whatever_order_rollouts_finish_in(size: int):
    """Whatever order rollouts finish in, min(size, items left) are in flight at every moment."""
    items = list(range(20))

    async def scenario() -> list[tuple[int, int]]:
        gates: dict[int, asyncio.Event] = {}
        inflight: set[int] = set()
        results: list[tuple[int, int]] = []

        async def fake(item: int) -> int:
            gates[item] = asyncio.Event()
            inflight.add(item)
            await gates[item].wait()
            inflight.discard(item)
            return item * 10

        async def consume() -> None:
            async for i, r in pool.rollout_pool(items, fake, size):
                results.append((i, r))

        consumer = asyncio.ensure_future(consume())
        turn = 0
        while not consumer.done():
            await _settle()
            unfinished = [j for j in items if j not in gates or not gates[j].is_set()]
            assert len(inflight) == min(size, len(unfinished)), (turn, sorted(inflight))
            if inflight:  # finish the newest rollout first: completion order != item order
                gates[max(inflight)].set()
            turn += 1
        await consumer
        return results

    results = asyncio.run(scenario())
    assert sorted(results) == [(i, i * 10) for i in items]
    if size > 1:
        assert [i for i, _ in results] != items, "the fake finished out of order; so must the results"


def test_pool_error_cancels_the_rest_and_propagates():
    cancelled: list[int] = []

    async def fake(item: int) -> int:
        try:
            if item == 2:
                raise RuntimeError("engine died")
            await asyncio.sleep(3600)
            return item
        except asyncio.CancelledError:
            cancelled.append(item)
            raise

    async def scenario() -> None:
        async for _ in pool.rollout_pool(range(10), fake, 4):
            pass

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(scenario())
    assert sorted(cancelled) == [0, 1, 3]
    with pytest.raises(ValueError, match="max-in-flight"):
        asyncio.run(pool.rollout_pool([1], fake, 0).__anext__())


# ---- InOrderWriter ------------------------------------------------------------------------------


def _row(i: int) -> dict:
    return {"benchmark": "nq", "id": str(i), "em": 0.0}


def test_writer_appends_only_the_finished_prefix_in_order(tmp_path: Path):
    store = RowStore(tmp_path / "rows.jsonl")
    now = [0.0]
    writer = InOrderWriter(store, flush_rows=2, flush_s=10.0, clock=lambda: now[0])
    snapshots = []

    def snap() -> None:
        snapshots.append(store.path.read_bytes() if store.path.exists() else b"")

    def add(*indices: int) -> list[str]:
        for i in indices:
            writer.add(i, _row(i))
            snap()
        return [r["id"] for r in store.rows()]

    assert add(1, 0) == ["0", "1"]  # two finished in order: flush_rows reached
    assert add(4, 2) == ["0", "1"]  # one waiting in order (2), one after a gap (4)
    now[0] = 11.0
    assert add(6) == ["0", "1", "2"]  # flush_s passed: the finished prefix goes out, 4 and 6 wait
    assert add(3) == ["0", "1", "2", "3", "4"]
    assert add(5) == [str(i) for i in range(7)]
    assert writer.flush() == 0 and writer.written == 7
    for before, after in zip(snapshots, snapshots[1:], strict=False):
        assert after.startswith(before), "rows.jsonl must only ever grow at its end"


# ---- evaluate_step / run with a fake backend ----------------------------------------------------


class FakeBackend:
    """A backend whose rollouts answer the first gold answer (optionally failing at one row)."""

    def __init__(self, fail_on: str | None = None, log: Path | None = None, tag: str = ""):
        self.loop = asyncio.new_event_loop()
        self.fail_on, self.log, self.tag = fail_on, log, tag
        self.calls: list[str] = []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def rollout_one(self, row):
        qid = f"{row['data_source']}/{row['extra_info']['id']}"
        self.calls.append(str(qid))
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{self.tag} {qid}\n")
        await asyncio.sleep(0)
        if self.fail_on is not None and str(qid) == self.fail_on:
            raise RuntimeError("fake engine failure")
        gold = row["reward_model"]["ground_truth"]["target"][0]
        return {
            "response": f"<think>x</think><answer>{gold}</answer>",
            "termination": "answer",
            "searches": 1,
            "search_errors": 0,
            "model_tokens": 5,
            "retrieved_tokens": 0,
        }

    def close(self):
        self.loop.close()


def _plan(tmp_path: Path, steps: list[int], max_in_flight: int = 3, urls=("http://127.0.0.1:9",)):
    suite = load_suite("samples", limit=3, benchmarks=["nq", "bamboogle"])
    limits = Limits()
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")  # what the checkpoint fingerprint reads
    return runner.EvalSetup(
        run_name="f1_only_s1",
        out_root=tmp_path / "out",
        suite=suite,
        checkpoints=[ckpts.Checkpoint(s, model, "hf") for s in steps],
        info={"run": "f1_only_s1", "shape": "f1_only", "seed": 1, "horizon": max(steps), "config": {}},
        limits=limits,
        backend="hf",
        retriever_urls=list(urls),
        max_in_flight=max_in_flight,
        eval_settings=settings.eval_settings(suite, 3, 0, limits, "hf"),
    )


@pytest.mark.slow
def test_failed_rollout_keeps_the_prefix_and_resume_redoes_only_the_rest(tmp_path: Path):
    plan = _plan(tmp_path, [1])
    ckpt = plan.checkpoints[0]
    all_keys = [q for qs in plan.suite.benchmarks.values() for q in qs]
    failing = FakeBackend(fail_on=f"{all_keys[4].benchmark}/{all_keys[4].id}")
    with pytest.raises(RuntimeError, match="fake engine failure"):
        runner.evaluate_step(plan, ckpt, lambda config, model_dir: failing, log=lambda _: None)
    rows_path = plan.run_root / "global_step_1" / "rows.jsonl"
    kept = [(r["benchmark"], r["id"]) for r in RowStore(rows_path).rows()]
    assert kept == [q.key for q in all_keys[: len(kept)]] and len(kept) <= 4, "an in-order prefix only"
    assert not (plan.run_root / "global_step_1" / "summary.json").exists()

    resumed = FakeBackend()
    summary = runner.evaluate_step(plan, ckpt, lambda config, model_dir: resumed, log=lambda _: None)
    assert resumed.calls == [f"{q.benchmark}/{q.id}" for q in all_keys[len(kept) :]], (
        "done rows are not redone"
    )
    assert [(r["benchmark"], r["id"]) for r in RowStore(rows_path).rows()] == [q.key for q in all_keys]
    assert summary["complete"] and summary["macro"]["em"] == 1.0

    fresh_plan = _plan(tmp_path / "fresh", [1])
    runner.evaluate_step(
        fresh_plan, fresh_plan.checkpoints[0], lambda c, m: FakeBackend(), log=lambda _: None
    )
    assert rows_path.read_bytes() == (fresh_plan.run_root / "global_step_1" / "rows.jsonl").read_bytes()


class DownRetrieverBackend(FakeBackend):
    """FakeBackend whose rollouts of the ``down`` question ids read "Retriever failed" texts (and
    record ``retrieval_failures``) the first ``times`` times they are rolled out."""

    def __init__(self, down: set[str], times: int):
        super().__init__()
        self.left = dict.fromkeys(down, times)

    async def rollout_one(self, row):
        record = await super().rollout_one(row)
        qid = f"{row['data_source']}/{row['extra_info']['id']}"
        if self.left.get(qid, 0) > 0:
            self.left[qid] -= 1
            record.update(response="<answer>x</answer>", search_errors=1, retrieval_failures=1)
        return record


@pytest.mark.slow
def test_rows_with_a_failed_retrieval_are_rolled_out_again(tmp_path: Path, retrieval_server_url):
    """A retriever that was down for some rollouts: their rows are not stored but redone at the end
    of the checkpoint's pass, once the retriever answers again; the scores never see the failure."""
    plan = _plan(tmp_path, [1], urls=(retrieval_server_url,))
    keys = [f"{q.benchmark}/{q.id}" for qs in plan.suite.benchmarks.values() for q in qs]
    backend = DownRetrieverBackend({keys[1], keys[4]}, times=1)
    logged: list[str] = []
    summary = runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: backend, log=logged.append)
    assert summary["complete"] and summary["macro"]["em"] == 1.0 and summary["n"] == 6
    assert backend.calls == keys + [keys[1], keys[4]]
    assert any("2 rows had a failed search and were not stored" in line for line in logged)
    rows = RowStore(plan.run_root / "global_step_1" / "rows.jsonl").rows()
    assert [f"{r['benchmark']}/{r['id']}" for r in rows] == [
        k for k in keys if k not in (keys[1], keys[4])
    ] + [
        keys[1],
        keys[4],
    ]


@pytest.mark.parametrize("retriever_up", [True, False])
@pytest.mark.slow
def test_rows_failing_again_stop_the_run_and_resume_redoes_only_them(
    tmp_path: Path, retrieval_server_url, retriever_up: bool
):
    url = retrieval_server_url if retriever_up else "http://127.0.0.1:9"
    plan = _plan(tmp_path, [1], urls=(url,))
    keys = [f"{q.benchmark}/{q.id}" for qs in plan.suite.benchmarks.values() for q in qs]
    down = DownRetrieverBackend({keys[0], keys[5]}, times=2)
    with pytest.raises(
        RuntimeError, match="step 1: 2 of 6 rows had a failed search and were not stored"
    ) as info:
        runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: down, log=lambda _: None)
    why = "their searches failed again" if retriever_up else f"retrieval server {url} is not reachable"
    assert why in str(info.value) and "run the same command again" in str(info.value)
    step_dir = plan.run_root / "global_step_1"
    assert not (step_dir / "summary.json").exists()
    assert len(RowStore(step_dir / "rows.jsonl").rows()) == 4
    resumed = FakeBackend()
    summary = runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: resumed, log=lambda _: None)
    assert resumed.calls == [keys[0], keys[5]] and summary["macro"]["em"] == 1.0 and summary["n"] == 6


def _worker(tmp: str, url: str, tag: str, hold_step: int | None, inside, release, out: str) -> None:
    """One `python -m eval run`-like process: run() with fake backends; holds `hold_step` open
    until `release` is set (after telling `inside`)."""
    plan = _plan(Path(tmp), [1, 2, 3, 4], urls=(url,))
    log = Path(tmp) / "rollouts.log"

    def make(config, model_dir):
        step = int(
            Path(config.actor_rollout_ref.rollout.multi_turn.tool_config_path).parent.name.split("_")[-1]
        )
        backend = FakeBackend(log=log, tag=f"{tag} step{step}")
        if step == hold_step:
            inside.set()
            assert release.wait(120), "the other process never started"
        else:
            release.set()  # this process works on a checkpoint of its own
        return backend

    summaries = runner.run(plan, make, log=lambda _: None)
    Path(out).write_text(json.dumps(sorted(summaries)))


@pytest.mark.slow
def test_two_processes_share_one_results_folder_checkpoint_by_checkpoint(
    tmp_path: Path, retrieval_server_url
):
    ctx = multiprocessing.get_context("fork")
    inside, release = ctx.Event(), ctx.Event()
    a = ctx.Process(
        target=_worker,
        args=(str(tmp_path), retrieval_server_url, "A", 1, inside, release, str(tmp_path / "a")),
    )
    b = ctx.Process(
        target=_worker,
        args=(str(tmp_path), retrieval_server_url, "B", None, inside, release, str(tmp_path / "b")),
    )
    a.start()
    try:
        assert inside.wait(120), "process A never reached step 1"
        b.start()  # step 1 is locked by A: B must skip it and take step 2
        b.join(300)
        a.join(300)
    finally:
        for p in (a, b):
            if p.is_alive():
                p.kill()
    assert (a.exitcode, b.exitcode) == (0, 0)
    assert (
        json.loads((tmp_path / "a").read_text()) == json.loads((tmp_path / "b").read_text()) == [1, 2, 3, 4]
    )
    lines = (tmp_path / "rollouts.log").read_text().splitlines()
    by_step: dict[str, set[str]] = {}
    for line in lines:
        tag, step, _ = line.split()
        by_step.setdefault(step, set()).add(tag)
    assert by_step["step1"] == {"A"} and by_step["step2"] == {"B"}
    assert all(len(tags) == 1 for tags in by_step.values()), "a checkpoint was evaluated by both"
    run_root = tmp_path / "out" / "f1_only_s1"
    for step in (1, 2, 3, 4):
        rows = RowStore(run_root / f"global_step_{step}" / "rows.jsonl").rows()
        raw = (run_root / f"global_step_{step}" / "rows.jsonl").read_text().splitlines()
        assert len(rows) == len(raw) == 6, "each row written once, by one process"
        assert json.loads((run_root / f"global_step_{step}" / "summary.json").read_text())["n"] == 6
    assert len(lines) == 4 * 6, "no row was rolled out twice"
    assert os.path.isfile(run_root / "run.json")


# ---- vLLM engine settings (no vLLM needed) --------------------------------------------------------


def test_vllm_engine_is_text_only_without_prefix_caching_and_logprobs(tmp_path: Path):
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 8192}}}
    )
    fields = {"model", "seed", "dtype", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching"}
    kwargs = vllm_engine_kwargs(config, "m", 0, EngineSettings(), fields | {"language_model_only"})
    assert kwargs["language_model_only"] is True and kwargs["enable_prefix_caching"] is False
    assert kwargs["gpu_memory_utilization"] == 0.85 and kwargs["max_model_len"] == 9216
    on = vllm_engine_kwargs(
        config, "m", 0, EngineSettings(0.5, prefix_caching=True), fields | {"language_model_only"}
    )
    assert on["enable_prefix_caching"] is True and on["gpu_memory_utilization"] == 0.5
    assert "mamba_ssm_cache_dtype" not in kwargs and "enforce_eager" not in kwargs
    cpu = vllm_engine_kwargs(config, "m", 0, EngineSettings(), fields | {"language_model_only"}, cpu=True)
    assert cpu["mamba_ssm_cache_dtype"] == "float32" and cpu["enforce_eager"] is True
    with pytest.raises(RuntimeError, match="language_model_only"):
        vllm_engine_kwargs(config, "m", 0, EngineSettings(), fields)
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        EngineSettings(1.5)
    sampling = VLLMEngineClient.sampling_kwargs(
        {
            "max_tokens": 0,
            "temperature": 0,
            "top_p": 1.0,
            "top_k": -1,
            "logprobs": True,
            "stop_token_ids": [7],
        }
    )
    assert sampling["logprobs"] is None and sampling["max_tokens"] == 1 and sampling["stop_token_ids"] == [7]


def test_prefix_caching_is_part_of_the_comparable_settings():
    suite = load_suite("samples", limit=1, benchmarks=["nq"])
    off = settings.eval_settings(suite, 1, 0, Limits(), "vllm")
    on = settings.eval_settings(suite, 1, 0, Limits(), "vllm", prefix_caching=True)
    assert off != on and off["prefix_caching"] is False
    assert "prefix_caching" not in settings.eval_settings(suite, 1, 0, Limits(), "hf")


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, tokenizer, seen: dict) -> None:
    """Stand-in ``vllm`` modules: an engine that answers every turn with a final answer + EOS."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class AsyncEngineArgs:
        model: str
        seed: int = 0
        dtype: str = "auto"
        max_model_len: int | None = None
        gpu_memory_utilization: float = 0.9
        enable_prefix_caching: bool | None = None
        language_model_only: bool = False
        max_num_seqs: int | None = None

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class Engine:
        def __init__(self, args):
            seen["args"], seen["running"], seen["most"] = args, 0, 0
            seen["params"] = []

        @classmethod
        def from_engine_args(cls, args):
            return cls(args)

        async def generate(self, prompt, sampling_params, request_id):
            seen["params"].append(sampling_params)
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
            for _ in range(200):  # until a second rollout reaches the engine (<= 2 s; a loaded machine
                await asyncio.sleep(0.01)  # may bring it later than one yield), then never again
                if seen["most"] > 1:
                    break
            seen["running"] -= 1
            ids = tokenizer.encode("<answer>Paris</answer>", add_special_tokens=False)
            ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
            completion = types.SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)
            yield types.SimpleNamespace(outputs=[completion])

        def shutdown(self):
            seen["shutdown"] = True

    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.inputs": types.ModuleType("vllm.inputs"),
        "vllm.engine": types.ModuleType("vllm.engine"),
        "vllm.engine.arg_utils": types.ModuleType("vllm.engine.arg_utils"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
    }
    modules["vllm"].SamplingParams = SamplingParams
    modules["vllm.inputs"].TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    modules["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs
    modules["vllm.v1.engine.async_llm"].AsyncLLM = Engine
    modules["vllm.platforms"].current_platform = types.SimpleNamespace(is_cpu=lambda: False)  # as on a GPU
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_vllm_backend_end_to_end_with_a_stand_in_engine(tmp_path: Path, tiny_model_dir: Path, monkeypatch):
    """VLLMBackend wired as on a GPU: engine arguments, verl's agent loop over VLLMEngineClient, the
    steady pool, scoring, rows in order; only the engine is a stand-in, so this runs in seconds
    (tests/e2e/test_vllm_e2e.py runs the real engine: vLLM's CPU build)."""
    from transformers import AutoTokenizer

    from eval.run.backends import make_backend

    seen: dict = {}
    _fake_vllm(monkeypatch, AutoTokenizer.from_pretrained(tiny_model_dir), seen)
    plan = _plan(tmp_path, [0], max_in_flight=4)
    plan.checkpoints = [ckpts.Checkpoint(0, tiny_model_dir, "hf")]
    plan.backend = "vllm"
    settings = EngineSettings(0.4)
    summary = runner.evaluate_step(
        plan,
        plan.checkpoints[0],
        lambda config, model_dir: make_backend("vllm", config, model_dir, settings=settings),
        log=lambda _: None,
    )
    args = seen["args"]
    assert args.language_model_only is True and args.enable_prefix_caching is False
    assert args.gpu_memory_utilization == 0.4 and args.model == str(tiny_model_dir)
    assert all(p.logprobs is None and p.temperature == 0.0 for p in seen["params"]), "greedy, no logprobs"
    assert 1 < seen["most"] <= 4, "rollouts overlap in the engine, at most --max-in-flight of them"
    assert seen.get("shutdown") is True
    rows = RowStore(plan.run_root / "global_step_0" / "rows.jsonl").rows()
    assert [(r["benchmark"], r["id"]) for r in rows] == [
        q.key for qs in plan.suite.benchmarks.values() for q in qs
    ]
    assert all(r["prediction"] == "Paris" and r["termination"] == "answer" for r in rows)
    assert summary["n"] == len(rows) == 6


def test_vllm_missing_is_actionable(monkeypatch: pytest.MonkeyPatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name.startswith("vllm"):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(RuntimeError, match=r"pip install -e \.\[gpu\]"):
        VLLMBackend(config=None, model_dir="unused")  # type: ignore[arg-type]
