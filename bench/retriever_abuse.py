"""Retriever abuse benchmark: good clients' latency with and without an abusive client beside them,
side by side in one run, on the dense backend.

Server: `python -m search_env.retrieval serve --backend dense` on 127.0.0.1 (a child process stopped by PID)
over the bundled 1,000-passage wiki-18 sample, with a locally built random-weight BERT encoder
(`--dim`-d, 2 layers) and a real faiss IVF16,SQ8 index, `--threads 1`, every other setting its
default (extra ones: `--serve-arg`).

Good clients: `--clients` clients, each sending one distinct question per /retrieve request at
topk 5, in OPEN LOOP: on a fixed schedule of `--good-rate` requests/s each, whether or not the
earlier ones were answered (a keep-alive connection per request in flight), latency counted from the
scheduled send time (so queueing delay counts: no coordinated omission). Real good clients are a
training node's rollout workers searching between generations, not a loop that keeps the server
busy by itself; closed-loop clients that saturate the server measure how throughput is shared, not
how they are protected. The default rate is `--good-load` (1/3) of the capacity measured in a
closed-loop calibration phase (`--calibrate-seconds`; printed); `--good-rate 0` = closed loop.
A good request fails (`good_errors`) when it gets an answer other than
200 with one result or 429, or none within `--good-timeout-s`; a 429 is retried after its
Retry-After, as the project's client does, and its wait counts in the latency.

Abuse, from one client in its own process (so its work never stalls the good clients' event loop),
each type's sockets bound to its own address 127.0.0.2, .3, ... (`ADDRESSES`: other machines to the
server, which limits connections and shares its batches out per client address; the good clients
connect from 127.0.0.1; N = requests or connections, K = those answered 4xx):
  huge    one ~7.9 MB query per request, one request at a time
  amplify 1,024 copies of one query at topk 100 (a 30 kB body), one at a time
  slow    `--slow-connections` connections that send Content-Length 100, 10 bytes, then nothing
          (raw sockets; one reopened as soon as the server answers or closes it)
  badtext a query holding a lone surrogate (JSON "\\ud800 x"), one at a time
  flood   `--flood-connections` connections, each sending `--flood-queries` distinct questions per
          request in a closed loop, ignoring Retry-After
  idle    `--idle-connections` (1,024) sockets that send nothing
  headers `--headers-connections` sockets that send a request line, then a header line a second
  bighead `--bighead-connections` sockets that send one header line without end, 64 KiB a write
  cached  `--cached-connections` connections in a closed loop, each request the same 81 questions x
          topk 100 (answered from the cache after the first: ~5.5 MB answers)
  noread  `--noread-connections` sockets that send that request 4 times pipelined and never read
The held sockets (idle, headers, bighead, noread) are reopened 0.5 s after the server ends them.

Phases: closed-loop warm-up and calibration, good clients alone (`--seconds`), with all abuse types
at once (`--abuse-seconds`), alone again (`--seconds`), then (unless `--no-per-type`) with each type
alone (`--type-seconds`), so the type that hurts can be read off (with each phase's slowest good
requests and when they were sent). After each abusive phase the server is given time to settle (a
probe answered in a few baseline p50s). good_p99_ratio = good p99 with all abuse / good p99 of the
two good-only phases together; all clients share the machine with the server, so run it on an
otherwise idle one (the load average is printed) and compare ratios within a run. Last, the idle
check: `--idle-check` (1,100) idle sockets from one address, then one good request from 127.0.0.1
(its status and latency).

    .venv/bin/python bench/retriever_abuse.py [--clients 8] [--seconds 15] [--abuse-seconds 30]
                                        # ~5 min on 2 shared cores (~2 min with --no-per-type)
Last line: `retriever_abuse: good_p99_ratio=R good_errors=E refused=K/N` (the all-abuse phase).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.heap import freeze_heap
from search_env.retrieval.process import ServerProcess, spawn_server

QUESTIONS = REPO_ROOT / "assets" / "eval_samples" / "r1-searcher-evalset" / "hotpotqa_500.jsonl"
TYPES = ("huge", "amplify", "slow", "badtext", "flood", "idle", "headers", "bighead", "cached", "noread")
HUGE_CHARS = 7_900_000
TOPK = 5
IDLE_CLOSE_S = 2.0
"""a good client closes a keep-alive connection idle this long (uvicorn closes them after 5 s)."""
ADDRESSES = {kind: f"127.0.0.{i + 2}" for i, kind in enumerate(TYPES)}
"""each abuse type's own source address (Linux routes all of 127.0.0.0/8 to the loopback device), so
the server's per-address limits meet several abusers; the good clients connect from 127.0.0.1."""
IDLE_ADDRESS = "127.0.0.100"
"""the source of the idle-socket check's sockets."""
CACHED_QUERIES = 81
"""queries per `cached` / `noread` request, at topk 100: 8,100 passages (--max-hits 8,192), ~5.5 MB."""
CONNECTIONS = {
    "slow": (32, "slow-body connections held"),
    "flood": (64, "concurrent connections"),
    "cached": (8, "concurrent connections"),
    "idle": (1024, "sockets held open"),
    "headers": (32, "trickling sockets"),
    "bighead": (2, "endless-header sockets"),
    "noread": (64, "never-reading sockets"),
}
"""Per abuse type with several connections: the default count (`--<type>-connections`) and what they are."""
REOPEN_S = 0.5
"""a held-socket abuser reopens a connection this long after the server closed or refused it."""
START_S = 1.0
"""the all-abuse phase's start, when the abusers open their connections together: also reported left
out, beside the whole phase's p99 (R; docs/benchmarks.md "the start transient")."""


