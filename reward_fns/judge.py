"""An LLM judge over any OpenAI-compatible chat-completions endpoint (docs/evaluation.md, "The judge").

The judge reads a question, its gold answers and a prediction (cut to ``answer_chars`` characters)
in :mod:`reward_fns.judge_prompt`'s prompt and answers a JSON verdict at temperature 0. Calls run
concurrently (at most ``max_concurrency`` in flight; the server batches them). Each request gets
``retries + 1`` attempts in one loop (:func:`_attempts`): a timeout, a connection error or a retryable
status is tried again after a backoff, a reply without a verdict is asked again at once; an endpoint
that still fails raises :class:`JudgeError`, never a silent 0, and a question whose every reply was
unparsable is ``unparsed``. Final verdicts are cached in an append-only JSONL file keyed by
:func:`verdict_key`, so a rerun calls nothing for them and asks the ``unparsed`` ones again.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from reward_fns.judge_prompt import (
    FINAL,
    PROMPT_VERSION,
    RATIONALE_CHARS,
    Verdict,
    parse_verdict,
    render_prompt,
)

NO_ANSWER = "no answer to judge"
"""The rationale of the ``incorrect`` verdict given, without a call, to a missing or empty prediction."""

TOO_LONG = "answer longer than max_answer_chars={}: not judged"
"""The rationale of the ``incorrect`` verdict given, without a call, to an answer over the limit."""

REASK_TEMPERATURE = 0.6
"""Temperature of a request asked again after a reply without a verdict (at T = 0 a server would
repeat the same reply); the first request of every question is at T = 0."""

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
"""HTTP statuses retried with backoff; any other error status fails at once (:func:`_refused`)."""

_BACKOFF_S = 0.5
_BACKOFF_CAP_S = 8.0

T = TypeVar("T")


@dataclass(frozen=True)
class JudgeConfig:
    """Where and how to ask the judge.

    ``url``: the endpoint's base (``http://127.0.0.1:8000`` or ``.../v1``) or the full
    ``.../v1/chat/completions``. ``model``: the served model name. ``timeout_s``: per request, seconds.
    ``retries``: extra attempts after the first on a timeout, connection error, retryable status or a
    reply without a verdict. ``answer_chars``: the prediction is cut to this many characters.
    ``max_answer_chars``: a longer prediction (stripped) is ``incorrect`` without a call (None: no
    limit). ``max_tokens``: of the reply. An API key, when the endpoint needs one, is read from the
    ``JUDGE_API_KEY`` environment variable.
    """

    url: str
    model: str
    max_concurrency: int = 16
    timeout_s: float = 60.0
    retries: int = 4
    answer_chars: int = 500
    max_tokens: int = 512
    max_answer_chars: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"judge url {self.url!r}: give an http(s) URL, e.g. http://127.0.0.1:8000/v1")
        if not self.model:
            raise ValueError("judge model: give the served model's name (--judge-model / JUDGE_MODEL)")
        for name in ("max_concurrency", "answer_chars", "max_tokens", "max_answer_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"judge {name}={value}: must be >= 1")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError(f"judge retries={self.retries}, timeout_s={self.timeout_s}: need >= 0 and > 0")

    @property
    def endpoint(self) -> str:
        """The chat-completions URL the requests go to."""
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


class JudgeError(RuntimeError):
    """The judge endpoint failed after its retries (or refused the request); nothing was scored."""


Item = tuple[str, Sequence[str], "str | None"]
"""(question, gold answers, prediction or None)."""


def cut(prediction: str, answer_chars: int) -> str:
    """The prediction the judge sees: its first ``answer_chars`` characters, whitespace stripped."""
    return prediction.strip()[:answer_chars].strip()


def verdict_key(
    model: str, prompt_version: str, max_tokens: int, question: str, golds: Sequence[str], prediction: str
) -> str:
    """sha256 hex of the canonical JSON of (judge model, prompt version, reply budget, question,
    golds, prediction).

    Golds keep their order (the prompt lists them in it). :func:`ajudge_many` keys the prediction as
    the judge sees it (:func:`cut`), so ``answer_chars`` is part of the key too.
    """
    canonical = json.dumps(
        [model, prompt_version, max_tokens, question, list(golds), prediction],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class VerdictCache:
    """Verdicts by :func:`verdict_key` in an append-only JSONL file, one
    ``{"key", "judgement", "rationale"}`` per line.

    Only final verdicts (``correct``, ``incorrect``) are read back: an ``unparsed`` line records what
    the judge said and marks its key to be asked again. Appends hold an exclusive ``flock`` and are fsynced, so several processes may share one file; a
    ``get`` that misses first reads what others appended since. A torn last line (a crash mid-write)
    is skipped. The parent directory is created.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._verdicts: dict[str, Verdict] = {}
        self._offset = 0
        self._lock = threading.Lock()
        self._read_new()

    def _read_new(self) -> None:
        """Load the complete lines appended since the last read."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
                if row["judgement"] in FINAL:
                    self._verdicts[row["key"]] = Verdict(row["judgement"], row.get("rationale", ""))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        self._offset += end

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, key: str) -> Verdict | None:
        """The cached final verdict for ``key``, or None."""
        with self._lock:
            if key not in self._verdicts:
                self._read_new()
            return self._verdicts.get(key)

    def put_many(self, verdicts: dict[str, Verdict]) -> None:
        """Append ``verdicts`` (one fsynced write under an exclusive lock); a no-op when empty."""
        if not verdicts:
            return
        payload = "".join(
            json.dumps({"key": k, "judgement": v.judgement, "rationale": v.rationale}, ensure_ascii=False)
            + "\n"
            for k, v in verdicts.items()
        ).encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    payload = b"\n" + payload  # a torn line from a crash: start on a fresh line
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            self._read_new()
            self._verdicts.update({k: v for k, v in verdicts.items() if v.judgement in FINAL})


def _headers() -> dict[str, str]:
    key = os.environ.get("JUDGE_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


class _NoVerdict(Exception):
    """A 200 reply that holds no verdict: asked again at once; its ``unparsed`` verdict is kept."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.rationale)
        self.verdict = verdict


