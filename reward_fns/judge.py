"""An LLM judge over any OpenAI-compatible chat-completions endpoint (docs/evaluation.md, "The judge").

The judge reads a question, its gold answers and a prediction (cut to ``answer_chars`` characters) and
answers the field's JSON verdict ``{"rationale": ..., "judgement": "correct" | "incorrect"}`` at
temperature 0. A reply that does not parse is ``"unparsed"``, never correct. Calls run concurrently
(at most ``max_concurrency`` in flight; the server batches them), each with a timeout and retries with
exponential backoff; an endpoint that still fails raises :class:`JudgeError`, never a silent 0.
Verdicts are cached in an append-only JSONL file keyed by :func:`verdict_key`, so a rerun calls nothing.

The prompt text lives here only; :data:`PROMPT_VERSION` names it and changes whenever it changes.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPT_VERSION = "judge-v1"
"""Names the prompt below; part of every verdict's cache key and of an evaluation's settings."""

PROMPT = """You grade answers to questions. Decide whether the predicted answer means the same as at \
least one of the gold answers. It need not match word for word: a different spelling, an alias, a \
fuller or shorter name of the same entity, or the same number or date written another way is correct. \
An answer that names a different entity, is more vague than the gold answer, hedges between several \
candidates, or does not answer the question is incorrect.

Question: {question}
Gold answers: {golds}
Predicted answer: {prediction}

Reply with one JSON object and nothing else, giving your reason first:
{{"rationale": "<one or two sentences>", "judgement": "correct" or "incorrect"}}"""
"""The judge's prompt (version :data:`PROMPT_VERSION`); ``{golds}`` is a JSON list."""

JUDGEMENTS = ("correct", "incorrect", "unparsed")
"""A verdict's possible judgements; ``unparsed``: the judge's reply held no valid verdict."""

NO_ANSWER = "no answer to judge"
"""The rationale of the ``incorrect`` verdict given, without a call, to a missing or empty prediction."""

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
"""HTTP statuses retried with backoff; any other error status fails at once (a wrong model or URL)."""

_BACKOFF_S = 0.5
_BACKOFF_CAP_S = 8.0


@dataclass(frozen=True)
class JudgeConfig:
    """Where and how to ask the judge.

    ``url``: the endpoint's base (``http://127.0.0.1:8000`` or ``.../v1``) or the full
    ``.../v1/chat/completions``. ``model``: the served model name. ``timeout_s``: per request, seconds.
    ``retries``: extra attempts after the first on a timeout, connection error or retryable status.
    ``answer_chars``: the prediction is cut to this many characters. ``max_tokens``: of the reply.
    An API key, when the endpoint needs one, is read from the ``JUDGE_API_KEY`` environment variable.
    """

    url: str
    model: str
    max_concurrency: int = 16
    timeout_s: float = 60.0
    retries: int = 4
    answer_chars: int = 500
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"judge url {self.url!r}: give an http(s) URL, e.g. http://127.0.0.1:8000/v1")
        if not self.model:
            raise ValueError("judge model: give the served model's name (--judge-model / JUDGE_MODEL)")
        for name in ("max_concurrency", "answer_chars", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"judge {name}={getattr(self, name)}: must be >= 1")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError(f"judge retries={self.retries}, timeout_s={self.timeout_s}: need >= 0 and > 0")

    @property
    def endpoint(self) -> str:
        """The chat-completions URL the requests go to."""
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


@dataclass(frozen=True)
class Verdict:
    """One judgement (one of :data:`JUDGEMENTS`) and the judge's rationale."""

    judgement: str
    rationale: str

    @property
    def correct(self) -> float:
        """1.0 only for ``correct``; ``incorrect`` and ``unparsed`` are 0.0."""
        return 1.0 if self.judgement == "correct" else 0.0


class JudgeError(RuntimeError):
    """The judge endpoint failed after its retries (or refused the request); nothing was scored."""


Item = tuple[str, Sequence[str], "str | None"]
"""(question, gold answers, prediction or None)."""


def cut(prediction: str, answer_chars: int) -> str:
    """The prediction the judge sees: its first ``answer_chars`` characters, whitespace stripped."""
    return prediction.strip()[:answer_chars].strip()