def load_questions() -> list[str]:
    with open(QUESTIONS, encoding="utf-8") as handle:
        return [json.loads(line)["question"] for line in handle if line.strip()]


def build_assets(work: Path, dim: int) -> dict[str, Path]:
    """Tiny BERT (`dim`-d) and an IVF16,SQ8 index over the bundled sample, under `work` (reused)."""
    from search_env.retrieval.corpus import Corpus  # torch/faiss: not in the abusive child process
    from search_env.retrieval.encoder import Encoder, build_tiny_encoder  # (same)
    from search_env.retrieval.index_build import build_index  # (same)

    encoder, index = work / f"bert-{dim}", work / f"sample-{dim}.IVF16_SQ8.index"
    if not (encoder / "config.json").is_file():
        build_tiny_encoder(encoder, hidden_size=dim, num_layers=2, num_heads=4, seed=0)
    if not index.is_file():
        build_index(Corpus(SAMPLE_CORPUS), Encoder(encoder, use_gpu=False), index, "IVF16,SQ8", use_gpu=False)
    return {"encoder": encoder, "index": index}


# ---------------------------------------------------------------- HTTP/1.1 over raw asyncio streams


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Connection:
    """One keep-alive HTTP/1.1 connection; reopened after any failure or `Connection: close`."""

    def __init__(self, host: str, port: int, local: str | None = None) -> None:
        self.host, self.port, self.local = host, port, local
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def head(self, length: int, path: str = "/retrieve") -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()

    async def post(self, body: bytes, timeout_s: float) -> Answer:
        """POST /retrieve; TimeoutError / OSError / IncompleteReadError on no full answer in time."""
        try:
            return await asyncio.wait_for(self._post(body), timeout_s)
        except BaseException:
            self.close()
            raise

    async def _post(self, body: bytes) -> Answer:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20, local_addr=(self.local, 0) if self.local else None
            )
        assert self.reader is not None
        self.writer.write(self.head(len(body)) + body)
        await self.writer.drain()
        answer = await read_answer(self.reader)
        if answer.headers.get("connection", "").lower() == "close":
            self.close()
        return answer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """Status line, headers and a Content-Length body (or the rest of the stream without one)."""
    header = await reader.readuntil(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return Answer(int(lines[0].split()[1]), headers, body)


# ---------------------------------------------------------------- tallies


@dataclass
class Good:
    """The good clients of one phase."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    retried_429: int = 0
    sent_at: list[float] = field(default_factory=list)
    """Per request, seconds from the phase's start to its send (the slowest are printed)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """Per process (server, abuser, good clients), CPU seconds per second of the phase."""

    def slowest(self, n: int = 3) -> str:
        worst = sorted(zip(self.latencies, self.sent_at, strict=True), reverse=True)[:n]
        return ", ".join(f"{1000 * lat:.0f} ms sent at +{at:.1f} s" for lat, at in worst)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def sent_from(self, start_s: float) -> Good:
        """The requests sent `start_s` or more after the phase's start."""
        kept = [(lat, at) for lat, at in zip(self.latencies, self.sent_at, strict=True) if at >= start_s]
        return Good([lat for lat, _ in kept], sent_at=[at for _, at in kept])


@dataclass
class Abuse:
    """The abusive requests of one phase, per type: outcomes ('200', '422', 'timeout', ...)."""

    outcomes: dict[str, Counter] = field(default_factory=lambda: {t: Counter() for t in TYPES})

    def sent(self, kind: str | None = None) -> int:
        return sum(sum(c.values()) for t, c in self.outcomes.items() if kind in (None, t))

    def refused(self, kind: str | None = None) -> int:
        return sum(
            n
            for t, c in self.outcomes.items()
            if kind in (None, t)
            for o, n in c.items()
            if o.startswith("4")
        )


# ---------------------------------------------------------------- clients


async def good_request(connection: Connection, body: bytes, started: float, timeout_s: float, out: Good,
                       origin: float) -> None:  # fmt: skip
    """POST one good request on `connection`, retrying a 429 after its Retry-After; its latency is
    counted from `started` (its scheduled send time in open loop, so time spent waiting counts)."""
    deadline = started + timeout_s
    error = None
    while True:
        try:
            answer = await connection.post(body, max(0.001, deadline - time.perf_counter()))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as err:
            error = type(err).__name__
            break
        if answer.status == 429 and time.perf_counter() < deadline:
            out.retried_429 += 1
            wait = float(answer.headers.get("retry-after", "1"))
            await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))
            continue
        if answer.status != 200:
            error = f"HTTP {answer.status}"
        elif len(json.loads(answer.body)["result"]) != 1:
            error = "wrong result count"
        break
    out.latencies.append(time.perf_counter() - started)
    out.sent_at.append(started - origin)
    if error:
        out.errors[error] += 1