def _refused(cfg: JudgeConfig, url: str, response: httpx.Response) -> JudgeError:
    """The error of a status that is not retried, naming its likely causes."""
    causes = {
        400: "the prompt plus max_tokens may exceed the judge's context length (raise MAX_MODEL_LEN, "
        "or lower --judge-max-tokens / answer_chars), or the model name or a parameter is wrong "
        "(check --judge-model / JUDGE_MODEL)",
        401: "the endpoint needs an API key: set JUDGE_API_KEY",
        403: "the endpoint refused JUDGE_API_KEY",
        404: "check --judge-url / --judge-model",
        413: "the request is too large for the endpoint: lower answer_chars",
    }
    why = causes.get(response.status_code, "check --judge-url / --judge-model")
    return JudgeError(
        f"judge {url} refused model {cfg.model!r}: HTTP {response.status_code}: {response.text[:300]} ({why})"
    )


async def _attempts(
    cfg: JudgeConfig,
    url: str,
    send: Callable[[bool], Awaitable[httpx.Response]],
    read: Callable[[httpx.Response], T],
) -> T:
    """``read(await send(reask))`` in at most ``cfg.retries + 1`` attempts, the one retry loop of
    every request. A timeout, a connection error or a retryable status is tried again after an
    exponential backoff; a reply ``read`` rejects with :class:`_NoVerdict` is asked again at once
    (``reask`` True). After the last attempt: the last rejected reply's verdict if there was one, else
    :class:`JudgeError`. ``read`` raises JudgeError for a refusal (:func:`_refused`)."""
    last, rejected, failures = "", None, 0
    for _ in range(cfg.retries + 1):
        if failures:
            await asyncio.sleep(min(_BACKOFF_S * 2 ** (failures - 1), _BACKOFF_CAP_S))
        try:
            response = await send(rejected is not None)
        except httpx.TimeoutException:
            last, failures = f"no reply within timeout_s={cfg.timeout_s}", failures + 1
            continue
        except httpx.TransportError as exc:
            last, failures = f"{type(exc).__name__}: {exc}", failures + 1
            continue
        if response.status_code in _RETRY_STATUS:
            last, failures = f"HTTP {response.status_code}: {response.text[:200]}", failures + 1
            continue
        try:
            return read(response)
        except _NoVerdict as again:
            rejected, failures = again.verdict, 0
    if rejected is not None:
        return rejected  # type: ignore[return-value]
    raise JudgeError(
        f"judge {url} (model {cfg.model!r}) failed after {cfg.retries + 1} attempts: {last} "
        "(is the judge served?)"
    )


def _blocking(run: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``run()`` awaited from synchronous code (in a thread of its own when an event loop runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(run()))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="judge")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def check_model(cfg: JudgeConfig) -> None:
    """Fail early unless the endpoint answers ``GET .../models`` (retried like a call) and, when it
    lists its models, serves ``cfg.model``. An endpoint that answers that route with no model list
    (e.g. 404) is not checked."""
    url = cfg.endpoint.removesuffix("/chat/completions") + "/models"

    def read(response: httpx.Response) -> None:
        try:
            served = [m["id"] for m in response.json()["data"]] if response.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            served = None
        if served is not None and cfg.model not in served:
            raise JudgeError(
                f"judge {url} serves {served}, not {cfg.model!r}: fix --judge-model / JUDGE_MODEL"
            )

    async def run() -> None:
        async with httpx.AsyncClient(headers=_headers()) as client:
            await _attempts(cfg, url, lambda _: client.get(url, timeout=cfg.timeout_s), read)

    _blocking(run)