def verdict_key(model: str, prompt_version: str, question: str, golds: Sequence[str], prediction: str) -> str:
    """sha256 hex of the canonical JSON of (judge model, prompt version, question, golds, prediction).

    Golds keep their order (the prompt lists them in it). :func:`ajudge_many` keys the prediction as
    the judge sees it (:func:`cut`), so ``answer_chars`` is part of the key too.
    """
    canonical = json.dumps(
        [model, prompt_version, question, list(golds), prediction],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def render_prompt(question: str, golds: Sequence[str], prediction: str) -> str:
    """The prompt for one item (the prediction already cut)."""
    return PROMPT.format(
        question=question.strip(), golds=json.dumps(list(golds), ensure_ascii=False), prediction=prediction
    )


_OBJECT = re.compile(r"\{[^{}]*\}", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_verdict(text: str) -> Verdict:
    """The verdict in a judge's reply: the last JSON object with a ``judgement`` of ``correct`` or
    ``incorrect`` (any case, surrounding whitespace ignored), after removing ``<think>`` blocks.
    Anything else (no object, invalid JSON, another judgement) is ``unparsed`` with the reply cut to
    200 characters as rationale."""
    body = _THINK.sub("", text)
    for match in reversed(_OBJECT.findall(body)):
        try:
            obj = json.loads(match)
        except json.JSONDecodeError:
            continue
        judgement = obj.get("judgement") if isinstance(obj, dict) else None
        if isinstance(judgement, str) and judgement.strip().lower() in ("correct", "incorrect"):
            rationale = obj.get("rationale", "")
            return Verdict(
                judgement.strip().lower(), rationale if isinstance(rationale, str) else str(rationale)
            )
    return Verdict("unparsed", text.strip()[:200])


class VerdictCache:
    """Verdicts by :func:`verdict_key` in an append-only JSONL file, one
    ``{"key", "judgement", "rationale"}`` per line.

    Appends hold an exclusive ``flock`` and are fsynced, so several processes may share one file; a
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
                self._verdicts[row["key"]] = Verdict(row["judgement"], row.get("rationale", ""))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        self._offset += end

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, key: str) -> Verdict | None:
        """The cached verdict for ``key``, or None."""
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
            self._verdicts.update(verdicts)


def _headers() -> dict[str, str]:
    key = os.environ.get("JUDGE_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def check_model(cfg: JudgeConfig) -> None:
    """Fail early unless the endpoint answers ``GET .../models`` (retried like a call) and, when it
    lists its models, serves ``cfg.model``. An endpoint without that route (404) is not checked."""
    url = cfg.endpoint.removesuffix("/chat/completions") + "/models"
    last = ""
    for attempt in range(cfg.retries + 1):
        if attempt:
            time.sleep(min(_BACKOFF_S * 2 ** (attempt - 1), _BACKOFF_CAP_S))
        try:
            response = httpx.get(url, headers=_headers(), timeout=cfg.timeout_s)
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code in _RETRY_STATUS:
            last = f"HTTP {response.status_code}"
            continue
        if response.status_code == 404:
            return
        try:
            served = [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return
        if cfg.model not in served:
            raise JudgeError(
                f"judge {url} serves {served}, not {cfg.model!r}: fix --judge-model / JUDGE_MODEL"
            )
        return
    raise JudgeError(
        f"judge {url} did not answer after {cfg.retries + 1} attempts: {last} (is the judge served?)"
    )


async def _ask(client: httpx.AsyncClient, cfg: JudgeConfig, prompt: str) -> Verdict:
    """One chat completion at T = 0, retried with backoff; its parsed verdict."""
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": cfg.max_tokens,
    }
    last = ""
    for attempt in range(cfg.retries + 1):
        if attempt:
            await asyncio.sleep(min(_BACKOFF_S * 2 ** (attempt - 1), _BACKOFF_CAP_S))
        try:
            response = await client.post(cfg.endpoint, json=body, timeout=cfg.timeout_s)
        except httpx.TimeoutException:
            last = f"no reply within timeout_s={cfg.timeout_s}"
            continue
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code in _RETRY_STATUS:
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            continue
        if response.status_code != 200:
            raise JudgeError(
                f"judge {cfg.endpoint} refused model {cfg.model!r}: HTTP {response.status_code}: "
                f"{response.text[:300]} (check --judge-url / --judge-model)"
            )
        try:
            content = response.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            return Verdict("unparsed", f"not a chat completion: {response.text[:200]}")
        return parse_verdict(content)
    raise JudgeError(
        f"judge {cfg.endpoint} (model {cfg.model!r}) failed after {cfg.retries + 1} attempts: {last}"
    )


async def ajudge_many(
    cfg: JudgeConfig, items: Sequence[Item], cache: VerdictCache | None = None
) -> tuple[list[Verdict], int]:
    """Verdicts for ``items`` (question, golds, prediction), in order, and the number of endpoint calls
    made (one per distinct uncached item; retries not counted).

    A missing or empty prediction is ``incorrect`` without a call. Items with the same key are asked
    once; cached keys are not asked. New verdicts are written to ``cache`` when the calls are done,
    also when some failed (then :class:`JudgeError` is raised after writing the others).
    """
    verdicts: list[Verdict | None] = [None] * len(items)
    todo: dict[str, tuple[str, list[int]]] = {}
    for i, (question, golds, prediction) in enumerate(items):
        shown = cut(prediction or "", cfg.answer_chars)
        if not shown:
            verdicts[i] = Verdict("incorrect", NO_ANSWER)
            continue
        key = verdict_key(cfg.model, PROMPT_VERSION, question, golds, shown)
        cached = cache.get(key) if cache is not None else None
        if cached is not None:
            verdicts[i] = cached
        elif key in todo:
            todo[key][1].append(i)
        else:
            todo[key] = (render_prompt(question, golds, shown), [i])
    if todo:
        limit = asyncio.Semaphore(cfg.max_concurrency)
        limits = httpx.Limits(
            max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency
        )

        async def one(client: httpx.AsyncClient, prompt: str) -> Verdict:
            async with limit:
                return await _ask(client, cfg, prompt)

        async with httpx.AsyncClient(limits=limits, headers=_headers()) as client:
            answers = await asyncio.gather(
                *(one(client, prompt) for prompt, _ in todo.values()), return_exceptions=True
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
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(ajudge_many(cfg, items, cache))
    result: list[tuple[list[Verdict], int]] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(ajudge_many(cfg, items, cache)))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="judge_many")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
