"""Sampled evaluation: the pass@k estimator, the sampling setting, sampled rows and summaries."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.run import checkpoints as ckpts
from eval.run import runner
from eval.run.backends import ROLLOUT_SEED, seeded, turn_seed
from eval.run.rollout import Limits
from eval.run.settings import GREEDY, Sampling, eval_settings
from eval.run.store import RowStore
from eval.run.suite import load_suite
from eval.run.summary import summarize
from eval.schema import differences, mismatch_message, row_key
from eval.stats import pass_at_k, pass_at_ks


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@given(st.lists(st.booleans(), min_size=1, max_size=10), st.data())
def test_pass_at_k_equals_enumeration_over_k_subsets(outcomes: list[bool], data: st.DataObject):
    n, c = len(outcomes), sum(outcomes)
    k = data.draw(st.integers(1, n))
    assert math.isclose(pass_at_k(n, c, k), brute_pass_at_k(outcomes, k), abs_tol=1e-12)
    assert math.isclose(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_pass_at_k_edges(n: int):
    for k in range(1, n + 1):
        assert pass_at_k(n, 0, k) == 0.0  # never correct
        assert pass_at_k(n, n, k) == 1.0  # always correct
    for c in range(n + 1):
        assert pass_at_k(n, c, n) == (1.0 if c else 0.0)  # all samples drawn: any correct one counts
        assert math.isclose(pass_at_k(n, c, 1), c / n)  # pass@1 = mean correctness


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_pass_at_ks_columns_are_pass_at_1_to_n_then_avg():
    table = pass_at_ks(np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert table.shape == (3, 5)
    assert np.allclose(table[0], [0.25, 0.5, 0.75, 1.0, 0.25])
    assert np.allclose(table[1], 0) and np.allclose(table[2], 1)


def test_several_samples_need_a_temperature():
    with pytest.raises(ValueError, match=r"--samples 4 needs --temperature > 0"):
        Sampling(samples=4)
    for bad, flag in [({"samples": 0}, "--samples"), ({"temperature": -1}, "--temperature")]:
        with pytest.raises(ValueError, match=flag):
            Sampling(**bad)
    with pytest.raises(ValueError, match="--top-p"):
        Sampling(temperature=0.5, top_p=0)


def test_greedy_setting_is_as_before_and_sampled_ones_refuse_to_mix():
    suite = load_suite("samples", limit=2, benchmarks=["nq"])
    greedy = eval_settings(suite, 2, 0, Limits(), "hf")
    assert greedy["sampling"] == GREEDY == {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    assert eval_settings(suite, 2, 0, Limits(), "hf", sampling=Sampling(seed=7)) == greedy  # seed unused
    sampled = eval_settings(suite, 2, 0, Limits(), "hf", sampling=Sampling(4, 0.7, seed=1))
    assert sampled["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "samples": 4, "seed": 1}
    diffs = differences(greedy, sampled)
    assert [d[0] for d in diffs] == ["sampling"]
    assert "sampling is {'temperature': 0.0" in mismatch_message("a", "b", diffs, "fix")
    for other in (Sampling(4, 0.7, seed=2), Sampling(2, 0.7, seed=1), Sampling(4, 0.7, 0.9, seed=1)):
        theirs = eval_settings(suite, 2, 0, Limits(), "hf", sampling=other)
        assert [d[0] for d in differences(sampled, theirs)] == ["sampling"]


def test_sample_seeds_differ_by_sample_and_row_and_repeat():
    s = Sampling(4, 0.7, seed=3)
    seeds = {s.seed_of(b, q, i) for b in ("nq", "hotpotqa") for q in ("1", "2") for i in range(4)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)
    assert s.seed_of("nq", "1", 0) == Sampling(4, 0.7, seed=3).seed_of("nq", "1", 0)
    assert s.seed_of("nq", "1", 0) != Sampling(4, 0.7, seed=4).seed_of("nq", "1", 0)


def test_a_rollout_seed_reaches_the_agent_loops_tasks():
    """The LLM clients read the seed in tasks the agent loop creates: the context is inherited."""

    async def client_call(prompt: list[int]) -> dict:
        return seeded({"temperature": 0.7, "max_tokens": 4}, prompt)

    async def rollout(seed: int | None) -> dict:
        token = ROLLOUT_SEED.set(seed)
        try:
            return await asyncio.create_task(client_call([1, 2, 3]))
        finally:
            ROLLOUT_SEED.reset(token)

    assert asyncio.run(rollout(11))["seed"] == turn_seed(11, [1, 2, 3]) != turn_seed(11, [1, 2, 3, 4])
    assert "seed" not in asyncio.run(rollout(None))
    assert "seed" not in seeded({"temperature": 0}, [1])  # greedy requests carry no seed


class SeedEcho:
    """A backend answering the gold answer for even seeds, nothing for odd ones; records the seeds."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.seeds: list[int | None] = []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def rollout_one(self, row, seed=None):
        self.seeds.append(seed)
        gold = row["reward_model"]["ground_truth"]["target"][0]
        answer = gold if seed is None or seed % 2 == 0 else "wrong"
        return {"response": f"<answer>{answer}</answer>", "termination": "answer", "searches": 0}

    def close(self):
        self.loop.close()


