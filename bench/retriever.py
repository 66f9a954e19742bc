"""Retrieval server benchmark, side by side in one run on one dense index.

Index: N synthetic clustered 768-d unit vectors, IVF-SQ8 (nprobe set explicitly), over a synthetic
corpus, with a small real encoder (a locally built random-weight BERT with 768-d output: the same
tokenize -> forward -> masked mean pool -> L2 code path as E5, ~9x fewer FLOPs per token than
e5-base). Settings:

  (a) the in-process bound: a child process builds the retriever with the server's own code
      (`search_env.__main__.build_retriever` on the same serve arguments: same encoder dtype, batch
      size, torch/faiss threads) and runs the server's batch function (`lookup_hits`: encode, index
      search, passage lookups) in one worker thread, as the server does, on batches of the size the
      server formed in (b), and on batches of all `--clients` in-flight queries at 1 query/request;
  (b) the server (`python -m search_env serve --backend dense`, micro-batching on, cache off) under
      `--clients` concurrent closed-loop clients, at 1 and at 5 queries per request;
  (c) the same server with micro-batching off (`--max-batch 1`, the Search-R1/FlashRAG design);
  (d) a GRPO-like load: clients in groups of `--group` (= one question's rollouts) whose first search
      is the group's question, sent by every member, then `--followups` distinct searches per rollout;
      the server with its query cache on, then off;
  (e) time-to-ready and memory of the server on a >= 1M-vector IVF-SQ8 index (`--ready-n` x
      `--ready-dim`), memory-mapped (the default) vs read into RAM (`--index-load read`), each started
      with the index file evicted from the page cache (posix_fadvise DONTNEED).

The clients are a minimal HTTP/1.1 keep-alive client on asyncio (one connection per client,
pre-encoded bodies, every response parsed and checked): in training the clients are the rollout
workers, not the retriever's cores, so the load generator is kept as cheap as possible on this
shared machine. Prints q/s, p50/p99 latency, mean batch, b/a (target >= 0.8 at 1 query/request),
b/c, d(on)/d(off) (target >= 1.5), the cache hit rate, and time-to-ready / RSS mapped vs read.

    .venv/bin/python bench/retriever.py [--n 200000] [--seconds 15]    # ~6-8 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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

from search_env.retrieval.encoder import build_tiny_encoder
from search_env.retrieval.index import train_and_fill, write_index
from search_env.retrieval.server import ServerProcess, spawn_server

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
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
        with open(FIXTURES / name, encoding="utf-8") as handle:
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
    latencies.sort()
    return {
        "qps": queries / elapsed,
        "queries": queries,
        "errors": errors,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def run_load(url: str, body_fn: BodyFn, clients: int, seconds: float) -> dict:
    try:
        import uvloop

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


def measure_server(args: list[str], body_fn: BodyFn, warm_fn: BodyFn, opts, port: int, log: Path) -> dict:
    with start_server(args, port, log) as server:
        run_load(server.url, warm_fn, opts.clients, opts.warmup)
        before = httpx.get(f"{server.url}/health").json()
        result = run_load(server.url, body_fn, opts.clients, opts.seconds)
        after = httpx.get(f"{server.url}/health").json()
    batches = after["batches"] - before["batches"]
    hits = after["cache"]["hits"] - before["cache"]["hits"]
    misses = after["cache"]["misses"] - before["cache"]["misses"]
    result["mean_batch"] = (after["queries_searched"] - before["queries_searched"]) / max(1, batches)
    result["hit_rate"] = hits / max(1, hits + misses)
    result["health"] = after
    return result


def inprocess_bound(serve: list[str], questions: list[str], batch: int, seconds: float) -> dict:
    """Child process: the server's retriever and batch function on batches of `batch` queries."""
    from search_env.__main__ import build_parser, build_retriever
    from search_env.retrieval.server import lookup_hits

    args = build_parser().parse_args(["serve", *serve])
    retriever = build_retriever(args)
    worker = ThreadPoolExecutor(max_workers=1)  # the server searches in one worker thread

    def run(i: int) -> None:
        chunk = [f"{questions[(i * batch + j) % len(questions)]} inproc" for j in range(batch)]
        worker.submit(lookup_hits, retriever, chunk, TOPK).result()

    run(0)  # warm-up
    done, i, started = 0, 1, time.perf_counter()
    while time.perf_counter() - started < seconds:
        run(i)
        done += batch
        i += 1
    elapsed = time.perf_counter() - started
    facts = retriever.describe()
    keys = ("encoder_dtype", "encoder_batch_size", "torch_threads", "faiss_threads")
    return {
        "qps": done / elapsed,
        "batch": batch,
        "batch_ms": 1000 * elapsed / (i - 1),
        **{k: facts[k] for k in keys},
    }