def good_body(questions: list[str], k: int, i: int, tag: str) -> bytes:
    query = f"{questions[(k * 7919 + i) % len(questions)]} [{tag} {k}.{i}]"
    return json.dumps({"queries": [query], "topk": TOPK, "return_scores": True}).encode()


async def good_client(k: int, host: str, port: int, stop_at: float, questions: list[str], tag: str, out: Good,
                      timeout_s: float, origin: float, rate: float | None, clients: int) -> None:  # fmt: skip
    """Good client `k` until `stop_at`. Closed loop (`rate` None: the next request as soon as the last
    is answered, on one connection) or open loop: requests scheduled every 1/`rate` s (client k offset
    by k/(clients x rate)), each sent at its time whether or not earlier ones were answered (an idle
    keep-alive connection of the client, else a new one), latency from the scheduled time."""
    if rate is None:
        connection, i = Connection(host, port), 0
        try:
            while time.perf_counter() < stop_at:
                await good_request(connection, good_body(questions, k, i, tag), time.perf_counter(), timeout_s,
                                   out, origin)  # fmt: skip
                i += 1
        finally:
            connection.close()
        return
    idle: list[tuple[Connection, float]] = []  # (keep-alive connection, idle since), newest last
    pending: set[asyncio.Task] = set()

    async def send(i: int, scheduled: float) -> None:
        while idle and time.perf_counter() - idle[0][1] > IDLE_CLOSE_S:  # before the server's keep-alive
            idle.pop(0)[0].close()  # timeout closes it under a request (a race, not the server's fault)
        connection = idle.pop()[0] if idle else Connection(host, port)
        try:
            await good_request(connection, good_body(questions, k, i, tag), scheduled, timeout_s, out, origin)
        finally:
            idle.append((connection, time.perf_counter()))

    first, i = origin + k / (clients * rate), 0
    try:
        while (scheduled := first + i / rate) < stop_at:
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            task = asyncio.ensure_future(send(i, scheduled))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
        await asyncio.gather(*pending)
    finally:
        for connection, _ in idle:
            connection.close()


async def abusive_requests(
    host: str,
    port: int,
    stop_at: float,
    make_body: Callable[[int], bytes],
    outcomes: Counter,
    timeout_s: float,
    local: str,
) -> None:
    """One abusive request at a time from `local` until `stop_at`; each outcome counted (a request cut
    by the end of the phase counts as 'cut')."""
    connection, n = Connection(host, port, local), 0
    try:
        while time.perf_counter() < stop_at:
            body = make_body(n)
            n += 1
            try:
                left = max(0.001, min(timeout_s, stop_at - time.perf_counter() + 0.5))
                outcomes[str((await connection.post(body, left)).status)] += 1
            except TimeoutError:
                outcomes["cut" if time.perf_counter() >= stop_at else "timeout"] += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                outcomes["closed"] += 1
                await asyncio.sleep(0.01)
    finally:
        connection.close()


