"""The retrieval server's answer budget (`search_env/retrieval/answers.py`): the per-client byte-rate
bound (--max-answer-mb-per-s-per-client) as a property of its two pure functions, and on the real
`AnswerBudget` in an event loop: a client re-asking large answers is paced, another is not."""

from __future__ import annotations

import asyncio
import time

from hypothesis import given
from hypothesis import strategies as st

from search_env.retrieval.answers import AnswerBudget, paced_wait, paid_until
from search_env.retrieval.limits import Limits


@given(
    rate=st.floats(1e3, 1e8),
    burst_bytes=st.integers(1, 10**7),
    answers=st.lists(st.tuples(st.floats(0, 5), st.integers(1, 10**7)), min_size=1, max_size=40),
)
def test_bytes_built_in_any_window_stay_under_burst_plus_rate(rate, burst_bytes, answers):
    """Simulated: each answer asked ``gap`` seconds after the last was built, built once
    `paced_wait` allows; in every window the bytes built are at most burst + rate x window + one
    answer (the one that overdraws)."""
    burst_s, now, due = burst_bytes / rate, 0.0, 0.0
    built: list[tuple[float, int]] = []
    for gap, size in answers:
        now += gap
        now += paced_wait(due, now, burst_s)
        due = paid_until(due, now, size, rate)
        built.append((now, size))
    biggest = max(size for _, size in built)
    for i, (start, _) in enumerate(built):
        for j in range(i, len(built)):
            window = built[j][0] - start
            total = sum(size for _, size in built[i : j + 1])
            assert total <= burst_bytes + rate * window + biggest + 1e-6 * total


def test_an_idle_client_saves_up_no_more_than_its_burst():
    assert paid_until(due=0.0, now=100.0, size=10, rate=10.0) == 101.0
    assert paced_wait(due=101.0, now=100.0, burst_s=1.0) == 0.0
    assert paced_wait(due=103.0, now=100.0, burst_s=1.0) == 2.0


def test_the_default_rate_is_on_and_zero_turns_it_off():
    assert Limits().max_answer_mb_per_s_per_client > 0
    assert Limits(max_answer_mb_per_s_per_client=0).max_answer_mb_per_s_per_client == 0


def test_a_client_re_asking_large_answers_is_paced_and_another_is_not():
    """1 MB/s after a 100 kB burst: ten 100 kB answers of client A take at least 0.8 s; client B's
    one answer, asked after A's second, is built before A's last."""
    size = 100_000

    async def scenario() -> tuple[float, list[str]]:
        budget = AnswerBudget(max_bytes=size, bytes_per_s=1_000_000)
        order: list[str] = []
        second = asyncio.Event()

        async def one(client: str) -> None:
            response = await budget.answer(client, lambda: b"x" * size)
            order.append(client)
            response.done()  # handed to the socket at once

        async def client_a() -> None:
            for k in range(10):
                await one("a")
                if k == 1:
                    second.set()

        start = time.monotonic()
        task = asyncio.create_task(client_a())
        await second.wait()
        await one("b")
        await task
        budget.close()
        return time.monotonic() - start, order

    elapsed, order = asyncio.run(scenario())
    assert elapsed >= 0.8 - 0.05, elapsed
    assert order.index("b") < len(order) - 1 and order[-1] == "a", order
