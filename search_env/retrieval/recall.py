"""Recall of a served (IVF) index against exact search on its Flat index, per nprobe
(`python -m search_env.retrieval recall`; docs/retrieval.md, *Commands*)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from search_env.retrieval.index import DEFAULT_NPROBE, load_index, read_flat

log = logging.getLogger(__name__)

RECALL_SUFFIX = ".recall.json"


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found_i ∩ truth_i| / |truth_i| (ids < 0 ignored)."""
    total = 0.0
    for f, t in zip(found, truth, strict=True):
        t_set = {int(x) for x in t if x >= 0}
        total += len(t_set & {int(x) for x in f if x >= 0}) / max(1, len(t_set))
    return total / max(1, len(truth))


def _drop_self(ids: np.ndarray, query_ids: np.ndarray, k: int) -> np.ndarray:
    """Remove each query's own row from its result list and keep k entries."""
    out = np.full((len(ids), k), -1, dtype=np.int64)
    for i, (row, own) in enumerate(zip(ids, query_ids, strict=True)):
        kept = row[row != own][:k]
        out[i, : len(kept)] = kept
    return out


def measure_recall(
    index_path: str | Path,
    flat_path: str | Path,
    k: int = 10,
    nprobes: list[int] | None = None,
    n_queries: int = 1000,
    seed: int = 0,
    out: str | Path | None = None,
    use_gpu: bool = False,
) -> dict:
    """Recall@k of the index at `index_path` against exact search on `flat_path`, for each nprobe
    (the index on the GPU(s) where it fits when `use_gpu`, as `load_index`).

    Queries are `n_queries` stored vectors sampled at random (seeded); each query's own row is removed
    from both result lists, so recall measures its true neighbours. Writes the report as JSON to `out`
    (default `<index>.recall.json`) and returns it.
    """
    nprobes = nprobes or [DEFAULT_NPROBE]
    flat = read_flat(flat_path)
    loaded = load_index(index_path, nprobe=nprobes[0], use_gpu=use_gpu)
    index = loaded.index
    if index.ntotal != flat.ntotal or index.d != flat.d:
        raise ValueError(
            f"index {index_path} ({index.ntotal} x {index.d}) and flat {flat_path} "
            f"({flat.ntotal} x {flat.d}) do not hold the same vectors"
        )
    rng = np.random.default_rng(seed)
    query_ids = np.sort(rng.choice(flat.ntotal, size=min(n_queries, flat.ntotal), replace=False))
    queries = flat.reconstruct_batch(query_ids.astype(np.int64))
    started = time.perf_counter()
    _, exact = flat.search(queries, k + 1)
    flat_ms = (time.perf_counter() - started) * 1000 / len(queries)
    truth = _drop_self(exact, query_ids, k)
    results = []
    for nprobe in nprobes:
        used = loaded.set_nprobe(nprobe)
        started = time.perf_counter()
        _, found = index.search(queries, k + 1)
        ms = (time.perf_counter() - started) * 1000 / len(queries)
        found = _drop_self(found, query_ids, k)
        results.append(
            {
                "nprobe": used,
                f"recall@{k}": round(recall_at_k(found, truth), 4),
                "top1_agreement": round(float(np.mean(found[:, 0] == truth[:, 0])), 4),
                "ms_per_query_batched": round(ms, 4),
            }
        )
        log.info("nprobe %s: recall@%d %.4f", used, k, results[-1][f"recall@{k}"])
    report = {
        "index": str(index_path),
        "flat": str(flat_path),
        "k": k,
        "n_queries": len(queries),
        "seed": seed,
        "ntotal": int(flat.ntotal),
        "nlist": loaded.nlist,
        "factory": loaded.meta.get("factory"),
        "index_placement": loaded.placement,
        "flat_ms_per_query_batched": round(flat_ms, 4),
        "results": results,
        "queries": "stored vectors sampled at random; each query's own row excluded from both lists",
    }
    out = Path(out) if out is not None else Path(str(index_path) + RECALL_SUFFIX)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report
