"""Retrieval server benchmark: micro-batched server vs raw in-process search vs one-request-at-a-time.

On one dense index (N synthetic clustered 768-d unit vectors, IVF-SQ8, nprobe set explicitly) and a
small real encoder (a locally built random-weight BERT with 768-d output: the same tokenize -> forward
-> masked mean pool -> L2 code path as E5, but ~9x fewer FLOPs per token than e5-base), it measures in
one run:

  (a) raw in-process throughput: `DenseRetriever.search_rows` (encode + index search) on batches of
      `--clients` queries;
  (b) our server (`python -m search_env serve --backend dense`, micro-batching on) under `--clients`
      concurrent async clients, one query per request;
  (c) the same server with `--max-batch 1` (each request encoded and searched alone: the
      Search-R1/FlashRAG design);

and prints queries/s, p50/p99 request latency, b/a (target >= 0.8) and b/c (target >= 5).
Clients and server share this machine's cores. Default runtime ~2-3 minutes on 2 cores.

    flock /tmp/rlvr_heavy.lock .venv/bin/python bench/retriever.py [--n 200000] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import faiss
import httpx
import numpy as np

from search_env.retrieval.corpus import Corpus
from search_env.retrieval.encoder import Encoder, build_tiny_encoder
from search_env.retrieval.index import DenseRetriever, load_index, train_and_fill, write_index
from search_env.retrieval.server import spawn_server

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
QUESTION_FILES = [
    "r1-searcher-evalset/hotpotqa_500.jsonl",
    "r1-searcher-evalset/2wiki_500.jsonl",
    "r1-searcher-evalset/musique_500.jsonl",
    "r1-searcher-evalset/bamboogle.jsonl",
]


def load_questions() -> list[str]:
    questions = []
    for name in QUESTION_FILES:
        with open(FIXTURES / name, encoding="utf-8") as handle:
            questions += [json.loads(line)["question"] for line in handle if line.strip()]
    return questions


def build_assets(work: Path, n: int, dim: int, factory: str, seed: int) -> tuple[Path, Path, Path]:
    """Synthetic corpus (n rows), a 768-d tiny BERT, and an IVF-SQ8 index over clustered vectors."""
    rng = np.random.default_rng(seed)
    corpus = work / "synthetic.jsonl"
    with open(corpus, "w", encoding="utf-8") as handle:
        for i in range(n):
            handle.write(
                json.dumps({"id": str(i), "contents": f'"Synthetic {i}"\nsynthetic passage number {i}'})
                + "\n"
            )
    encoder = build_tiny_encoder(
        work / "tiny-bert-768", hidden_size=dim, num_layers=2, num_heads=12, vocab_size=30_000, seed=seed
    )
    centres = rng.normal(size=(1024, dim)).astype(np.float32)

    def vectors(rows: np.ndarray) -> np.ndarray:  # deterministic per row, so any chunking agrees
        out = np.empty((len(rows), dim), dtype=np.float32)
        for j, row in enumerate(rows):
            local = np.random.default_rng(seed * 1_000_003 + int(row))
            out[j] = centres[local.integers(len(centres))] + 0.5 * local.normal(size=dim)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    nlist = int(factory.split(",")[0].removeprefix("IVF"))
    index, used = train_and_fill(
        factory,
        dim,
        n,
        vectors,
        train_size=min(n, 40 * nlist),
        chunk_size=50_000,
        seed=seed,
        use_gpu=None,
        desc="synthetic index",
    )
    path = work / "synthetic_ivf_sq8.index"
    write_index(index, path, {"factory": used, "source": "bench/retriever.py synthetic"})
    return corpus, encoder, path


def measure_raw(retriever: DenseRetriever, questions: list[str], batch: int, seconds: float) -> dict:
    retriever.search_rows(questions[:batch], 5)  # warm-up
    done, started, i = 0, time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        chunk = [questions[(i + j) % len(questions)] for j in range(batch)]
        retriever.search_rows(chunk, 5)
        done += batch
        i += batch
    elapsed = time.perf_counter() - started
    return {
        "qps": done / elapsed,
        "queries": done,
        "seconds": elapsed,
        "batch_ms": 1000 * elapsed / (done / batch),
    }


async def _client_load(url: str, questions: list[str], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    started = time.perf_counter()
    stop_at = started + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as http:

        async def one_client(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                response = await http.post(
                    f"{url}/retrieve",
                    json={"queries": [questions[i % len(questions)]], "topk": 5, "return_scores": True},
                )
                if response.status_code != 200 or len(response.json()["result"]) != 1:
                    errors += 1
                latencies.append(time.perf_counter() - sent)
                i += clients

        await asyncio.gather(*(one_client(k) for k in range(clients)))
    elapsed = time.perf_counter() - started  # includes draining the requests in flight at the deadline
    latencies.sort()
    return {
        "qps": len(latencies) / elapsed,
        "queries": len(latencies),
        "errors": errors,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def measure_server(
    serve_args: list[str], questions: list[str], clients: int, seconds: float, log: Path
) -> dict:
    with spawn_server(serve_args, startup_timeout_s=300, log_path=log) as server:
        asyncio.run(_client_load(server.url, questions, clients, 2.0))  # warm-up (JIT, page cache, pools)
        before = httpx.get(f"{server.url}/health").json()
        result = asyncio.run(_client_load(server.url, questions, clients, seconds))
        after = httpx.get(f"{server.url}/health").json()
    batches = after["batches"] - before["batches"]
    result["mean_batch"] = (after["queries_served"] - before["queries_served"]) / max(1, batches)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="vectors in the index (default 200000)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--factory", default="IVF1024,SQ8")
    parser.add_argument(
        "--nprobe",
        type=int,
        default=16,
        help="default 16 = 1.6%% of the lists, the fraction nprobe 64 scans of IVF4096 on wiki-18",
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement time per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the built assets here (default: temp)"
    )
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        corpus_path, encoder_path, index_path = build_assets(work, args.n, args.dim, args.factory, args.seed)
        build_s = time.perf_counter() - started
        questions = load_questions()

        retriever = DenseRetriever(
            Corpus(corpus_path),
            Encoder(encoder_path, batch_size=args.clients),
            load_index(index_path, nprobe=args.nprobe),
        )
        raw = measure_raw(retriever, questions, args.clients, args.seconds)
        del retriever
        serve = [
            "--backend",
            "dense",
            "--corpus",
            str(corpus_path),
            "--index",
            str(index_path),
            "--encoder",
            str(encoder_path),
            "--nprobe",
            str(args.nprobe),
        ]
        batched = measure_server(
            [*serve, "--max-batch", "256", "--max-wait-ms", "2"],
            questions,
            args.clients,
            args.seconds,
            work / "server_batched.log",
        )
        single = measure_server(
            [*serve, "--max-batch", "1", "--max-wait-ms", "0"],
            questions,
            args.clients,
            args.seconds,
            work / "server_single.log",
        )

    print(
        f"\nretrieval benchmark: {args.n} x {args.dim}-d synthetic vectors, {args.factory}, nprobe {args.nprobe}, "
        f"tiny BERT encoder (2 layers, 768-d), {args.clients} clients, {args.seconds:.0f} s per setting, "
        f"{os.cpu_count()} CPUs, faiss {faiss.__version__}, GPU {'yes' if faiss.get_num_gpus() else 'no'}; "
        f"assets built in {build_s:.0f} s"
    )
    print(f"{'setting':58s} {'q/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'batch':>6s} {'errors':>6s}")
    print(
        f"{'(a) raw in-process encode+search, batches of ' + str(args.clients):58s} {raw['qps']:8.1f} "
        f"{'':>8s} {'':>8s} {args.clients:6d} {'':>6s}"
    )
    for name, r in (
        ("(b) server, micro-batched, " + str(args.clients) + " concurrent clients", batched),
        ("(c) server, one request at a time (--max-batch 1)", single),
    ):
        print(
            f"{name:58s} {r['qps']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['mean_batch']:6.1f} "
            f"{r['errors']:6d}"
        )
    print(
        f"b/a = {batched['qps'] / raw['qps']:.2f} (target >= 0.8)   b/c = {batched['qps'] / single['qps']:.2f} "
        f"(target >= 5)"
    )


if __name__ == "__main__":
    main()