def measure_inprocess(serve: list[str], batch: int, opts) -> dict:
    """Run `inprocess_bound` in a fresh child whose OpenMP starts with the server's thread count."""
    spec = json.dumps({"serve": serve, "batch": batch, "seconds": opts.seconds})
    env = {**os.environ, **({"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else {})}
    command = [sys.executable, __file__, "--inprocess", spec]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1200, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        at_ready = process_memory(server.process.pid)
        run_load(server.url, plain_load(questions, 8, 1, f"ready-{mode}"), 8, 3.0)
        after = process_memory(server.process.pid)
    return {"ready_s": ready_s, "index_load_s": health["index_load_s"], "mapped": health["index_mapped"],
            "at_ready": at_ready, "after_queries": after}  # fmt: skip


# ---------------------------------------------------------------- report


def row(name: str, r: dict) -> str:
    return (
        f"{name:60s} {r['qps']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['mean_batch']:6.1f} "
        f"{100 * r['hit_rate']:5.1f}% {r['errors']:6d}"
    )


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
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement time per setting")
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
        spec = json.loads(opts.inprocess)
        print(json.dumps(inprocess_bound(spec["serve"], load_questions(), spec["batch"], spec["seconds"])))
        return

    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        work = opts.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        main_assets = build_assets(work, opts.n, opts.dim, opts.factory, opts.seed, "bench")
        ready_assets = build_assets(work, opts.ready_n, opts.ready_dim, opts.factory, opts.seed, "ready")
        questions = load_questions()
        load_before = os.getloadavg()
        base = serve_args(main_assets, opts, "--cache-size", "0")
        port = iter(range(FIRST_PORT, FIRST_PORT + 100))

        def server(args: list[str], body: BodyFn, warm: BodyFn, name: str) -> dict:
            return measure_server(args, body, warm, opts, next(port), work / f"server_{name}.log")

        c = opts.clients
        b1 = server(base, plain_load(questions, c, 1, "b1"), plain_load(questions, c, 1, "w1"), "b1")
        a_obs = measure_inprocess(base, max(1, round(b1["mean_batch"])), opts)
        a_full = measure_inprocess(base, c, opts)
        b5 = server(base, plain_load(questions, c, 5, "b5"), plain_load(questions, c, 5, "w5"), "b5")
        a5_obs = measure_inprocess(base, max(1, round(b5["mean_batch"])), opts)
        single = server([*base, "--max-batch", "1", "--max-wait-ms", "0"], plain_load(questions, c, 1, "c"),
                        plain_load(questions, c, 1, "wc"), "c")  # fmt: skip
        grpo = grpo_load(questions, opts.group, opts.followups, "d")
        warm = grpo_load(questions, opts.group, opts.followups, "wd")
        d_on = server(serve_args(main_assets, opts), grpo, warm, "d_on")
        d_off = server(base, grpo, warm, "d_off")
        ready = {}
        for mode in ("read", "mmap", "read", "mmap"):
            result = measure_ready(
                ready_assets, opts, mode, questions, next(port), work / f"ready_{mode}.log"
            )
            ready.setdefault(mode, []).append(result)
        load_after = os.getloadavg()
        index_mb = ready_assets["index"].stat().st_size / 2**20

    health = b1["health"]
    print(
        f"\nretrieval benchmark: {opts.n} x {opts.dim}-d synthetic vectors, {opts.factory}, nprobe {opts.nprobe}, "
        f"tiny BERT encoder (2 layers, {opts.dim}-d, {health['encoder_dtype']}, batch <= {health['encoder_batch_size']}, "
        f"{health['torch_threads']} torch / {health['faiss_threads']} faiss threads), {c} clients, "
        f"{opts.seconds:.0f} s per setting, {os.cpu_count()} CPUs, faiss {faiss.__version__}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(
        f"{'setting':60s} {'q/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'batch':>6s} {'hits':>6s} {'errors':>6s}"
    )
    for name, a in (
        (f"(a) in-process, batches of {a_obs['batch']} (the server's mean batch in b1)", a_obs),
        (f"(a) in-process, batches of {c} (every in-flight query, 1 q/req)", a_full),
        (f"(a) in-process, batches of {a5_obs['batch']} (the server's mean batch in b5)", a5_obs),
    ):
        print(f"{name:60s} {a['qps']:8.1f} {'':>8s} {'':>8s} {a['batch']:6d}  [{a['encoder_dtype']}, "
              f"{a['torch_threads']}/{a['faiss_threads']} threads]")  # fmt: skip
    print(row(f"(b1) server, micro-batched, {c} clients x 1 query/request", b1))
    print(row(f"(b5) server, micro-batched, {c} clients x 5 queries/request", b5))
    print(row("(c) server, micro-batching off (--max-batch 1), 1 q/request", single))
    print(row(f"(d) GRPO-like (groups of {opts.group}, {opts.followups} follow-up), cache on", d_on))
    print(row(f"(d) GRPO-like (groups of {opts.group}, {opts.followups} follow-up), cache off", d_off))
    print(
        f"b1/a = {b1['qps'] / a_obs['qps']:.2f} at the server's batch shape (target >= 0.8), "
        f"{b1['qps'] / a_full['qps']:.2f} vs batches of {c};  b5/a = {b5['qps'] / a5_obs['qps']:.2f} at its batch shape;  b1/c = {b1['qps'] / single['qps']:.2f};  d(on)/d(off) = {d_on['qps'] / d_off['qps']:.2f} "
        f"(target >= 1.5), cache hit rate {100 * d_on['hit_rate']:.1f}% (ideal {100 * (opts.group - 1) / (opts.group * (1 + opts.followups)):.1f}%)"
    )
    print(f"\n(e) time-to-ready on {opts.ready_n} x {opts.ready_dim}-d {opts.factory} ({index_mb:.0f} MiB file, evicted "
          f"from the page cache before each start):")  # fmt: skip
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
