"""Command line of the retrieval service.

    python -m search_env.retrieval serve --backend bm25|dense [--corpus PATH] [--index PATH --encoder PATH]
    python -m search_env.retrieval build-index --corpus PATH --encoder PATH --out PATH [--factory F] [--force]
    python -m search_env.retrieval convert-index --flat PATH --out PATH [--factory IVF4096,SQ8] [--force]
    python -m search_env.retrieval recall --index PATH --flat PATH [--k 10] [--nprobe 16,64,256]
    python -m search_env.retrieval probe URL [--timeout S] [--require-hits] [--auth-token-file PATH]

Heavy imports (torch, faiss) happen inside the subcommands, so `serve --backend bm25` starts fast.
`probe` exits 0 once URL answers GET /health and one real POST /retrieve, else 1 with the reason.
See docs/retrieval.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from search_env.retrieval import DEFAULT_NPROBE, SAMPLE_CORPUS
from search_env.retrieval.admission import is_loopback
from search_env.retrieval.auth import AuthFileError, load_tokens
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.factory import GPU_CHOICES, build_retriever, index_on_gpu, use_gpu
from search_env.retrieval.limits import BATCHING, LIMITS, add_flags, from_args
from search_env.retrieval.prewarm import Prewarm, want_prewarm
from search_env.retrieval.probe import ProbeError, probe
from search_env.retrieval.server import create_app, serve
from search_env.retrieval.worker import ProcessRetriever

DEFAULT_FACTORY = "IVF4096,SQ8"


def _gpu_choice(text: str) -> str:
    value = text.strip().lower()
    if value not in GPU_CHOICES:
        raise argparse.ArgumentTypeError(f"expected auto, on or off (or true/false), got {text!r}")
    return value


GPU_HELP = {
    "serve": "auto (default, training): the encoder on CUDA when visible, the faiss index on CPU; on "
    "(evaluation; also true): the encoder on CUDA (an error without it) and the index on the GPU(s) "
    "where it fits in free memory, else on CPU with a warning; off (also false): all on CPU",
    "build": "use CUDA for the encoder and GPU faiss for training and adding when available (auto), "
    "always (on; also true: an error without them) or never (off; also false)",
    "recall": "on (also true): the index under test on the GPU(s) where it fits, else CPU with a "
    "warning; auto / off (also false): on CPU",
}
"""`--gpu` help per kind of subcommand (see search_env.retrieval.factory)."""


def _check_out(args: argparse.Namespace) -> None:
    """An existing --out is refused unless --force (before any corpus, encoder or index is read)."""
    if args.out.exists() and not args.force:
        raise ValueError(f"--out {args.out} exists. Fix: --force to replace it, or another --out")


def _gpu_flag(parser: argparse._ActionsContainer, kind: str) -> None:
    parser.add_argument(
        "--gpu", type=_gpu_choice, default="auto", metavar="{auto,on,off}", help=GPU_HELP[kind]
    )


def _positive(kind: type, zero: bool = False) -> object:
    """An argparse type: `kind` > 0 (`zero`: >= 0)."""

    def parse(text: str) -> object:
        value = kind(text)
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero else '>'} 0, got {text}")
        return value

    return parse


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the HTTP retrieval server")
    _serve_backend_flags(serve.add_argument_group("backend"))
    address = serve.add_argument_group(BATCHING)
    address.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1); another than loopback needs --auth-token-file",
    )
    address.add_argument("--port", type=int, default=8000)
    limits = serve.add_argument_group(LIMITS)
    add_flags({BATCHING: address, LIMITS: limits})
    limits.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="file of bearer tokens, one per line, mode 600: every POST must send `Authorization: Bearer "
        "<token>` (401 otherwise); required to bind a non-loopback --host (docs/security.md)",
    )
    limits.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback --host without --auth-token-file (anyone who reaches the port can "
        "search and shape the passages a training run reads)",
    )


def _serve_backend_flags(group: argparse._ArgumentGroup) -> None:
    """What `serve` searches and where: backend, corpus, index, encoder, threads, search process."""
    group.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    group.add_argument(
        "--corpus",
        type=Path,
        default=SAMPLE_CORPUS,
        help="wiki-18 style jsonl (default: the bundled 1,000-passage demo sample)",
    )
    group.add_argument(
        "--bm25-index",
        type=Path,
        default=None,
        help="bm25: directory of a saved bm25s index; built from the corpus and saved there if absent",
    )
    group.add_argument(
        "--index", type=Path, default=None, help="dense: faiss index file (row i = corpus row i)"
    )
    group.add_argument("--encoder", default=None, help="dense: HF model directory (e.g. e5-base-v2)")
    group.add_argument(
        "--nprobe",
        type=_positive(int),
        default=DEFAULT_NPROBE,
        help=f"dense IVF: inverted lists probed per query (default {DEFAULT_NPROBE})",
    )
    group.add_argument(
        "--query-max-length", type=_positive(int), default=256, help="dense: query tokens (default 256)"
    )
    group.add_argument(
        "--index-load",
        choices=["mmap", "read"],
        default="mmap",
        help="dense: memory-map the faiss index (ready in seconds, pages shared between processes; "
        "default) or read it all into RAM first",
    )
    group.add_argument(
        "--prewarm",
        choices=["auto", "on", "off"],
        default="auto",
        help="dense, memory-mapped index: read the index file once in the background while the server "
        "answers, so the first queries do not each wait for disk (auto, default: when the file fits "
        "in 90%% of the available RAM)",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for the encoder (torch) and faiss search; 0 = the libraries' default (all "
        "cores). On a CPU box shared with the clients, fewer threads than cores can be much faster "
        "(see docs/retrieval.md)",
    )
    group.add_argument(
        "--search-process",
        choices=["on", "off"],
        default="on",
        help="run encode + index search in a child process (on, default: the HTTP event loop never "
        "competes with the encoder for the GIL) or in a thread of the server process (off)",
    )
    _gpu_flag(group, "serve")


def _index_layout_flags(parser: argparse.ArgumentParser, rows: str, chunk_size: int, chunk_help: str) -> None:
    """The flags build-index and convert-index share: the index written (--out, --factory, --force),
    its training sample of `rows`, `chunk_size` rows per add(), where its lists are built, --gpu."""
    parser.add_argument("--out", type=Path, required=True, help="index file to write")
    parser.add_argument(
        "--factory", default=DEFAULT_FACTORY, help=f"faiss factory string (default {DEFAULT_FACTORY})"
    )
    parser.add_argument(
        "--train-size",
        type=_positive(int),
        default=None,
        help=f"{rows} sampled for k-means/SQ training (default min(N, 256 x nlist))",
    )
    parser.add_argument("--chunk-size", type=_positive(int), default=chunk_size, help=chunk_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ondisk",
        choices=["auto", "on", "off"],
        default="auto",
        help="build the IVF inverted lists in chunk shards on disk and merge them into the index file "
        "(on), in RAM (off), or on disk only when the index would not fit in RAM (auto, default)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out (the old index stays whole until the new one is renamed in)",
    )
    _gpu_flag(parser, "build")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m search_env.retrieval", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)

    build = sub.add_parser("build-index", help="embed a corpus and build a faiss index")
    build.add_argument("--corpus", type=Path, required=True)
    build.add_argument(
        "--encoder", required=True, help="HF model directory (E5 prefixes when the name contains e5)"
    )
    build.add_argument("--batch-size", type=_positive(int), default=256, help="passages per encoder forward")
    build.add_argument("--passage-max-length", type=_positive(int), default=256)
    _index_layout_flags(build, "passages", 65536, "passages embedded per add()")

    convert = sub.add_parser("convert-index", help="re-pack an existing Flat index (no re-embedding)")
    convert.add_argument(
        "--flat", type=Path, required=True, help="existing IndexFlatIP file (e.g. e5_Flat.index)"
    )
    _index_layout_flags(convert, "vectors", 1_000_000, "vectors per add()")

    recall = sub.add_parser("recall", help="recall@k of an (IVF) index against its Flat index")
    recall.add_argument("--index", type=Path, required=True)
    recall.add_argument("--flat", type=Path, required=True)
    recall.add_argument("--k", type=_positive(int), default=10)
    recall.add_argument("--nprobe", default=f"16,{DEFAULT_NPROBE},256", help="comma-separated nprobe values")
    recall.add_argument(
        "--queries",
        type=_positive(int),
        default=1000,
        help="number of stored vectors sampled as queries (default 1000)",
    )
    recall.add_argument("--seed", type=int, default=0)
    recall.add_argument("--out", type=Path, default=None, help="JSON report (default <index>.recall.json)")
    _gpu_flag(recall, "recall")

    check = sub.add_parser("probe", help="exit 0 once a server answers /health and one real /retrieve")
    check.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    check.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for GET /health (default 30)"
    )
    check.add_argument(
        "--require-hits", action="store_true", help="fail when the test search returns no passage"
    )
    check.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="the server's bearer-token file (mode 600), sent with both requests",
    )
    return parser


def serve_auth(args: argparse.Namespace) -> list[str] | None:
    """The bearer tokens of `serve` (None = no auth); SystemExit naming the flag when the token file
    is unusable (e.g. readable by group or others: `chmod 600`), or when a non-loopback --host has
    no token file and no --insecure-no-auth."""
    tokens = None
    if args.auth_token_file is not None:
        try:
            tokens = load_tokens(args.auth_token_file)
        except AuthFileError as err:
            raise SystemExit(f"--auth-token-file: {err}") from None
    if tokens is None and not is_loopback(args.host):
        if not args.insecure_no_auth:
            raise SystemExit(
                f"--host {args.host} is reachable from other machines and the server has no "
                "--auth-token-file: anyone reaching the port could search and shape the passages a "
                "training run reads. Pass --auth-token-file PATH (a mode-600 file of tokens; "
                "docs/security.md), bind 127.0.0.1, or accept the risk with --insecure-no-auth"
            )
        logging.getLogger(__name__).warning(
            "retrieval server binds %s without authentication (--insecure-no-auth)", args.host
        )
    return tokens


def cmd_serve(args: argparse.Namespace) -> None:
    limits = from_args(args)
    tokens = serve_auth(args)
    prewarm = None
    if (
        args.backend == "dense"
        and args.index_load == "mmap"
        and args.index is not None
        and args.index.is_file()
    ):
        prewarm = Prewarm(args.index, *want_prewarm(args.prewarm, args.index))
    if args.search_process == "on":
        retriever = ProcessRetriever(build_retriever, (args,), str(args.corpus))
    else:
        retriever = build_retriever(args)
    if prewarm is not None:  # after the boot, whose own reads (libraries, encoder) it would slow
        prewarm.start()
    app = create_app(retriever, limits, prewarm=prewarm, auth_tokens=tokens, loopback=is_loopback(args.host))
    logging.getLogger(__name__).info(
        "serving %s retriever over %d passages on http://%s:%d (query cache %s, %s)",
        args.backend,
        len(retriever.corpus),
        args.host,
        args.port,
        f"{limits.cache_size} entries / {limits.cache_max_mb:g} MiB" if limits.cache_size else "off",
        f"bearer tokens from {args.auth_token_file}" if tokens else "no auth",
    )
    serve(app, host=args.host, port=args.port)


def _index_options(args: argparse.Namespace) -> dict:
    """The index-layout flags that build-index and convert-index share."""
    return {
        "factory": args.factory,
        "train_size": args.train_size,
        "chunk_size": args.chunk_size,
        "seed": args.seed,
        "use_gpu": use_gpu(args.gpu),
        "ondisk": {"auto": None, "on": True, "off": False}[args.ondisk],
    }


def cmd_build_index(args: argparse.Namespace) -> None:
    from search_env.retrieval.encoder import Encoder  # heavy: torch/transformers, only for build-index
    from search_env.retrieval.index_build import build_index  # heavy: faiss, only the index commands

    _check_out(args)
    encoder = Encoder(
        args.encoder,
        use_gpu=use_gpu(args.gpu),
        batch_size=args.batch_size,
        passage_max_length=args.passage_max_length,
    )
    build_index(Corpus(args.corpus), encoder, args.out, **_index_options(args))


def cmd_convert_index(args: argparse.Namespace) -> None:
    from search_env.retrieval.index_build import convert_index  # heavy: faiss, only the index commands

    _check_out(args)
    convert_index(args.flat, args.out, **_index_options(args))


def cmd_recall(args: argparse.Namespace) -> None:
    from search_env.retrieval.recall import measure_recall  # heavy: faiss, only the index commands

    try:
        nprobes = [int(x) for x in args.nprobe.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--nprobe: expected comma-separated integers, got {args.nprobe!r}") from None
    report = measure_recall(
        args.index,
        args.flat,
        k=args.k,
        nprobes=nprobes,
        n_queries=args.queries,
        seed=args.seed,
        out=args.out,
        use_gpu=index_on_gpu(args.gpu),
    )
    print(json.dumps(report, indent=2))


def cmd_probe(args: argparse.Namespace) -> None:
    try:
        health = probe(
            args.url,
            health_timeout_s=args.timeout,
            require_hits=args.require_hits,
            auth_token_file=args.auth_token_file,
        )
    except ProbeError as err:
        raise SystemExit(f"probe: {err}") from None
    print(
        f"{args.url.rstrip('/')}: healthy ({health.get('backend', 'unknown')} backend), one real /retrieve answered"
    )


COMMANDS = {
    "serve": cmd_serve,
    "build-index": cmd_build_index,
    "convert-index": cmd_convert_index,
    "recall": cmd_recall,
    "probe": cmd_probe,
}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every stop-word-only query at INFO
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # CPU-feature probing noise
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request (probe)
    try:
        COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
