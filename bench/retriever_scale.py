"""The dense retriever at wiki-18 scale on one machine: build, cold boot, memory, throughput.

Synthetic data of wiki-18's shape, N passages (up to 21,015,324):
  - vectors: 768-d clustered unit vectors, generated row by row from a seed (`synthetic_vectors`), so
    no Flat file is ever written; built to `IVF4096,SQ8` by `index.build_index_file`, the function
    behind `build-index` and `convert-index` (train on a sample, add in chunks; the inverted lists
    on disk and merged when they would not fit in RAM), in a child process whose peak RSS is read;
  - corpus: jsonl rows `{"id", "contents": "\\"Title\\"\\ntext"}` of about 100 words (9 in 10 rows
    exactly 100, as wiki-18's 100-word chunks; the rest the shorter ends of articles);
  - encoder: a local random-weight BERT with 768-d output (2 layers), the server's real query path.

Measured, each with `python -m search_env.retrieval serve` (search in its child process, cache off):
  - the very first start, which builds the corpus offset table, with the page cache dropped;
  - cold boot with the page cache dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`, root) and the
    offset table built: `/health` ready and the first answered `POST /retrieve`, then latency
    p50/p99 of the first `--cold-queries` queries (`--cold-clients` concurrent, 1 query/request),
    with `--prewarm off` and with `--prewarm on`;
  - warm q/s at nprobe 64 with `--clients` clients at 1 and 5 queries/request, side by side with the
    in-process bound (bench/retriever.py's: the server's encoder, index and batch function in one
    process, no HTTP, on batches of the size the server formed), in interleaved rounds;
  - memory: RSS (all, and beyond the shared page cache: RssAnon) and PSS of one server (HTTP
    process + search process), and PSS of two replicas on the same files;
  - faiss's scan rate per core at nprobe 64 (codes of the probed lists / s, one thread).

The last line is machine-readable:
  retriever_scale: passages=N build_s=… peak_build_rss_mb=… boot_s=… first_answer_s=… cold_p99_ms=…
  warm_qps=… rss_mb=… two_replica_pss_mb=… (then more key=value figures)

    .venv/bin/python bench/retriever_scale.py --passages 200000             # ~3 min on 2 cores
    .venv/bin/python bench/retriever_scale.py --passages 21015324 --workdir /work/scale_data/21m
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
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import retriever as rb  # noqa: E402  bench/retriever.py: load generator, in-process bound, tallies

from search_env.retrieval.corpus import OFFSETS_SUFFIX  # noqa: E402
from search_env.retrieval.encoder import build_tiny_encoder  # noqa: E402
from search_env.retrieval.probe import wait_healthy  # noqa: E402
from search_env.retrieval.process import ServerProcess, start_server  # noqa: E402
from search_env.safe_fs import remove_tree, replace_durably  # noqa: E402

WIKI18_PASSAGES = 21_015_324
POOL_ROWS = (65521, 65519)
"""Two primes: row r's noise is pool0[r % p0] + pool1[r % p1], distinct for every r < p0 x p1."""
CLUSTERS = 8192


# ---------------------------------------------------------------- data


SMALL_N = 1_000_000
"""Below this many passages k-means trains on 10 x nlist vectors (faiss warns under 39 x): the CI-sized
run's build stays short; from 1 M on it takes the study's 40 x nlist."""