def _plan(tmp_path: Path, sampling: Sampling) -> runner.EvalSetup:
    suite = load_suite("samples", limit=3, benchmarks=["nq", "bamboogle"])
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    return runner.EvalSetup(
        run_name="em_only_s1",
        out_root=tmp_path / "out",
        suite=suite,
        checkpoints=[ckpts.Checkpoint(5, model, "hf")],
        info={"run": "em_only_s1", "shape": "em_only", "seed": 1, "horizon": 5, "config": {}},
        limits=Limits(),
        backend="hf",
        retriever_urls=["http://127.0.0.1:9"],
        max_in_flight=4,
        eval_settings=eval_settings(suite, 3, 0, Limits(), "hf", sampling=sampling),
        sampling=sampling,
    )


def test_sampled_rows_and_summary(tmp_path: Path):
    sampling = Sampling(3, 0.7, seed=2)
    plan = _plan(tmp_path, sampling)
    backend = SeedEcho()
    summary = runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: backend, log=lambda _: None)
    rows = RowStore(plan.run_root / "global_step_5" / "rows.jsonl").rows()
    assert len(rows) == 18 and len({row_key(r) for r in rows}) == 18
    assert [r["sample"] for r in rows[:3]] == [0, 1, 2] and rows[0]["id"] == rows[2]["id"]
    assert sorted(backend.seeds) == sorted(
        sampling.seed_of(r["benchmark"], r["id"], r["sample"]) for r in rows
    )
    for r in rows:  # each sample scored with the outcome its own seed gave
        assert r["em"] == float(sampling.seed_of(r["benchmark"], r["id"], r["sample"]) % 2 == 0)
    for bench, entry in summary["benchmarks"].items():
        assert entry["n"] == 3 and entry["samples"] == 3
        em = np.array(
            [
                [r["em"] for r in rows if r["benchmark"] == bench and r["id"] == q]
                for q in dict.fromkeys(r["id"] for r in rows if r["benchmark"] == bench)
            ]
        )
        expected = pass_at_ks(em).mean(axis=0)
        got = [entry[k] for k in ("pass@1", "pass@2", "pass@3", "avg@3")]
        assert np.allclose(got, expected) and math.isclose(entry["em"], entry["avg@3"])
        assert all(entry["ci"][k][0] <= entry[k] <= entry["ci"][k][1] for k in ("pass@1", "pass@3", "avg@3"))
    macro = summary["macro"]
    assert math.isclose(macro["pass@2"], np.mean([e["pass@2"] for e in summary["benchmarks"].values()]))
    assert set(macro["ci"]) == {"pass@1", "pass@2", "pass@3", "avg@3"}

    # a rerun rolls out nothing and returns the same summary
    again = SeedEcho()
    assert runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: again, log=lambda _: None) == summary
    assert again.seeds == []