def _read_reply(cfg: JudgeConfig, response: httpx.Response) -> Verdict:
    """The verdict of one reply; :class:`_NoVerdict` when it holds none, JudgeError for a refusal."""
    if response.status_code != 200:
        raise _refused(cfg, cfg.endpoint, response)
    try:
        choice = response.json()["choices"][0]
        content = choice["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        raise _NoVerdict(Verdict("unparsed", f"not a chat completion: {response.text[:200]}")) from None
    verdict = parse_verdict(content)
    if verdict.judgement != "unparsed":
        return verdict
    if choice.get("finish_reason") == "length":
        verdict = Verdict(
            "unparsed", f"cut at max_tokens={cfg.max_tokens}: {verdict.rationale}"[:RATIONALE_CHARS]
        )
    raise _NoVerdict(verdict)


async def _ask(client: httpx.AsyncClient, cfg: JudgeConfig, item: tuple[str, Sequence[str], str]) -> Verdict:
    """One question's verdict (:func:`_attempts`): a fresh fence per request, T = 0 unless asked again."""

    def send(reask: bool) -> Awaitable[httpx.Response]:
        body = {
            "model": cfg.model,
            "messages": [{"role": "user", "content": render_prompt(*item)}],
            "temperature": REASK_TEMPERATURE if reask else 0,
            "max_tokens": cfg.max_tokens,
        }
        return client.post(cfg.endpoint, json=body, timeout=cfg.timeout_s)

    return await _attempts(cfg, cfg.endpoint, send, lambda response: _read_reply(cfg, response))


async def ajudge_many(
    cfg: JudgeConfig, items: Sequence[Item], cache: VerdictCache | None = None
) -> tuple[list[Verdict], int]:
    """Verdicts for ``items`` (question, golds, prediction), in order, and the number of questions
    sent (one per distinct uncached item; retries and re-asks not counted).

    A missing or empty prediction, or one over ``cfg.max_answer_chars``, is ``incorrect`` without a
    call. Items with the same key are asked once; keys with a final cached verdict are not asked.
    New verdicts are written to ``cache`` when the calls are done, also when some failed (then
    :class:`JudgeError` is raised after writing the others).
    """
    verdicts: list[Verdict | None] = [None] * len(items)
    todo: dict[str, tuple[tuple[str, Sequence[str], str], list[int]]] = {}
    for i, (question, golds, prediction) in enumerate(items):
        text = (prediction or "").strip()
        if not text:
            verdicts[i] = Verdict("incorrect", NO_ANSWER)
            continue
        if cfg.max_answer_chars is not None and len(text) > cfg.max_answer_chars:
            verdicts[i] = Verdict("incorrect", TOO_LONG.format(cfg.max_answer_chars))
            continue
        shown = cut(text, cfg.answer_chars)
        key = verdict_key(cfg.model, PROMPT_VERSION, cfg.max_tokens, question, golds, shown)
        cached = cache.get(key) if cache is not None else None
        if cached is not None:
            verdicts[i] = cached
        elif key in todo:
            todo[key][1].append(i)
        else:
            todo[key] = ((question, golds, shown), [i])
    if todo:
        limit = asyncio.Semaphore(cfg.max_concurrency)
        limits = httpx.Limits(
            max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency
        )

        async def one(client: httpx.AsyncClient, item: tuple[str, Sequence[str], str]) -> Verdict:
            async with limit:
                return await _ask(client, cfg, item)

        async with httpx.AsyncClient(limits=limits, headers=_headers()) as client:
            answers = await asyncio.gather(
                *(one(client, item) for item, _ in todo.values()), return_exceptions=True
            )
        fresh = {}
        for (key, (_, indices)), verdict in zip(todo.items(), answers, strict=True):
            if isinstance(verdict, Verdict):
                fresh[key] = verdict
                for i in indices:
                    verdicts[i] = verdict
        if cache is not None:
            cache.put_many(fresh)  # also when some call failed: a rerun asks only the rest
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            raise failed[0]
    return [v for v in verdicts if v is not None], len(todo)


def judge_many(
    cfg: JudgeConfig, items: Sequence[Item], cache: VerdictCache | None = None
) -> tuple[list[Verdict], int]:
    """:func:`ajudge_many` from synchronous code (in a thread of its own when an event loop runs here)."""
    return _blocking(lambda: ajudge_many(cfg, items, cache))