def synthetic_vectors(dim: int, seed: int):
    """A `VectorSource` of clustered unit vectors: row r = normalise(centre[c(r)] + noise(r)), the
    same vector for a row however rows are asked for (training sample or chunk)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CLUSTERS, dim), dtype=np.float32)
    scale = np.float32(0.5 / np.sqrt(2))
    pools = [scale * rng.standard_normal((p, dim), dtype=np.float32) for p in POOL_ROWS]

    def vectors(rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), dim), dtype=np.float32)
        for lo in range(0, len(rows), 65536):
            r = rows[lo : lo + 65536].astype(np.int64)
            block = centres[(r * 2654435761) % CLUSTERS]
            block += pools[0][r % POOL_ROWS[0]]
            block += pools[1][r % POOL_ROWS[1]]
            block /= np.linalg.norm(block, axis=1, keepdims=True)
            out[lo : lo + len(r)] = block
        return out

    return vectors


def write_corpus(path: Path, n: int, seed: int) -> None:
    """n rows of wiki-18's shape: `"Title"` (1-4 words) newline ~100 words of lower-case text (words
    of 1-12 letters, ~5.7 characters with the space, as English), ids "0".."n-1"."""
    rng = np.random.default_rng(seed + 1)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=k)) for k in rng.integers(1, 10, size=20_000)]
    words = [vocab[i] for i in rng.integers(0, len(vocab), size=1_000_000)]
    text = " ".join(words)
    starts = np.concatenate([[0], np.cumsum([len(w) + 1 for w in words])])
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as handle:
        for lo in range(0, n, 100_000):
            m = min(n, lo + 100_000) - lo
            length = np.where(rng.random(m) < 0.9, 100, rng.integers(5, 100, size=m))
            first = rng.integers(0, len(words) - 200, size=m)
            title = rng.integers(1, 5, size=m)
            head = rng.integers(0, len(words) - 10, size=m)
            rows = []
            for j in range(m):
                t0, b0 = head[j], first[j]
                name = text[starts[t0] : starts[t0 + title[j]] - 1].title()
                body = text[starts[b0] : starts[b0 + length[j]] - 1]
                rows.append(f'{{"id": "{lo + j}", "contents": "\\"{name}\\"\\n{body}"}}\n')
            handle.write("".join(rows))
    replace_durably(tmp, path)


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build_child(spec: dict) -> None:
    """Child process: build the index through `build_index_file`; print build seconds and peak RSS."""
    from search_env.retrieval.index_build import build_index_file

    started = time.perf_counter()
    vectors = synthetic_vectors(spec["dim"], spec["seed"])
    meta = build_index_file(
        spec["out"], spec["factory"], spec["dim"], spec["n"], vectors,
        {"source": "bench/retriever_scale.py synthetic"}, spec["train_size"], spec["chunk_size"],
        spec["seed"], use_gpu=False, ondisk={"auto": None, "on": True, "off": False}[spec["ondisk"]],
    )  # fmt: skip
    print(json.dumps({"build_s": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(),
                      "built": meta["built"], "factory": meta["factory"]}), flush=True)  # fmt: skip


def build_assets(work: Path, opts) -> dict:
    """Corpus, encoder and index under `work` (each reused when present); build figures."""
    n = opts.passages
    corpus, encoder, index = work / "corpus.jsonl", work / "bert-768", work / "index.ivf_sq8"
    facts: dict = {}
    if not corpus.is_file():
        started = time.perf_counter()
        write_corpus(corpus, n, opts.seed)
        facts["corpus_s"] = time.perf_counter() - started
    if not (encoder / "config.json").is_file():
        build_tiny_encoder(
            encoder, hidden_size=768, num_layers=2, num_heads=12, vocab_size=30_000, seed=opts.seed
        )
    record = work / "build.json"
    if not index.is_file():
        nlist = int(opts.factory.split(",")[0].removeprefix("IVF"))
        spec = {"out": str(index), "factory": opts.factory, "dim": 768, "n": n, "seed": opts.seed,
                "train_size": opts.train_size or min(n, (40 if n >= SMALL_N else 10) * nlist), "chunk_size": min(n, opts.chunk_size),
                "ondisk": opts.ondisk}  # fmt: skip
        command = [sys.executable, __file__, "--build-child", json.dumps(spec)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=4 * 3600, check=True)
        record.write_text(done.stdout.strip().splitlines()[-1])
    facts.update(json.loads(record.read_text()))
    facts["corpus_gb"] = corpus.stat().st_size / 1e9
    facts["index_gb"] = index.stat().st_size / 1e9
    return {"corpus": corpus, "encoder": encoder, "index": index, **facts}


# ---------------------------------------------------------------- measurement helpers


def drop_page_cache(assets: dict, how: str) -> None:
    """Empty the page cache: all of it (`drop_caches`, root) or the benchmark's files (`fadvise`)."""
    os.sync()
    if how == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
        return
    for key in ("corpus", "index"):
        rb.evict_from_page_cache(assets[key])
    offsets = Path(str(assets["corpus"]) + OFFSETS_SUFFIX)
    if offsets.is_file():
        rb.evict_from_page_cache(offsets)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    found = [pid]
    for p in found:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def tree_memory(pid: int) -> dict:
    """Rss, Pss, Rss beyond the page cache (Anonymous) and its Pss share, over `pid`'s process tree, MiB."""
    total = {"rss": 0.0, "pss": 0.0, "anon": 0.0, "pss_anon": 0.0, "pss_file": 0.0}
    keys = {
        "Rss:": "rss",
        "Pss:": "pss",
        "Anonymous:": "anon",
        "Pss_Anon:": "pss_anon",
        "Pss_File:": "pss_file",
    }
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts and parts[0] in keys:
                total[keys[parts[0]]] += int(parts[1]) / 1024
    return total