def test_greedy_rows_and_summary_have_no_sample_fields(tmp_path: Path):
    plan = _plan(tmp_path, Sampling())
    backend = SeedEcho()
    summary = runner.evaluate_step(plan, plan.checkpoints[0], lambda c, m: backend, log=lambda _: None)
    rows = RowStore(plan.run_root / "global_step_5" / "rows.jsonl").rows()
    assert backend.seeds == [None] * 6 and all("sample" not in r for r in rows)
    assert {row_key(r) for r in rows} == {q.key for qs in plan.suite.benchmarks.values() for q in qs}
    assert summary == {
        **summarize(rows, ["nq", "bamboogle"], 5, plan.limits.preset),
        "eval": summary["eval"],
    }
    assert not [k for e in [*summary["benchmarks"].values(), summary["macro"]] for k in e if "@" in k]


def test_sampled_summary_needs_every_sample():
    rows = [{"benchmark": "nq", "id": "1", "sample": 0, "em": 1.0, "f1": 1.0, "acc": 1.0, "prediction": "x"}]
    with pytest.raises(ValueError, match=r"do not have samples 0..1"):
        summarize(rows, ["nq"], 1, samples=2)


@pytest.mark.slow
def test_eval_sh_passes_samples_temperature_and_sample_seed(tmp_path: Path):
    from eval.run.cli import load_config
    from launch.evaluate import DEFAULT_RECIPE, HELP, eval_command, load_settings

    def settings_read(env: dict[str, str]):
        """The ``eval:`` block ``python -m eval run`` reads from the recipe launch/eval.sh hands it."""
        cmd = eval_command(tmp_path, load_settings(DEFAULT_RECIPE, [], env), tmp_path)
        return load_config(tmp_path, Path(cmd[cmd.index("--config") + 1]), []).eval

    assert all(var in HELP for var in ("SAMPLES", "TEMPERATURE", "SAMPLE_SEED"))
    env = {"SAMPLES": "4", "TEMPERATURE": "0.7", "SAMPLE_SEED": "3", "RETRIEVER_URL": "http://127.0.0.1:9"}
    e = settings_read(env)
    assert (e.samples, e.temperature, e.sample_seed, e.seed) == (4, 0.7, 3, None)
    e = settings_read({"RETRIEVER_URL": env["RETRIEVER_URL"]})
    assert (e.samples, e.temperature, e.sample_seed) == (None, None, None)  # greedy
    with pytest.raises(ValueError, match="eval.samples: Value 'four'"):
        settings_read({**env, "SAMPLES": "four"})


def test_vllm_requests_carry_the_seed_of_a_sampled_rollout():
    from eval.run.backends import VLLMEngineClient

    params = {"max_tokens": 4, "temperature": 0.7, "top_p": 0.9}
    assert "seed" not in VLLMEngineClient.sampling_kwargs(params)
    token = ROLLOUT_SEED.set(9)
    try:
        kwargs = VLLMEngineClient.sampling_kwargs(seeded(params, [5, 6]))
    finally:
        ROLLOUT_SEED.reset(token)
    assert kwargs["seed"] == turn_seed(9, [5, 6]) and kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9


def test_the_judge_share_of_a_sampled_summary_counts_every_sample():
    from eval.run.summary import add_judge

    rows = [
        {
            "benchmark": "nq",
            "id": q,
            "sample": i,
            "em": float(i == 0),
            "f1": 0.0,
            "acc": 0.0,
            "prediction": "x",
        }
        for q in ("1", "2")
        for i in range(2)
    ]
    summary = summarize(rows, ["nq"], 1, samples=2)
    add_judge(summary, rows, ["correct", "correct", "correct", "incorrect"], {"model": "m", "prompt": "v"})
    assert summary["benchmarks"]["nq"]["n"] == 2 and summary["benchmarks"]["nq"]["judge"] == 0.75
