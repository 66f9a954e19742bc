"""Retrieval server benchmark, side by side in one run on one dense index.

Index: N synthetic clustered 768-d unit vectors, IVF-SQ8 (nprobe set explicitly), over a synthetic
corpus, with a small real encoder (a locally built random-weight BERT with 768-d output: the same
tokenize -> forward -> masked mean pool -> L2 code path as E5, ~9x fewer FLOPs per token than
e5-base). Settings:

  (a) the in-process bound: a child process builds the retriever with the server's own code
      (`search_env.retrieval.factory.build_retriever` on the same serve arguments: same encoder
      dtype, batch size, torch/faiss threads) and runs the server's batch function (`lookup_hits`:
      encode, index search, passage lookups) in one worker thread on batches of the mean size the
      server formed in the (b) window just before, and on batches of all `--clients` in-flight
      queries at 1 query/request;
  (b) the server (`python -m search_env.retrieval serve --backend dense`, micro-batching on, cache off) under
      `--clients` concurrent closed-loop clients, at 1 and at 5 queries per request;
  (c) the same server with micro-batching off (`--max-batch 1`, the Search-R1/FlashRAG design);
  (d) a GRPO-like load: clients in groups of `--group` (= one question's rollouts) whose first search
      is the group's question, sent by every member, then `--followups` distinct searches per rollout;
      the server with its query cache on, and the (b) server with it off;
  (e) time-to-ready and memory of the server on a >= 1M-vector IVF-SQ8 index (`--ready-n` x
      `--ready-dim`), memory-mapped (the default) vs read into RAM (`--index-load read`), each started
      with the index file evicted from the page cache (posix_fadvise DONTNEED).

(a)-(d) run in `--rounds` interleaved rounds of `--seconds` each against servers started once, so
load from other jobs on a shared machine drifts over all settings alike; q/s are totals over the
rounds, and the ratios' per-round spread is printed. The clients are a minimal HTTP/1.1 keep-alive
client on asyncio (one connection per client, pre-encoded bodies, every response parsed and
checked): in training the clients are the rollout workers, not the retriever's cores, so the load
generator is kept as cheap as possible. Prints q/s, p50/p99 latency, mean batch, b/a (target >= 0.8
at 1 query/request), b/c, d(on)/d(off) (target >= 1.5), the cache hit rate, and time-to-ready / RSS
mapped vs read.

    .venv/bin/python bench/retriever.py [--n 200000] [--seconds 10] [--rounds 3]   # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import httpx
import numpy as np

from search_env.paths import REPO_ROOT
from search_env.retrieval.__main__ import build_parser
from search_env.retrieval.encoder import build_tiny_encoder
from search_env.retrieval.factory import build_retriever
from search_env.retrieval.index_build import train_and_fill, write_index
from search_env.retrieval.process import ServerProcess, spawn_server
from search_env.retrieval.server import lookup_hits

SAMPLES = REPO_ROOT / "assets" / "eval_samples"
QUESTION_FILES = [
    "r1-searcher-evalset/hotpotqa_500.jsonl",
    "r1-searcher-evalset/2wiki_500.jsonl",
    "r1-searcher-evalset/musique_500.jsonl",
    "r1-searcher-evalset/bamboogle.jsonl",
]
FIRST_PORT = 18300
TOPK = 5

BodyFn = Callable[[int, int], tuple[bytes, int]]
"""(client number, request number of that client) -> (JSON body, queries in it)."""


def load_questions() -> list[str]:
    questions = []
    for name in QUESTION_FILES:
        with open(SAMPLES / name, encoding="utf-8") as handle:
            questions += [json.loads(line)["question"] for line in handle if line.strip()]
    return questions


# ---------------------------------------------------------------- assets


def write_corpus(path: Path, n: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for lo in range(0, n, 100_000):
            handle.write(
                "".join(
                    json.dumps({"id": str(i), "contents": f'"Synthetic {i}"\nsynthetic passage number {i}'})
                    + "\n"
                    for i in range(lo, min(n, lo + 100_000))
                )
            )


def build_index(path: Path, n: int, dim: int, factory: str, seed: int) -> float:
    """An index of n clustered unit vectors (1024 random centres + noise; rows in a call are drawn
    together, so the training sample and the added rows share one distribution). Returns seconds."""
    started = time.perf_counter()
    centres = np.random.default_rng(seed).normal(size=(1024, dim)).astype(np.float32)

    def vectors(rows: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng([seed, int(rows[0]), len(rows)])
        out = centres[rows % len(centres)] + 0.5 * rng.normal(size=(len(rows), dim)).astype(np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    nlist = int(factory.split(",")[0].removeprefix("IVF"))
    index, used = train_and_fill(
        factory, dim, n, vectors, min(n, 40 * nlist), 100_000, seed, use_gpu=False, desc=f"index {n}x{dim}"
    )
    write_index(index, path, {"factory": used, "source": "bench/retriever.py synthetic"})
    return time.perf_counter() - started


def build_assets(work: Path, n: int, dim: int, factory: str, seed: int, tag: str) -> dict:
    """Corpus (n rows), tiny BERT (dim-d output) and IVF index under `work`; reused when present."""
    corpus, encoder, index = work / f"{tag}.jsonl", work / f"{tag}-bert-{dim}", work / f"{tag}.index"
    started = time.perf_counter()
    if not corpus.is_file():
        write_corpus(corpus, n)
    if not (encoder / "config.json").is_file():
        heads = 12 if dim % 64 == 0 and dim >= 768 else 2
        build_tiny_encoder(
            encoder, hidden_size=dim, num_layers=2, num_heads=heads, vocab_size=30_000, seed=seed
        )
    if not index.is_file():
        build_index(index, n, dim, factory, seed)
    return {"corpus": corpus, "encoder": encoder, "index": index, "build_s": time.perf_counter() - started}


def serve_args(assets: dict, opts, *extra: str) -> list[str]:
    return [
        "--backend", "dense", "--corpus", str(assets["corpus"]), "--index", str(assets["index"]),
        "--encoder", str(assets["encoder"]), "--nprobe", str(opts.nprobe), "--gpu", "off",
        "--threads", str(opts.threads), "--stats-interval-s", "0", *extra,
    ]  # fmt: skip


# ---------------------------------------------------------------- load generator


class Connection:
    """One HTTP/1.1 keep-alive connection; `post` sends a pre-encoded JSON body and returns
    (status, body). The server always answers with Content-Length."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        length = 0
        for line in header.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _closed_loop(url: str, body_fn: BodyFn, clients: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    queries = errors = 0
    stop_at = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal queries, errors
        connection = Connection(host, int(port))
        i = 0
        try:
            while time.perf_counter() < stop_at:
                body, n = body_fn(k, i)
                sent = time.perf_counter()
                status, answer = await connection.post("/retrieve", body)
                latencies.append(time.perf_counter() - sent)
                if status != 200 or len(json.loads(answer)["result"]) != n:
                    errors += 1
                queries += n
                i += 1
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed = time.perf_counter() - started  # includes draining the requests in flight at the deadline
    return {"queries": queries, "seconds": elapsed, "errors": errors, "latencies": latencies}


def run_load(url: str, body_fn: BodyFn, clients: int, seconds: float) -> dict:
    try:
        import uvloop  # optional: uvloop, else asyncio's own loop

        return uvloop.run(_closed_loop(url, body_fn, clients, seconds))
    except ImportError:
        return asyncio.run(_closed_loop(url, body_fn, clients, seconds))


def plain_load(questions: list[str], clients: int, per_request: int, tag: str) -> BodyFn:
    """Client k's i-th request: `per_request` questions, cycling through the list."""

    def body(k: int, i: int) -> tuple[bytes, int]:
        start = (k + i * clients) * per_request
        qs = [f"{questions[(start + j) % len(questions)]} {tag}" for j in range(per_request)]
        return json.dumps({"queries": qs, "topk": TOPK, "return_scores": True}).encode(), per_request

    return body


def grpo_load(questions: list[str], group: int, followups: int, tag: str) -> BodyFn:
    """Client k is rollout k % group of group k // group. Its rollouts r = 0, 1, ... each send the
    group's question for round r (the same string from every member: a GRPO group's first search),
    then `followups` searches no other rollout sends. One query per request, as the search tool does."""
    n = len(questions)

    def body(k: int, i: int) -> tuple[bytes, int]:
        r, step = divmod(i, 1 + followups)
        g = k // group
        if step == 0:
            query = f"{questions[(g * 7919 + r * 31) % n]} [{tag} g{g} r{r}]"
        else:
            query = f"{questions[(k * 104729 + r * 17 + step) % n]} [{tag} c{k} r{r} f{step}]"
        return json.dumps({"queries": [query], "topk": TOPK, "return_scores": True}).encode(), 1

    return body


# ---------------------------------------------------------------- settings


def start_server(args: list[str], port: int, log: Path) -> ServerProcess:
    return spawn_server(args, port=port, startup_timeout_s=600, log_path=log)


def measure_window(server: ServerProcess, body_fn: BodyFn, opts, seconds: float) -> dict:
    """One window of closed-loop load on a running server, with the /health counters' deltas."""
    before = httpx.get(f"{server.url}/health").json()
    result = run_load(server.url, body_fn, opts.clients, seconds)
    after = httpx.get(f"{server.url}/health").json()
    result["batches"] = after["batches"] - before["batches"]
    result["searched"] = after["queries_searched"] - before["queries_searched"]
    result["hits"] = after["cache"]["hits"] - before["cache"]["hits"]
    result["misses"] = after["cache"]["misses"] - before["cache"]["misses"]
    return result


def inprocess_worker(serve: list[str], questions: list[str]) -> None:
    """Child process of (a): builds the server's retriever, then per stdin line `{"batch", "seconds",
    "tag"}` runs the server's batch function on batches of that size in one worker thread (as the
    server does) and prints a JSON line with the rate."""
    retriever = build_retriever(build_parser().parse_args(["serve", *serve]))
    worker = ThreadPoolExecutor(max_workers=1)  # the server searches in one worker thread
    facts = retriever.describe()
    keys = ("encoder_dtype", "encoder_batch_size", "torch_threads", "faiss_threads")
    print(json.dumps({k: facts[k] for k in keys}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        batch, tag = spec["batch"], spec["tag"]
        done, i, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < spec["seconds"]:
            chunk = [f"{questions[(i * batch + j) % len(questions)]} {tag}" for j in range(batch)]
            worker.submit(lookup_hits, retriever, chunk, TOPK).result()
            done += batch
            i += 1
        print(json.dumps({"queries": done, "seconds": time.perf_counter() - started}), flush=True)


class InProcess:
    """The long-lived (a) child: same serve arguments, and OpenMP started with the server's threads."""

    def __init__(self, serve: list[str], opts) -> None:
        env = {**os.environ, **({"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else {})}
        command = [sys.executable, __file__, "--inprocess", json.dumps(serve)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.facts = json.loads(self._line())

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"in-process bound exited with code {self.process.wait()}")
        return line

    def measure(self, batch: int, seconds: float, tag: str) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"batch": batch, "seconds": seconds, "tag": tag}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


class Tally:
    """Windows of one setting summed over rounds: q/s = all queries / all seconds; per-round q/s kept
    for the spread of the ratios."""

    def __init__(self) -> None:
        self.queries = self.seconds = self.batches = self.searched = self.hits = self.misses = 0.0
        self.errors = 0
        self.latencies: list[float] = []
        self.per_round: list[float] = []

    def add(self, window: dict) -> None:
        self.queries += window["queries"]
        self.seconds += window["seconds"]
        self.per_round.append(window["queries"] / window["seconds"])
        for key in ("batches", "searched", "hits", "misses"):
            setattr(self, key, getattr(self, key) + window.get(key, 0))
        self.errors += window.get("errors", 0)
        self.latencies += window.get("latencies", [])

    @property
    def qps(self) -> float:
        return self.queries / self.seconds

    @property
    def mean_batch(self) -> float:
        return self.searched / max(1, self.batches)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def spread(numerator: Tally, denominator: Tally) -> str:
    ratios = [a / b for a, b in zip(numerator.per_round, denominator.per_round, strict=True)]
    return f"rounds {min(ratios):.2f}-{max(ratios):.2f}"


def process_memory(pid: int) -> dict:
    """VmRSS, RssAnon (private heap: a read index lives here), RssFile (mapped file pages, shared with
    the page cache and with other processes mapping the same file), in MiB."""
    facts = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                facts[key] = int(value.split()[0]) / 1024
    return facts


def evict_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_ready(assets: dict, opts, mode: str, questions: list[str], port: int, log: Path) -> dict:
    evict_from_page_cache(assets["index"])
    started = time.perf_counter()
    with start_server(serve_args(assets, opts, "--index-load", mode), port, log) as server:
        ready_s = time.perf_counter() - started
        health = httpx.get(f"{server.url}/health").json()
        at_ready = process_memory(health["search_process"])  # the child holding encoder + index
        run_load(server.url, plain_load(questions, 8, 1, f"ready-{mode}"), 8, 3.0)
        after = process_memory(health["search_process"])
    return {"ready_s": ready_s, "index_load_s": health["index_load_s"], "mapped": health["index_mapped"],
            "at_ready": at_ready, "after_queries": after}  # fmt: skip


# ---------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n", type=int, default=200_000, help="vectors in the index of (a)-(d) (default 200000)"
    )
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--factory", default="IVF1024,SQ8")
    parser.add_argument(
        "--nprobe",
        type=int,
        default=16,
        help="default 16 = 1.6%% of the lists, what nprobe 64 scans of IVF4096",
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="serve --threads for every server and the in-process bound (default 1: on 2 shared cores one "
        "intra-op thread encodes 2-4x faster than two; 0 = library default)",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="measurement window per setting and round"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds over all settings (default 3)"
    )
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up load before each measurement (s)")
    parser.add_argument("--group", type=int, default=5, help="(d): rollouts per GRPO group")
    parser.add_argument("--followups", type=int, default=1, help="(d): distinct searches after the first one")
    parser.add_argument(
        "--ready-n", type=int, default=1_000_000, help="(e): vectors of the time-to-ready index"
    )
    parser.add_argument("--ready-dim", type=int, default=128, help="(e): its dimension (small: builds fast)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep/reuse the built assets here (default: temp)"
    )
    parser.add_argument("--inprocess", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if opts.inprocess is not None:  # child process of (a)
        inprocess_worker(json.loads(opts.inprocess), load_questions())
        return

    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        work = opts.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        main_assets = build_assets(work, opts.n, opts.dim, opts.factory, opts.seed, "bench")
        ready_assets = build_assets(work, opts.ready_n, opts.ready_dim, opts.factory, opts.seed, "ready")
        questions = load_questions()
        c, w = opts.clients, opts.seconds
        base = serve_args(main_assets, opts, "--cache-size", "0")
        load_before = os.getloadavg()
        servers = {
            "batched": start_server(base, FIRST_PORT, work / "server_batched.log"),
            "single": start_server([*base, "--max-batch", "1", "--max-wait-ms", "0"], FIRST_PORT + 1, work / "server_single.log"),
            "cached": start_server(serve_args(main_assets, opts), FIRST_PORT + 2, work / "server_cached.log"),
            "batched_thread": start_server([*base, "--search-process", "off"], FIRST_PORT + 3, work / "server_bt.log"),
            "cached_thread": start_server(serve_args(main_assets, opts, "--search-process", "off"), FIRST_PORT + 4,
                                          work / "server_ct.log"),
        }  # fmt: skip
        inproc = InProcess(base, opts)
        try:
            for server in servers.values():  # warm-up (JIT, page cache, connection pools)
                for n in (1, 5):
                    measure_window(server, plain_load(questions, c, n, f"warm{n}"), opts, opts.warmup)
            inproc.measure(c, opts.warmup, "warm")
            keys = ("a1", "a64", "a5", "b1", "b5", "c", "d_on", "d_off", "b1_thread", "d_on_thread")
            tally = {k: Tally() for k in keys}
            shapes: dict[int, list[int]] = {1: [], 5: []}
            for r in range(opts.rounds):  # interleaved, so drifting load from other jobs hits all alike
                for n in (1, 5):  # (b), then (a) on batches of the mean size the server just formed
                    window = measure_window(
                        servers["batched"], plain_load(questions, c, n, f"b{n}.{r}"), opts, w
                    )
                    tally[f"b{n}"].add(window)
                    shapes[n].append(max(1, round(window["searched"] / max(1, window["batches"]))))
                    tally[f"a{n}"].add(inproc.measure(shapes[n][-1], w, f"a{n}.{r}"))
                tally["a64"].add(inproc.measure(c, w, f"a64.{r}"))
                tally["c"].add(
                    measure_window(servers["single"], plain_load(questions, c, 1, f"c.{r}"), opts, w)
                )
                grpo = grpo_load(questions, opts.group, opts.followups, f"d.{r}")
                tally["d_on"].add(measure_window(servers["cached"], grpo, opts, w))
                tally["d_off"].add(measure_window(servers["batched"], grpo, opts, w))
                thread_b1 = plain_load(questions, c, 1, f"bt.{r}")
                tally["b1_thread"].add(measure_window(servers["batched_thread"], thread_b1, opts, w))
                thread_d = grpo_load(questions, opts.group, opts.followups, f"dt.{r}")
                tally["d_on_thread"].add(measure_window(servers["cached_thread"], thread_d, opts, w))
            health = httpx.get(f"{servers['batched'].url}/health").json()
        finally:
            inproc.stop()
            for server in servers.values():
                server.stop()
        load_mid = os.getloadavg()
        ready = {}
        for i, mode in enumerate(("read", "mmap", "read", "mmap")):
            result = measure_ready(
                ready_assets, opts, mode, questions, FIRST_PORT + 10 + i, work / f"ready_{mode}.log"
            )
            ready.setdefault(mode, []).append(result)
        load_after = os.getloadavg()
        index_mb = ready_assets["index"].stat().st_size / 2**20

    t = tally
    print(
        f"\nretrieval benchmark: {opts.n} x {opts.dim}-d synthetic vectors, {opts.factory}, nprobe {opts.nprobe}, "
        f"tiny BERT encoder (2 layers, {opts.dim}-d, {health['encoder_dtype']}, batch <= {health['encoder_batch_size']}, "
        f"{health['torch_threads']} torch / {health['faiss_threads']} faiss threads), {c} clients, "
        f"{opts.rounds} interleaved rounds x {w:.0f} s per setting, {os.cpu_count()} CPUs, faiss {faiss.__version__}; "
        f"load average {load_before[0]:.1f} before, {load_mid[0]:.1f} after (a)-(d), {load_after[0]:.1f} at the end"
    )
    print(f"in-process child: {inproc.facts}")
    print(
        f"{'setting':60s} {'q/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'batch':>6s} {'hits':>6s} {'errors':>6s}"
    )
    for key, name in (
        ("a1", f"(a) in-process, batches of {'/'.join(map(str, shapes[1]))} (b1's mean batch per round)"),
        ("a64", f"(a) in-process, batches of {c} (all in-flight queries at 1 q/req)"),
        ("a5", f"(a) in-process, batches of {'/'.join(map(str, shapes[5]))} (b5's mean batch per round)"),
    ):
        print(f"{name:60s} {t[key].qps:8.1f}")
    for key, name in (
        ("b1", f"(b1) server, micro-batched, {c} clients x 1 query/request"),
        ("b5", f"(b5) server, micro-batched, {c} clients x 5 queries/request"),
        ("c", "(c) server, micro-batching off (--max-batch 1), 1 q/request"),
        ("d_on", f"(d) GRPO-like (groups of {opts.group}, {opts.followups} follow-up), cache on"),
        ("d_off", f"(d) GRPO-like (groups of {opts.group}, {opts.followups} follow-up), cache off"),
        ("b1_thread", "(b1) as above, search in a thread (--search-process off)"),
        ("d_on_thread", "(d) cache on, search in a thread (--search-process off)"),
    ):
        x = t[key]
        print(
            f"{name:60s} {x.qps:8.1f} {x.percentile_ms(0.5):8.1f} {x.percentile_ms(0.99):8.1f} "
            f"{x.mean_batch:6.1f} {100 * x.hit_rate:5.1f}% {x.errors:6d}"
        )
    ideal = (opts.group - 1) / (opts.group * (1 + opts.followups))
    print(f"b1/a = {t['b1'].qps / t['a1'].qps:.2f} at the server's batch shape ({spread(t['b1'], t['a1'])}; target >= 0.8), "
          f"{t['b1'].qps / t['a64'].qps:.2f} vs batches of {c}")  # fmt: skip
    print(f"b5/a = {t['b5'].qps / t['a5'].qps:.2f} at its batch shape ({spread(t['b5'], t['a5'])});  "
          f"b1/c = {t['b1'].qps / t['c'].qps:.2f} ({spread(t['b1'], t['c'])})")  # fmt: skip
    print(f"d(on)/d(off) = {t['d_on'].qps / t['d_off'].qps:.2f} ({spread(t['d_on'], t['d_off'])}; target >= 1.5), "
          f"cache hit rate {100 * t['d_on'].hit_rate:.1f}% (expected {100 * ideal:.1f}%: {1 / (1 - ideal):.2f}x if every miss costs the same)")  # fmt: skip
    print(f"search in a child process vs a thread: b1 {t['b1'].qps / t['b1_thread'].qps:.2f} "
          f"({spread(t['b1'], t['b1_thread'])}), d(on) {t['d_on'].qps / t['d_on_thread'].qps:.2f} "
          f"({spread(t['d_on'], t['d_on_thread'])})")  # fmt: skip
    print(f"\n(e) time-to-ready on {opts.ready_n} x {opts.ready_dim}-d {opts.factory} ({index_mb:.0f} MiB file, evicted "
          f"from the page cache before each start; memory of the search process, which holds encoder and index):")  # fmt: skip
    print(
        f"{'mode':6s} {'ready s':>8s} {'index s':>8s} {'RSS MiB':>8s} {'anon':>8s} {'file':>8s}   after 3 s of queries: RSS / anon / file"
    )
    for mode in ("read", "mmap"):
        for r in ready[mode]:
            m, q = r["at_ready"], r["after_queries"]
            print(f"{mode:6s} {r['ready_s']:8.2f} {r['index_load_s']:8.3f} {m['VmRSS']:8.0f} {m['RssAnon']:8.0f} "
                  f"{m['RssFile']:8.0f}   {q['VmRSS']:.0f} / {q['RssAnon']:.0f} / {q['RssFile']:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