def serve_args(assets: dict, opts, *extra: str) -> list[str]:
    return [
        "--backend", "dense", "--corpus", str(assets["corpus"]), "--index", str(assets["index"]),
        "--encoder", str(assets["encoder"]), "--nprobe", str(opts.nprobe), "--gpu", "off",
        "--threads", str(opts.threads), "--stats-interval-s", "0", "--cache-size", "0", *extra,
    ]  # fmt: skip


async def _count_load(url: str, queries: list[str], clients: int) -> list[float]:
    """Send every query once, 1 per request, from `clients` closed-loop clients; latencies in s."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    todo = iter(queries)

    async def client() -> None:
        connection = rb.Connection(host, int(port))
        try:
            for query in todo:
                body = json.dumps({"queries": [query], "topk": rb.TOPK, "return_scores": True}).encode()
                sent = time.perf_counter()
                status, answer = await asyncio.wait_for(connection.post("/retrieve", body), 600)
                if status != 200 or len(json.loads(answer)["result"]) != 1:
                    raise RuntimeError(f"bad answer {status}: {answer[:200]!r}")
                latencies.append(time.perf_counter() - sent)
        finally:
            connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def cold_start(
    assets: dict, opts, questions: list[str], prewarm: str, tag: str, work: Path, n_queries: int
) -> tuple[dict, ServerProcess]:
    """Drop the page cache, start a server, time `/health` ready and the first answer, then the
    latencies of the first `n_queries` queries. Returns the figures and the running server."""
    drop_page_cache(assets, opts.evict)
    started = time.perf_counter()
    server = start_server(serve_args(assets, opts, "--prewarm", prewarm), log_path=work / f"server_{tag}.log")
    try:
        health = wait_healthy(server.url, opts.startup_timeout, server.process)
        boot_s = time.perf_counter() - started
        body = {"queries": [f"{questions[0]} {tag}"], "topk": rb.TOPK}
        response = httpx.post(f"{server.url}/retrieve", json=body, timeout=600)
        response.raise_for_status()
        first_s = time.perf_counter() - started
        cold = [f"{questions[i % len(questions)]} {tag} {i}" for i in range(n_queries)]
        begun = time.perf_counter()
        latencies = asyncio.run(_count_load(server.url, cold, opts.cold_clients)) if cold else []
        cold_s = max(time.perf_counter() - begun, 1e-9)
    except BaseException:
        server.stop()
        raise
    after = httpx.get(f"{server.url}/health", timeout=30).json()
    figures = {
        "boot_s": boot_s,
        "first_answer_s": first_s,
        "index_load_s": health.get("index_load_s"),
        "cold_p50_ms": percentile_ms(latencies, 0.5),
        "cold_p99_ms": percentile_ms(latencies, 0.99),
        "cold_qps": len(latencies) / cold_s,
        "prewarm_state": after.get("prewarm"),
        "prewarm_gb_at_end": after.get("prewarm_bytes", 0) / 1e9,
    }
    print(f"cold start, --prewarm {prewarm}: {json.dumps(figures)}", flush=True)
    return figures, server


def wait_prewarm(server: ServerProcess, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        if health.get("prewarm") != "running":
            return health
        time.sleep(1.0)
    raise TimeoutError(f"pre-warm not done after {timeout_s:.0f} s")


def scan_rate(index_path: Path, opts, n_queries: int = 256) -> dict:
    """faiss alone, one thread, nprobe `--nprobe`: codes of the probed lists scanned per second,
    on stored vectors as queries in batches of 64 (what a busy server searches at once)."""
    import faiss

    from search_env.retrieval.index import load_index

    faiss.omp_set_num_threads(1)
    loaded = load_index(index_path, nprobe=opts.nprobe)
    ivf = faiss.extract_index_ivf(loaded.index)
    rows = np.sort(np.random.default_rng(7).choice(loaded.index.ntotal, size=n_queries, replace=False))
    queries = synthetic_vectors(768, opts.seed)(rows)
    _, probed = ivf.quantizer.search(queries, loaded.nprobe)
    sizes = np.array([ivf.invlists.list_size(i) for i in range(ivf.nlist)])
    codes = int(sizes[probed].sum())
    loaded.index.search(queries[:64], rb.TOPK)  # pages in
    started = time.perf_counter()
    for lo in range(0, n_queries, 64):
        loaded.index.search(queries[lo : lo + 64], rb.TOPK)
    seconds = time.perf_counter() - started
    return {"scan_mcodes_per_core_s": codes / seconds / 1e6, "scan_ms_per_query": 1000 * seconds / n_queries,
            "codes_per_query": codes / n_queries}  # fmt: skip


# ---------------------------------------------------------------- main


def run(opts, work: Path) -> dict:
    assets = build_assets(work, opts)
    print(f"assets: {json.dumps({k: v for k, v in assets.items() if not isinstance(v, Path)})}", flush=True)
    questions = rb.load_questions()
    out: dict = {"passages": opts.passages, **{k: v for k, v in assets.items() if not isinstance(v, Path)}}

    # the very first start: the corpus offset table is built
    Path(str(assets["corpus"]) + OFFSETS_SUFFIX).unlink(missing_ok=True)
    first, server = cold_start(assets, opts, questions, "off", "first", work, 0)
    server.stop()
    out["first_start_boot_s"], out["first_start_answer_s"] = first["boot_s"], first["first_answer_s"]

    cold_off, server = cold_start(assets, opts, questions, "off", "cold_off", work, opts.cold_queries)
    server.stop()
    cold_on, server = cold_start(assets, opts, questions, "on", "cold_on", work, opts.cold_queries)
    try:
        health = wait_prewarm(server, opts.startup_timeout)
        out["prewarm_s"] = health.get("prewarm_s")
        out.update({k: cold_on[k] for k in ("boot_s", "first_answer_s", "cold_p50_ms", "cold_p99_ms")})
        out.update(
            {
                f"{k}_noprewarm": cold_off[k]
                for k in ("boot_s", "first_answer_s", "cold_p50_ms", "cold_p99_ms")
            }
        )

        # warm: server vs in-process bound, interleaved rounds
        opts.n = opts.passages
        inproc = rb.InProcess(serve_args(assets, opts), opts)
        try:
            c, w = opts.clients, opts.seconds
            for n in (1, 5):
                rb.measure_window(server, rb.plain_load(questions, c, n, f"warm{n}"), opts, opts.warmup)
            inproc.measure(c, opts.warmup, "warm")
            tally = {k: rb.Tally() for k in ("a1", "a5", "b1", "b5")}
            shapes: dict[int, list[int]] = {1: [], 5: []}
            for r in range(opts.rounds):
                for n in (1, 5):
                    window = rb.measure_window(server, rb.plain_load(questions, c, n, f"b{n}.{r}"), opts, w)
                    tally[f"b{n}"].add(window)
                    shapes[n].append(max(1, round(window["searched"] / max(1, window["batches"]))))
                    tally[f"a{n}"].add(inproc.measure(shapes[n][-1], w, f"a{n}.{r}"))
        finally:
            inproc.stop()
        for n in (1, 5):
            b, a = tally[f"b{n}"], tally[f"a{n}"]
            out[f"warm_qps_b{n}"], out[f"bound_qps_b{n}"] = b.qps, a.qps
            out[f"warm_ratio_b{n}"] = b.qps / a.qps
            out[f"warm_p50_ms_b{n}"], out[f"warm_p99_ms_b{n}"] = b.percentile_ms(0.5), b.percentile_ms(0.99)
            out[f"batch_b{n}"] = "/".join(map(str, shapes[n]))
            out[f"ratio_rounds_b{n}"] = rb.spread(b, a)
            out[f"errors_b{n}"] = b.errors

        # memory: one server, then two replicas on the same files
        one = tree_memory(server.process.pid)
        replica = start_server(serve_args(assets, opts), log_path=work / "server_replica.log")
        try:
            wait_healthy(replica.url, opts.startup_timeout, replica.process)
            wait_prewarm(replica, opts.startup_timeout)
            rb.measure_window(replica, rb.plain_load(questions, c, 1, "replica"), opts, opts.warmup)
            both = [tree_memory(server.process.pid), tree_memory(replica.process.pid)]
        finally:
            replica.stop()
    finally:
        server.stop()
    out.update({f"one_{k}_mb": v for k, v in one.items()})
    out["two_replica_pss_mb"] = both[0]["pss"] + both[1]["pss"]
    out["second_replica_adds_pss_mb"] = out["two_replica_pss_mb"] - one["pss"]
    out["second_replica_anon_mb"] = both[1]["anon"]
    out.update(scan_rate(assets["index"], opts))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=200_000, help="N, up to 21015324 (default 200000)")
    parser.add_argument("--factory", default="IVF4096,SQ8")
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="default min(N, 40 x nlist); 10 x nlist below 1 M passages",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=1_000_000, help="vectors per add (default 1M, as the study)"
    )
    parser.add_argument(
        "--ondisk", choices=["auto", "on", "off"], default="auto", help="build-index --ondisk"
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="serve --threads (default 1, as bench/retriever.py)"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="warm window per setting and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--cold-queries", type=int, default=1000)
    parser.add_argument("--cold-clients", type=int, default=8)
    parser.add_argument(
        "--evict", choices=["drop_caches", "fadvise"], default="drop_caches",
        help="how the page cache is emptied before a cold start: all of it (root) or the benchmark's files",
    )  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep/reuse the data here (default: temp)")
    parser.add_argument("--build-child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.build_child is not None:
        build_child(json.loads(opts.build_child))
        return
    if not 1 <= opts.passages <= WIKI18_PASSAGES:
        raise SystemExit(f"--passages must be in 1..{WIKI18_PASSAGES}, got {opts.passages}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    tmp = None
    if opts.workdir is None:
        tmp = tempfile.mkdtemp(prefix="retriever-scale-")
    work = opts.workdir or Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        out = run(opts, work)
    finally:
        if tmp is not None:
            remove_tree(tmp, tempfile.gettempdir())
    out["total_s"] = time.perf_counter() - started
    out["load_avg"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1, default=str))
    for n in (1, 5):
        print(
            f"warm, {opts.clients} clients x {n} q/request: server {out[f'warm_qps_b{n}']:.1f} q/s, in-process "
            f"bound {out[f'bound_qps_b{n}']:.1f} q/s, ratio {out[f'warm_ratio_b{n}']:.2f} ({out[f'ratio_rounds_b{n}']})"
        )
    print(
        f"cold p99 {out['cold_p99_ms']:.0f} ms with pre-warm, {out['cold_p99_ms_noprewarm']:.0f} ms without"
    )
    line = {
        "passages": opts.passages,
        "build_s": out["build_s"],
        "peak_build_rss_mb": out["peak_rss_mb"],
        "boot_s": out["boot_s"],
        "first_answer_s": out["first_answer_s"],
        "cold_p99_ms": out["cold_p99_ms"],
        "warm_qps": out["warm_qps_b1"],
        "rss_mb": out["one_anon_mb"],
        "two_replica_pss_mb": out["two_replica_pss_mb"],
        "cold_p99_ms_noprewarm": out["cold_p99_ms_noprewarm"],
        "warm_ratio_b1": out["warm_ratio_b1"],
        "warm_qps_b5": out["warm_qps_b5"],
        "warm_ratio_b5": out["warm_ratio_b5"],
        "rss_total_mb": out["one_rss_mb"],
        "one_pss_mb": out["one_pss_mb"],
        "first_start_s": out["first_start_answer_s"],
        "scan_mcodes_per_core_s": out["scan_mcodes_per_core_s"],
        "index_gb": out["index_gb"],
    }
    print("retriever_scale: " + " ".join(
        f"{k}={v}" if isinstance(v, int) else f"{k}={v:.{1 if v >= 10 else 3}f}" for k, v in line.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
