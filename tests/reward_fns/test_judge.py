"""The judge client (reward_fns.judge) against a real OpenAI-compatible HTTP server on 127.0.0.1
(tests/fixtures/openai_stub.py as a child process): T = 0 sent, answers cut, JSON verdicts parsed,
replies that do not parse counted as unparsed, bounded concurrency, retries with backoff, timeouts,
refusals, and the verdict cache (keys, appends, a rerun that calls nothing)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reward_fns.judge import (
    PROMPT_VERSION,
    JudgeConfig,
    JudgeError,
    Verdict,
    VerdictCache,
    ajudge_many,
    judge_many,
    parse_verdict,
    verdict_key,
)
from search_env.retrieval.process import free_port

STUB = Path(__file__).resolve().parents[1] / "fixtures" / "openai_stub.py"


class Stub:
    def __init__(self, *args: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, str(STUB), str(port), *args])
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("the OpenAI stub did not start") from None
                time.sleep(0.05)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=5).json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.stop()


def test_verdicts_in_order_at_t0_with_answers_cut(stub):
    cfg = JudgeConfig(url=stub.url, model="judge-a", answer_chars=8)
    items = [
        ("Capital of France?", ["Paris"], "paris"),
        ("Capital of Italy?", ["Rome", "Roma"], "Milan"),
        ("Who wrote it?", ["Ann"], None),
        ("Who wrote it?", ["Ann"], "   "),
        ("Longest river?", ["Nile"], "Nile      and a very long tail the judge never sees"),
    ]
    verdicts, calls = judge_many(cfg, items)
    assert [v.judgement for v in verdicts] == ["correct", "incorrect", "incorrect", "incorrect", "correct"]
    assert [v.correct for v in verdicts] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert verdicts[0].rationale == "compared with the golds"
    assert calls == 3  # the missing and the blank prediction are not sent
    requests = stub.stats()["requests"]
    assert len(requests) == 3
    assert {r["temperature"] for r in requests} == {0}
    assert {r["model"] for r in requests} == {"judge-a"}
    assert {r["max_tokens"] for r in requests} == {512}
    long_prompt = next(
        r["messages"][-1]["content"] for r in requests if "Longest" in r["messages"][-1]["content"]
    )
    assert "Predicted answer: Nile\n" in long_prompt and "tail" not in long_prompt


def test_a_reply_without_a_verdict_is_unparsed_never_correct(stub):
    cfg = JudgeConfig(url=f"{stub.url}/v1", model="judge-a")
    verdicts, calls = judge_many(cfg, [("Q?", ["garbage"], "garbage")])
    assert calls == 1
    assert verdicts[0].judgement == "unparsed" and verdicts[0].correct == 0.0
    assert "probably right" in verdicts[0].rationale


@pytest.mark.parametrize(
    ("reply", "judgement"),
    [
        ('{"rationale": "same city", "judgement": "correct"}', "correct"),
        ('```json\n{"rationale": "r", "judgement": " Incorrect "}\n```', "incorrect"),
        ('<think>{"judgement": "correct"}</think>{"rationale": "no", "judgement": "incorrect"}', "incorrect"),
        ('{"rationale": "r", "judgement": "partially correct"}', "unparsed"),
        ('{"rationale": "r", "judgement": "correct"', "unparsed"),
        ('["correct"]', "unparsed"),
        ("correct", "unparsed"),
        ("", "unparsed"),
    ],
)
def test_parse_verdict(reply, judgement):
    assert parse_verdict(reply).judgement == judgement


def test_concurrency_is_bounded_and_used():
    server = Stub("--hold", "3")  # each request waits until 3 are in flight (a serial client would stall)
    try:
        cfg = JudgeConfig(url=server.url, model="judge-a", max_concurrency=3)
        items = [(f"Q{i}?", ["a"], "a") for i in range(12)]
        verdicts, calls = judge_many(cfg, items)
        assert calls == 12 and all(v.judgement == "correct" for v in verdicts)
        assert server.stats()["max_in_flight"] == 3
    finally:
        server.stop()


def test_retryable_errors_are_retried_with_backoff(stub):
    cfg = JudgeConfig(url=stub.url, model="judge-a", retries=2)
    verdicts, calls = judge_many(cfg, [("Q?", ["flaky"], "flaky")])
    assert verdicts[0].judgement == "correct" and calls == 1
    assert len(stub.stats()["requests"]) == 3  # two 503s, then the answer


def test_an_endpoint_still_failing_after_its_retries_raises(stub):
    cfg = JudgeConfig(url=stub.url, model="judge-a", retries=1)
    with pytest.raises(JudgeError, match="after 2 attempts: HTTP 503"):
        judge_many(cfg, [("Q?", ["x"], "flaky-2")])


def test_a_timeout_is_retried_then_raises(stub):
    cfg = JudgeConfig(url=stub.url, model="judge-a", timeout_s=0.3, retries=1)
    with pytest.raises(JudgeError, match="timeout_s=0.3"):
        judge_many(cfg, [("Q?", ["x"], "slow")])
    assert len(stub.stats()["requests"]) == 2


def test_a_refused_request_raises_at_once_naming_the_model(stub):
    cfg = JudgeConfig(url=stub.url, model="missing", retries=3)
    with pytest.raises(JudgeError, match=r"model 'missing': HTTP 404.*--judge-model"):
        judge_many(cfg, [("Q?", ["x"], "y")])
    assert len(stub.stats()["requests"]) == 1


def test_no_server_raises_rather_than_scoring_zero():
    cfg = JudgeConfig(url=f"http://127.0.0.1:{free_port()}", model="judge-a", retries=1)
    with pytest.raises(JudgeError, match="failed after 2 attempts"):
        judge_many(cfg, [("Q?", ["x"], "y")])


def test_verdict_key_is_canonical_and_covers_every_part():
    base = ("m", PROMPT_VERSION, "Q?", ["a", "b"], "p")
    key = verdict_key(*base)
    assert len(key) == 64 and key == verdict_key("m", PROMPT_VERSION, "Q?", ("a", "b"), "p")
    for i, other in enumerate(["m2", "judge-v0", "Q2?", ["a"], "p2"]):
        changed = list(base)
        changed[i] = other
        assert verdict_key(*changed) != key


def test_cache_makes_a_rerun_call_nothing_and_dedupes(stub, tmp_path):
    cfg = JudgeConfig(url=stub.url, model="judge-a")
    path = tmp_path / "judge" / "verdicts.jsonl"
    items = [("Q1?", ["a"], "a"), ("Q2?", ["b"], "c"), ("Q1?", ["a"], "a"), ("Q3?", ["x"], "garbage")]
    first, calls = judge_many(cfg, items, VerdictCache(path))
    assert calls == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["judgement"] for r in rows] == ["correct", "incorrect", "unparsed"]
    assert set(rows[0]) == {"key", "judgement", "rationale"}
    again, calls = judge_many(cfg, items, VerdictCache(path))  # a fresh process reads the file
    assert calls == 0 and again == first
    assert len(stub.stats()["requests"]) == 3
    # another judge model shares nothing
    _, calls = judge_many(JudgeConfig(url=stub.url, model="judge-b"), items[:1], VerdictCache(path))
    assert calls == 1


def test_cache_reads_other_writers_and_skips_a_torn_line(tmp_path):
    path = tmp_path / "verdicts.jsonl"
    reader, writer = VerdictCache(path), VerdictCache(path)
    writer.put_many({"k1": Verdict("correct", "r")})
    assert reader.get("k1") == Verdict("correct", "r")  # appended by another writer after reader opened
    with open(path, "a") as handle:
        handle.write('{"key": "k2", "judge')  # a crash mid-write
    writer.put_many({"k3": Verdict("incorrect", "")})
    fresh = VerdictCache(path)
    assert fresh.get("k2") is None and fresh.get("k3") == Verdict("incorrect", "")
    assert len(fresh) == 2


def test_ajudge_many_awaits_and_judge_many_works_inside_a_running_loop(stub):
    cfg = JudgeConfig(url=stub.url, model="judge-a")

    async def main() -> tuple[list[Verdict], int, list[Verdict]]:
        verdicts, calls = await ajudge_many(cfg, [("Q?", ["a"], "a")])
        inner, _ = judge_many(cfg, [("Q?", ["a"], "b")])
        return verdicts, calls, inner

    verdicts, calls, inner = asyncio.run(main())
    assert verdicts[0].judgement == "correct" and calls == 1
    assert inner[0].judgement == "incorrect"


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://h:1", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1/", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1/chat/completions", "http://h:1/v1/chat/completions"),
    ],
)
def test_endpoint(url, endpoint):
    assert JudgeConfig(url=url, model="m").endpoint == endpoint


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="judge url"):
        JudgeConfig(url="127.0.0.1:8000", model="m")
    with pytest.raises(ValueError, match="--judge-model"):
        JudgeConfig(url="http://h", model="")
    with pytest.raises(ValueError, match="max_concurrency=0"):
        JudgeConfig(url="http://h", model="m", max_concurrency=0)


def test_verdicts_judged_before_a_failure_are_kept(stub, tmp_path):
    cfg = JudgeConfig(url=stub.url, model="judge-a", retries=0)
    path = tmp_path / "verdicts.jsonl"
    items = [("Q1?", ["a"], "a"), ("Q2?", ["x"], "flaky-3"), ("Q3?", ["b"], "c")]
    with pytest.raises(JudgeError, match="HTTP 503"):
        judge_many(cfg, items, VerdictCache(path))
    assert len(path.read_text().splitlines()) == 2  # the two answered verdicts are stored
    again, calls = judge_many(
        JudgeConfig(url=stub.url, model="judge-a", retries=2), items, VerdictCache(path)
    )
    assert calls == 1 and [v.judgement for v in again] == ["correct", "incorrect", "incorrect"]
