"""The demo warm start: teacher turns rendered by the protocol + chat template, demonstrations from
verl's agent loop against a real BM25 server, the cache key, the SFT loss mask."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from search_demo import base_model, tiny, trajectories, warm_start, world
from search_env import protocol
from search_env.paths import REPO_ROOT
from search_env.safe_fs import UnsafeDeleteError


@pytest.fixture(scope="module")
def demo_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sizes = {
        "train": world.RegionSize(countries=2, cities=4, people=12, companies=4),
        "val": world.RegionSize(countries=1, cities=2, people=3, companies=1),
        "test": world.RegionSize(countries=1, cities=2, people=4, companies=2),
    }
    return world.write_world(world.build_world(4, sizes), tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def random_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny.build_demo_tokenizer(trajectories.tokenizer_texts())
    return tiny.build_random_model(tmp_path_factory.mktemp("model"), tokenizer, tiny.DEMO_TEXT_CONFIG, seed=0)


def _row(qtype: str) -> dict:
    return next(r for r in world.build_world(0).questions["train"] if r["type"] == qtype)


def test_turn_text_continues_each_generation_prompt_and_stops_like_a_generator():
    row = _row("two_hop")
    first_prompt = "<|im_start|>assistant\n<think>\n"  # thinking on: the first generation prompt
    call = trajectories.turn_text(first_prompt, trajectories.assistant_message(row, 0), row["question"])
    assert call.endswith(protocol.render_search_call(row["hops"][0]["subject"]))
    assert "<think>" not in call and "</think>" in call  # the prompt already opened the think block
    later = trajectories.turn_text(
        "<|im_start|>assistant\n", trajectories.assistant_message(row, 2), row["question"]
    )
    assert later.startswith("<think>") and later.endswith(protocol.render_answer(row["golden_answers"][0]))
    assert protocol.find_stop(later) == len(later)  # cut right after </answer>, nothing sampled past it


def test_rendered_trajectory_scores_as_a_correct_answer():
    from reward_fns.compute_score import compute_score

    row = _row("single_hop")
    text = trajectories.render_trajectory(row, [['"A"\nsome passage.']])
    response = text.split("<|im_start|>assistant\n", 1)[1]
    scored = compute_score(
        data_source="world",
        solution_str=response,
        ground_truth={"target": row["golden_answers"]},
        shape="f1_format",
    )
    assert scored["em"] == 1.0 and scored["well_formed"]


@pytest.mark.slow
def test_demonstrations_come_from_the_agent_loop_and_mask_only_the_model_turns(demo_world, random_demo_model):
    from transformers import AutoTokenizer

    cfg = replace(warm_start.WarmStartConfig(), single_hop=6, two_hop=4)  # per world
    with warm_start.bm25_server(demo_world / "corpus.jsonl") as url:
        samples, counts = warm_start.demonstrations(random_demo_model, demo_world, cfg, url)
    assert counts["single_hop"] + counts["two_hop"] + counts["dropped"] == 10 and len(samples) >= 6
    tok = AutoTokenizer.from_pretrained(random_demo_model)
    for sample in samples:
        assert len(sample["ids"]) == len(sample["mask"])
        model_text = tok.decode([t for t, m in zip(sample["ids"], sample["mask"], strict=True) if m])
        full = tok.decode(sample["ids"])
        assert "<tool_call>" in model_text and "<answer>" in model_text
        assert "<tool_response>" in full and "<tool_response>" not in model_text  # retrieved text unmasked
        assert model_text.rstrip().endswith("</answer>")


def test_cache_key_follows_the_inputs(tmp_path: Path):
    from search_demo import base_model

    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"")
    (base / base_model.STAMP).write_text('{"key": "one"}')
    cfg = warm_start.WarmStartConfig()
    key = warm_start.cache_key(cfg, base)
    assert warm_start.cache_key(cfg, base) == key
    assert warm_start.cache_key(replace(cfg, steps=cfg.steps + 1), base) != key
    (base / base_model.STAMP).write_text('{"key": "two"}')  # another base model -> another warm start
    assert warm_start.cache_key(cfg, base) != key


@pytest.mark.parametrize("regime", sorted(warm_start.SHIPPED))
def test_the_shipped_warm_starts_are_what_the_code_builds(regime: str):
    """assets/warm_start_<regime> (shipped built: a warm start trained on another CPU is another
    model) must carry the key the code computes now; when it fails, rebuild and commit it."""
    from search_demo import base_model

    folder = warm_start.SHIPPED[regime]
    stamp = json.loads((folder / warm_start.STAMP).read_text())
    want = warm_start.cache_key(warm_start.REGIMES[regime], base_model.SHIPPED)
    assert stamp["key"] == want, (
        f"{folder.name} was built from other inputs (key {stamp['key']}, the code's {want}); rebuild it: "
        f".venv/bin/python -m search_demo.warm_start --out assets/{folder.name} --regime {regime} --force, "
        "then commit it (and rerun what was trained from the old one)"
    )
    assert (folder / "model.safetensors").stat().st_size > 1_000_000


def test_a_matching_shipped_warm_start_is_copied_not_trained(tmp_path: Path):
    logged: list[str] = []
    out = warm_start.ensure_warm_start(tmp_path / "ws", warm_start.REGIMES["sparse"], log=logged.append)
    shipped = warm_start.SHIPPED["sparse"]
    assert (out / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert logged == [
        f"warm start {json.loads((shipped / warm_start.STAMP).read_text())['key']}: copied "
        f"the shipped assets/warm_start_sparse to {out} (no SFT: same inputs)"
    ]
    assert warm_start.ensure_warm_start(out, warm_start.REGIMES["sparse"], log=logged.append) == out
    assert len(logged) == 1  # cached now


def test_a_folder_the_builder_did_not_write_is_never_deleted(tmp_path: Path):
    """--out (or a leftover .partial) without this builder's stamp and not empty: refused, naming
    --out, before anything is built or deleted; a stamped one (another key) is replaced."""
    foreign = tmp_path / "ws"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    for build in (warm_start.ensure_warm_start, warm_start.build_warm_start):
        with pytest.raises(UnsafeDeleteError, match=r"^--out: .*holds no warm_start.json.*Fix: give --out"):
            build(foreign, warm_start.REGIMES["sparse"], log=print)
    with pytest.raises(SystemExit, match="--out"):
        warm_start.main(["--out", str(foreign), "--regime", "sparse"])
    assert [p.name for p in tmp_path.iterdir()] == ["ws"] and (foreign / "thesis.tex").is_file()
    stale = tmp_path / "stale"
    shutil.copytree(warm_start.SHIPPED["dense"], stale)  # a warm start of another key: ours to replace
    leftover = tmp_path / "stale.partial"
    leftover.mkdir()
    (leftover / warm_start.STAMP).write_text('{"partial": true}\n')  # a killed build's stage
    warm_start.ensure_warm_start(stale, warm_start.REGIMES["sparse"], log=print)
    shipped = warm_start.SHIPPED["sparse"]
    assert (stale / warm_start.STAMP).read_bytes() == (shipped / warm_start.STAMP).read_bytes()
    assert not leftover.exists()
    (tmp_path / "other.partial").mkdir()
    (tmp_path / "other.partial" / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeDeleteError, match="other.partial"):
        warm_start.ensure_warm_start(tmp_path / "other", warm_start.REGIMES["sparse"], log=print)
    assert (tmp_path / "other.partial" / "notes.txt").read_text() == "mine"


def test_the_flawed_teacher_answers_the_bridge_entity_on_a_seeded_share_of_two_hop_questions():
    rows = world.build_world(0).questions["train"]
    cfg = replace(warm_start.WarmStartConfig(), two_hop_stop_early=0.5)
    picked = warm_start._pick_rows(rows, cfg)
    assert picked == warm_start._pick_rows(rows, cfg)  # a seeded draw
    two = [r for r in picked if r["type"] == "two_hop"]
    early = [r for r in two if len(r["hops"]) == 1]
    assert 0.3 < len(early) / len(two) < 0.7
    originals = {r["id"]: r for r in rows}
    for row in early:
        bridge = originals[row["id"]]["hops"][0]["answer"]
        assert row["golden_answers"] == [bridge] != originals[row["id"]]["golden_answers"]
        assert trajectories.assistant_message(row, 0)["tool_calls"][0]["function"]["arguments"] == {
            "query": originals[row["id"]]["hops"][0]["subject"]
        }
        assert trajectories.assistant_message(row, 1)["content"] == protocol.render_answer(bridge)
    flawless = warm_start._pick_rows(rows, replace(cfg, two_hop_stop_early=0.0))
    assert [r["id"] for r in flawless] == [r["id"] for r in picked]  # the same questions, in order
    assert all(r == originals[r["id"]] for r in flawless)


def test_a_world_whose_teacher_rollouts_fail_stops_the_build(tmp_path: Path, demo_world: Path):
    """Searches that miss their passages (here: the corpus of another world) drop the world's
    demonstrations; past MAX_DROPPED_SHARE the build stops, naming the world, and writes nothing."""
    wrong = tmp_path / "world_wrong_corpus"
    wrong.mkdir()
    shutil.copy(demo_world / "train.jsonl", wrong / "train.jsonl")
    (wrong / "corpus.jsonl").write_text(
        "".join(json.dumps(p) + "\n" for p in world.build_world(9).passages), encoding="utf-8"
    )
    out = tmp_path / "ws"
    cfg = replace(warm_start.REGIMES["sparse"], steps=1)
    with pytest.raises(
        RuntimeError, match=r"world_wrong_corpus: \d+ of \d+ teacher rollouts dropped.*Fix: build again"
    ):
        warm_start.sft_into(
            out,
            base_model.SHIPPED,
            "key",
            cfg,
            lambda tmp: iter([(wrong, None)]),
            {},
            "warm start",
            log=print,
        )
    assert not out.exists()


def test_sigterm_during_a_build_stops_the_teacher_server(tmp_path: Path, demo_world: Path):
    """A builder terminated while its BM25 server runs (``python -m search_demo.transfer_warm_start``
    stopped by SIGTERM) stops the server: it was left running before."""
    script = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from search_demo.warm_start import bm25_server\n"
        "with bm25_server(Path(sys.argv[1])) as url:\n"
        "    Path(sys.argv[2]).write_text(url)\n"
        "    time.sleep(120)\n"
    )
    marker = tmp_path / "url"
    builder = subprocess.Popen(
        [sys.executable, "-c", script, str(demo_world / "corpus.jsonl"), str(marker)], cwd=REPO_ROOT
    )
    servers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        servers += [
            p for p in psutil.Process(builder.pid).children() if "search_env.retrieval" in p.cmdline()
        ]
        assert len(servers) == 1
        builder.terminate()
        assert builder.wait(timeout=30) != 0
        servers[0].wait(timeout=15)  # gone (psutil.TimeoutExpired otherwise)
    finally:
        builder.kill()
        builder.wait(timeout=30)
        for server in servers:  # stopped by PID if the test failed
            if server.is_running():
                server.kill()