async def slow_body(host: str, port: int, stop_at: float, outcomes: Counter) -> None:
    """Connections that announce 100 body bytes, send 10 and fall silent; reopened when answered."""
    while time.perf_counter() < stop_at:
        writer = None
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(ADDRESSES["slow"], 0))
            head = Connection(host, port).head(100)
            writer.write(head + b'{"queries"')
            await writer.drain()
            answer = await asyncio.wait_for(read_answer(reader), max(0.001, stop_at - time.perf_counter()))
            outcomes[str(answer.status)] += 1
        except TimeoutError:
            outcomes["cut"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            outcomes["closed"] += 1
            await asyncio.sleep(0.01)
        finally:
            if writer is not None:
                writer.close()


def status_of(data: bytes) -> str:
    """The outcome of a held socket from what the server sent before closing it."""
    parts = data.split(b" ", 2)
    return parts[1].decode("latin-1") if data.startswith(b"HTTP/") and len(parts) > 1 else "closed"


async def held_socket(
    host: str, port: int, stop_at: float, kind: str, outcomes: Counter, body: bytes
) -> None:
    """One connection from `kind`'s address, reopened `REOPEN_S` after the server ends it, until
    `stop_at`: idle (sends nothing), headers (a header line a second, never the blank line), bighead
    (one header line, 64 KiB a write, never ending) or noread (the request `body` 4 times pipelined,
    never read: a 1 KiB stream limit stops reading within 2 KiB). Outcome: the status the server
    sent ('503' past the per-address cap, '400' for a head too large), 'closed' (without an answer:
    a deadline), 'reset' (noread: aborted at the write deadline) or 'held' (still open at the end)."""
    while time.perf_counter() < stop_at:
        writer = None
        try:
            reader, writer = await asyncio.open_connection(
                host, port, local_addr=(ADDRESSES[kind], 0), limit=1024 if kind == "noread" else 1 << 16
            )
            outcomes[
                await asyncio.wait_for(hold(reader, writer, kind, body), stop_at - time.perf_counter())
            ] += 1
        except TimeoutError:
            outcomes["held"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            outcomes["closed"] += 1
        finally:
            if writer is not None:
                writer.close()
        await asyncio.sleep(REOPEN_S)


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str, body: bytes) -> str:
    """`held_socket`'s behaviour on one connection until the server ends it; the outcome."""
    if kind == "noread":
        writer.write(body * 4)
        await writer.drain()
        sock = writer.get_extra_info("socket")  # reading is paused: a reset shows only as the error
        while not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            await asyncio.sleep(0.5)
        return "reset"
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if kind == "bighead":
        writer.write(head + b"X-Big: ")
        chunk, data = b"a" * 65536, b""
        while not reader.at_eof():
            writer.write(chunk)
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                data += await asyncio.wait_for(reader.read(65536), 0.001)
            if data:
                break
        return status_of(data + await reader.read())
    if kind == "headers":
        writer.write(head)
    line = 0
    while True:
        try:
            data = await asyncio.wait_for(reader.read(65536), 1.0)
        except TimeoutError:
            if kind == "headers":
                writer.write(f"X-Trickle-{line}: {line}\r\n".encode())
                line += 1
            continue
        return status_of(data)


def abuse_tasks(kinds: list[str], host: str, port: int, stop_at: float, opts: dict, questions: list[str],
                out: Abuse) -> list[Awaitable[None]]:  # fmt: skip
    """The coroutines of the abusive client for `kinds` (bodies encoded once where they can be)."""
    n_q, per_flood = len(questions), int(opts["flood_queries"])
    text = " ".join(questions) + " "
    whole = json.dumps({"queries": [(text * (HUGE_CHARS // len(text) + 1))[:HUGE_CHARS]], "topk": TOPK})
    huge = (whole[:14].encode(), whole[14:].encode())  # '{"queries": ["', the rest: each gets its number
    badtext = json.dumps({"queries": ["\ud800 x"], "topk": TOPK}).encode()  # ensure_ascii: "\ud800"

    def amplify_body(n: int) -> bytes:
        return json.dumps({"queries": [f"{questions[n % n_q]} amp{n}"] * 1024, "topk": 100}).encode()

    def flood_body(c: int) -> Callable[[int], bytes]:
        def body(n: int) -> bytes:
            start = (c * 1009 + n * per_flood) % n_q
            qs = [f"{questions[(start + j) % n_q]} flood{c}.{n}.{j}" for j in range(per_flood)]
            return json.dumps({"queries": qs, "topk": TOPK}).encode()

        return body

    cached = json.dumps({"queries": questions[:CACHED_QUERIES], "topk": 100}).encode()  # one body: warm
    tasks: list[Awaitable[None]] = []
    o, a = out.outcomes, ADDRESSES
    for kind in kinds:
        if kind == "huge":
            tasks.append(
                abusive_requests(
                    host,
                    port,
                    stop_at,
                    lambda n: b"%s%d %s" % (huge[0], n, huge[1]),
                    o["huge"],
                    120.0,
                    a[kind],
                )
            )  # each body distinct: no cache hit
        elif kind == "amplify":
            tasks.append(abusive_requests(host, port, stop_at, amplify_body, o[kind], 120.0, a[kind]))
        elif kind == "badtext":
            tasks.append(abusive_requests(host, port, stop_at, lambda n: badtext, o[kind], 60.0, a[kind]))
        elif kind == "slow":
            tasks += [slow_body(host, port, stop_at, o["slow"]) for _ in range(int(opts["slow_connections"]))]
        elif kind == "flood":
            tasks += [
                abusive_requests(host, port, stop_at, flood_body(c), o[kind], 60.0, a[kind])
                for c in range(int(opts["flood_connections"]))
            ]
        elif kind == "cached":
            tasks += [
                abusive_requests(host, port, stop_at, lambda n: cached, o[kind], 60.0, a[kind])
                for _ in range(int(opts["cached_connections"]))
            ]
        else:  # idle, headers, bighead, noread: held sockets
            request = Connection(host, port).head(len(cached)) + cached
            tasks += [
                held_socket(host, port, stop_at, kind, o[kind], request)
                for _ in range(int(opts[f"{kind}_connections"]))
            ]
    return tasks


async def abuse_for(url: str, kinds: list[str], seconds: float, opts: dict, questions: list[str]) -> Abuse:
    """Run the abusive client's `kinds` for `seconds`; what is still in flight 1 s later is cut (tasks
    cancelled, sockets closed)."""
    host, port = url.removeprefix("http://").split(":")
    abuse = Abuse()
    stop_at = time.perf_counter() + seconds
    tasks = [
        asyncio.ensure_future(t) for t in abuse_tasks(kinds, host, int(port), stop_at, opts, questions, abuse)
    ]
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()) + 1.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return abuse


def abuser_main(url: str, opts: dict) -> None:
    """The abusive client's own process (its work never delays the good clients' event loop): per stdin
    line `{"kinds", "seconds"}`, abuse for that long, then print the outcomes as one JSON line. At the
    lowest CPU priority when `opts["nice"]`: a remote abuser's own work does not take the good
    clients' CPU."""
    if opts.get("nice"):
        os.nice(19)
    questions = load_questions()
    for line in sys.stdin:
        spec = json.loads(line)
        abuse = asyncio.run(abuse_for(url, spec["kinds"], spec["seconds"], opts, questions))
        print(json.dumps({k: dict(v) for k, v in abuse.outcomes.items()}), flush=True)


class Abuser:
    """The long-lived abusive child process (`--abuser URL`)."""

    def __init__(self, url: str, opts) -> None:
        knobs = {k: v for k, v in vars(opts).items() if k == "flood_queries" or k.endswith("_connections")}
        knobs["nice"] = not opts.no_nice
        command = [sys.executable, __file__, "--abuser", url, "--abuser-opts", json.dumps(knobs)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def run(self, kinds: tuple[str, ...], seconds: float) -> Abuse:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"kinds": list(kinds), "seconds": seconds}) + "\n")
        self.process.stdin.flush()
        line = await asyncio.get_running_loop().run_in_executor(None, self.process.stdout.readline)
        if not line:
            raise RuntimeError(f"the abusive client exited with code {self.process.wait()}")
        abuse = Abuse()
        for kind, counts in json.loads(line).items():
            abuse.outcomes[kind] = Counter(counts)
        return abuse

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # exited
        return []
    return [pid, *(p for child in children for p in process_tree(int(child)))]


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and its live descendants (the
    server's search process)."""
    total = 0.0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited
            continue
        total += sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


async def phase(server: ServerProcess, abuser: Abuser, seconds: float, kinds: tuple[str, ...], tag: str,
                opts, questions: list[str], rate: float | None) -> tuple[Good, Abuse]:  # fmt: skip
    """Good clients for `seconds` (open loop at `rate` requests/s each, closed loop when None), with the
    abusive client's `kinds` beside them (in its process)."""
    host, port = server.url.removeprefix("http://").split(":")
    good = Good()
    pids = {"server": server.process.pid, "abuser": abuser.process.pid}
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    cpu["good clients"] = time.process_time()
    stop_at = time.perf_counter() + seconds
    abused = asyncio.ensure_future(abuser.run(kinds, seconds)) if kinds else None
    await asyncio.gather(
        *(good_client(k, host, int(port), stop_at, questions, tag, good, opts.good_timeout_s, stop_at - seconds,
                      rate, opts.clients)
          for k in range(opts.clients))
    )  # fmt: skip
    good.cpu = {name: (cpu_seconds(pid) - cpu[name]) / seconds for name, pid in pids.items()}
    good.cpu["good clients"] = (time.process_time() - cpu["good clients"]) / seconds
    return good, (await abused if abused is not None else Abuse())


async def queued_queries(host: str, port: int) -> int:
    """`queued_queries` of GET /health (0 when the server does not report it)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        doc = json.loads((await asyncio.wait_for(read_answer(reader), 10.0)).body)
    finally:
        writer.close()
    return int(doc.get("queued_queries", 0))


async def settle(server: ServerProcess, typical_s: float, limit_s: float = 120.0) -> float:
    """Wait until the server reports no queued query (what an abusive phase queued is worked off)
    and three good queries in a row are each answered within max(0.1 s, 3 x `typical_s`); seconds
    waited."""
    host, port = server.url.removeprefix("http://").split(":")
    started, streak = time.perf_counter(), 0
    connection = Connection(host, int(port))
    try:
        while streak < 3 and time.perf_counter() - started < limit_s:
            body = json.dumps({"queries": [f"settle probe {time.time()}"], "topk": TOPK}).encode()
            sent = time.perf_counter()
            try:
                answer = await connection.post(body, 10.0)
                fast = answer.status == 200 and time.perf_counter() - sent <= max(0.1, 3 * typical_s)
                fast = fast and await queued_queries(host, int(port)) == 0
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                fast = False
            streak = streak + 1 if fast else 0
            await asyncio.sleep(0.2)
    finally:
        connection.close()
    return time.perf_counter() - started


async def idle_check(server: ServerProcess, sockets: int, questions: list[str]) -> str:
    """`sockets` idle connections from `IDLE_ADDRESS`, then one good /retrieve from 127.0.0.1 on a new
    connection: how many are still open and how many were answered 503 by then (a refused socket
    is held --refusal-hold-s first), and that request's status and latency."""
    host, port = server.url.removeprefix("http://").split(":")
    opened = [
        await asyncio.open_connection(host, int(port), local_addr=(IDLE_ADDRESS, 0)) for _ in range(sockets)
    ]
    try:
        await asyncio.sleep(0.5)
        refused = 0
        for reader, _ in opened:
            with contextlib.suppress(TimeoutError):
                refused += bool(await asyncio.wait_for(reader.read(1), 0.001))
        body = good_body(questions, 0, 0, "idle-check")
        connection, started = Connection(host, int(port)), time.perf_counter()
        try:
            answer = await connection.post(body, 10.0)
        finally:
            connection.close()
        took = time.perf_counter() - started
    finally:
        for _, writer in opened:
            writer.close()
    return (f"idle check: {sockets} idle sockets from {IDLE_ADDRESS} ({sockets - refused} open, {refused} "
            "answered 503 by then: past --max-connections-per-client, after --refusal-hold-s); a /retrieve "
            f"from 127.0.0.1 on a new connection: HTTP {answer.status} in {1000 * took:.0f} ms")  # fmt: skip


# ---------------------------------------------------------------- report


def outcome_text(counts: Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


async def run(server: ServerProcess, abuser: Abuser, opts, questions: list[str]) -> None:
    await phase(server, abuser, opts.warmup, (), "warm", opts, questions, None)
    calibration, _ = await phase(server, abuser, opts.calibrate_seconds, (), "cal", opts, questions, None)
    capacity = len(calibration.latencies) / opts.calibrate_seconds
    rate = opts.good_rate if opts.good_rate is not None else capacity * opts.good_load / opts.clients
    if opts.good_rate == 0:
        rate = None
    load = "closed loop" if rate is None else (
        f"open loop at {rate:.1f} requests/s per client = {opts.clients * rate:.0f}/s, "
        f"{100 * opts.clients * rate / capacity:.0f} % of that capacity")  # fmt: skip
    print(f"capacity (good clients alone, closed loop, {opts.calibrate_seconds:.0f} s): {capacity:.0f} "
          f"requests/s (p50 {1000 * calibration.p(0.5):.1f} ms); good load: {load}", flush=True)  # fmt: skip
    base_a, _ = await phase(server, abuser, opts.seconds, (), "base-a", opts, questions, rate)
    typical = base_a.p(0.5)
    mixed, abuse = await phase(server, abuser, opts.abuse_seconds, opts.types, "mixed", opts, questions, rate)
    settled = {"mixed": await settle(server, typical)}
    base_b, _ = await phase(server, abuser, opts.seconds, (), "base-b", opts, questions, rate)
    per_type = {}
    if not opts.no_per_type:
        for kind in TYPES:
            per_type[kind] = await phase(
                server, abuser, opts.type_seconds, (kind,), kind, opts, questions, rate
            )
            settled[kind] = await settle(server, typical)
    base = Good(base_a.latencies + base_b.latencies, base_a.errors + base_b.errors,
                base_a.retried_429 + base_b.retried_429, base_a.sent_at + base_b.sent_at)  # fmt: skip

    print(f"{'phase':28s} {'good req':>8s} {'p50 ms':>8s} {'p99 ms':>9s} {'p99/base':>8s} {'errors':>6s} "
          f"{'429 retried':>11s}  abusive: sent refused(4xx)  outcomes")  # fmt: skip

    def row(name: str, good: Good, abused: Abuse | None, kind: str | None = None) -> None:
        ratio = good.p(0.99) / base.p(0.99)
        line = (f"{name:28s} {len(good.latencies):8d} {1000 * good.p(0.5):8.1f} {1000 * good.p(0.99):9.1f} "
                f"{ratio:8.2f} {good.failed:6d} {good.retried_429:11d}")  # fmt: skip
        if abused is not None:
            counts = abused.outcomes[kind] if kind else sum(abused.outcomes.values(), Counter())
            line += f"  {abused.sent(kind):6d} {abused.refused(kind):6d}  {outcome_text(counts)}"
        if good.errors:
            line += f"  good errors: {outcome_text(good.errors)}"
        if good.cpu:
            line += "  CPU " + ", ".join(f"{k} {v:.2f}" for k, v in good.cpu.items())
        print(line)

    row("good alone (before)", base_a, None)
    row("good alone (after)", base_b, None)
    row("good + all abuse", mixed, abuse)
    for kind in opts.types:
        print(f"  {kind:26s} {'':58s}  {abuse.sent(kind):6d} {abuse.refused(kind):6d}  "
              f"{outcome_text(abuse.outcomes[kind])}")  # fmt: skip
    for kind, (good, abused) in per_type.items():
        row(f"good + {kind} alone", good, abused, kind)
    print(f"slowest good requests: alone {base.slowest()}; with all abuse {mixed.slowest()}")
    steady = mixed.sent_from(START_S)
    print(f"with all abuse, sent in its first {START_S:.0f} s: {len(mixed.latencies) - len(steady.latencies)} "
          f"requests; sent after: p99 {1000 * steady.p(0.99):.1f} ms = {steady.p(0.99) / base.p(0.99):.2f} x alone "
          "(the abusers' start, when they open their connections together, left out)")  # fmt: skip
    for kind, (good, _) in per_type.items():
        print(f"  with {kind} alone: {good.slowest()}")
    print("settle after abuse (s): " + ", ".join(f"{k} {v:.1f}" for k, v in settled.items()))
    if opts.idle_check:
        print(await idle_check(server, opts.idle_check, questions))
    ratio = mixed.p(0.99) / base.p(0.99)
    print(f"retriever_abuse: good_p99_ratio={ratio:.2f} good_errors={mixed.failed} "
          f"refused={abuse.refused()}/{abuse.sent()}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="good clients (default 8)")
    parser.add_argument("--seconds", type=float, default=15.0, help="each good-only phase (default 15)")
    parser.add_argument("--abuse-seconds", type=float, default=30.0, help="the all-abuse phase (default 30)")
    parser.add_argument("--type-seconds", type=float, default=10.0, help="each one-type phase (default 10)")
    parser.add_argument("--no-per-type", action="store_true", help="skip the one-type phases")
    parser.add_argument(
        "--types",
        type=lambda text: tuple(t for t in text.split(",") if t),
        default=TYPES,
        help=f"abuse types of the all-abuse phase (default {','.join(TYPES)})",
    )
    parser.add_argument(
        "--good-rate",
        type=float,
        default=None,
        help="requests/s per good client, sent on a fixed schedule (open loop); 0: closed loop; "
        "default: --good-load x the capacity measured in the calibration phase / --clients",
    )
    parser.add_argument(
        "--good-load", type=float, default=1 / 3, help="default good load, fraction of capacity (default 1/3)"
    )
    parser.add_argument("--calibrate-seconds", type=float, default=5.0, help="closed-loop capacity phase (s)")
    parser.add_argument("--warmup", type=float, default=3.0, help="good-only warm-up, not counted (s)")
    parser.add_argument("--good-timeout-s", type=float, default=60.0, help="a good request's deadline")
    for kind, (count, what) in CONNECTIONS.items():
        parser.add_argument(
            f"--{kind}-connections", type=int, default=count, help=f"{kind}: {what} (default {count})"
        )
    parser.add_argument("--flood-queries", type=int, default=64, help="flood: queries per request")
    parser.add_argument(
        "--idle-check",
        type=int,
        default=1100,
        help="idle sockets from one address in the final check (0: skip)",
    )
    parser.add_argument("--dim", type=int, default=256, help="tiny encoder width (default 256)")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `serve` argument (repeatable), e.g. --serve-arg=--max-hits=4096",
    )
    parser.add_argument(
        "--no-nice",
        action="store_true",
        help="run the abusive client at normal priority (default: nice 19, so its own CPU use, which a "
        "remote abuser's would not be, does not take the server's or the good clients')",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep/reuse the built assets here")
    parser.add_argument("--abuser", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--abuser-opts", default="{}", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if opts.abuser is not None:  # the abusive client's child process
        abuser_main(opts.abuser, json.loads(opts.abuser_opts))
        return

    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp:
        work = opts.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        assets = build_assets(work, opts.dim)
        freeze_heap()  # torch's ~1M objects: a full collection would pause the good clients ~150 ms
        serve = ["--backend", "dense", "--corpus", str(SAMPLE_CORPUS), "--index", str(assets["index"]),
                 "--encoder", str(assets["encoder"]), "--nprobe", "4", "--gpu", "off", "--threads", "1",
                 "--stats-interval-s", "0", *opts.serve_arg]  # fmt: skip
        load_before = os.getloadavg()
        started = time.perf_counter()
        with spawn_server(serve, startup_timeout_s=300, log_path=work / "server.log") as server:
            placement = (
                "abusive client at nice 0 (--no-nice)" if opts.no_nice else "abusive client at nice 19"
            )
            print(f"retriever abuse benchmark: dense server (tiny BERT {opts.dim}-d, IVF16,SQ8 over "
                  f"{SAMPLE_CORPUS.name}), {opts.clients} good clients, abuse: huge {HUGE_CHARS / 1e6:.1f} MB "
                  f"query, amplify 1024 x topk 100, slow bodies x {opts.slow_connections}, lone surrogates, "
                  f"flood {opts.flood_connections} x {opts.flood_queries} queries, idle x "
                  f"{opts.idle_connections}, trickled heads x {opts.headers_connections}, endless heads x "
                  f"{opts.bighead_connections}, cached x {opts.cached_connections}, never read x "
                  f"{opts.noread_connections}; {os.cpu_count()} CPUs, "
                  f"load average {load_before[0]:.1f}; {placement}; server args after the assets: "
                  f"{' '.join(serve[8:])}",
                  flush=True)  # fmt: skip
            abuser = Abuser(server.url, opts)
            try:
                asyncio.run(run(server, abuser, opts, load_questions()))
            finally:
                abuser.stop()
        print(f"wall {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
