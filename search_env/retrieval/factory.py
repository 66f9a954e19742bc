"""Build the retriever that `python -m search_env.retrieval serve` runs, from its parsed arguments.

One function for the server process, its search child process (`worker.ProcessRetriever`, which
needs an importable factory) and bench/retriever.py's in-process bound, so all three get exactly the
same encoder, index and CPU threads. Heavy imports (torch, faiss, bm25s) happen inside.
"""

from __future__ import annotations

import argparse
import os
import sys

from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus

GPU_CHOICES = {"auto": None, "on": True, "true": True, "off": False, "false": False}
"""`--gpu` values; true/false are accepted (any case) so a YAML boolean can be passed through."""


def use_gpu(flag: str) -> bool | None:
    """`--gpu` value -> None (auto), True or False: the encoder's device (None = CUDA when visible)
    and, for build-index / convert-index, whether faiss trains and fills the index on the GPU."""
    return GPU_CHOICES[flag]


def index_on_gpu(flag: str) -> bool:
    """`--gpu` value -> whether `serve` / `recall` try to put the faiss index on the GPU(s): only with
    `on` (evaluation; where it fits, see `index.place_index`). `auto`, the training setting, keeps it
    on CPU beside vLLM and FSDP, as the study did; `off` keeps everything on CPU."""
    return GPU_CHOICES[flag] is True


def set_cpu_threads(threads: int) -> None:
    """Use `threads` CPU threads in torch and faiss (0: leave the defaults). Call before torch or faiss
    is imported: OpenMP reads OMP_NUM_THREADS when it loads, and that is the only setting that also
    reaches faiss calls made from other threads (the server searches in a worker thread)."""
    if threads < 0:
        raise SystemExit(f"--threads must be >= 0 (0 = library default), got {threads}")
    if threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:  # already loaded (e.g. by a caller): its intra-op pool too
            sys.modules["torch"].set_num_threads(threads)


def build_retriever(args: argparse.Namespace) -> Retriever:
    """The `Retriever` that `serve` runs for parsed `serve` arguments (also used by
    bench/retriever.py, so its in-process bound has exactly the server's encoder, index and threads).
    Sets the CPU threads first (see `set_cpu_threads`)."""
    set_cpu_threads(args.threads)

    corpus = Corpus(args.corpus)
    if args.backend == "bm25":
        from search_env.retrieval.bm25 import BM25Retriever  # heavy: bm25s, only for --backend bm25

        if args.bm25_index is not None and (args.bm25_index / "params.index.json").is_file():
            return BM25Retriever.load(args.bm25_index, corpus)
        retriever = BM25Retriever.build(corpus, show_progress=len(corpus) > 100_000)
        if args.bm25_index is not None:
            retriever.save(args.bm25_index)
        return retriever
    if args.index is None or args.encoder is None:
        raise SystemExit(
            "serve --backend dense needs --index PATH and --encoder PATH "
            "(build an index with `python -m search_env.retrieval build-index`)"
        )
    from search_env.retrieval.encoder import Encoder  # heavy: torch/transformers, only for --backend dense
    from search_env.retrieval.index import (  # heavy: faiss, only for --backend dense
        DenseRetriever,
        load_index,
    )

    loaded = load_index(  # first: a missing index fails before the encoder is loaded
        args.index, nprobe=args.nprobe, use_gpu=index_on_gpu(args.gpu), mmap=args.index_load == "mmap"
    )
    encoder = Encoder(args.encoder, use_gpu=use_gpu(args.gpu), query_max_length=args.query_max_length)
    return DenseRetriever(corpus, encoder, loaded)
