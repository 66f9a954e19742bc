"""The retrieval server's settings and limits, declared once: `Limits` is read by `create_app`, by
`serve` and by the command line, whose `serve` flags are generated from its fields (`add_flags`:
flag name, type, help and default all come from the field). Mechanisms: docs/retrieval.md
("Limits and authentication"), docs/security.md.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, dataclass, field, fields

from search_env.protocol import TOPK

MAX_QUERIES = 4096
"""Most queries in one request body (a model bound, before --max-hits)."""
MAX_TOPK = 100
RETRY_AFTER_S = 1
"""`Retry-After` of a 429 (seconds); a request past --max-queued-per-client waits this long for room
before its 429, so a client that retries at once is not answered in a busy loop."""

BATCHING = "address, batching and query cache"
LIMITS = "limits and authentication"
"""The `serve` help sections a field's flag is listed in."""


def _setting(default: float, help: str, group: str = LIMITS, zero: bool = False) -> float:
    """A `Limits` field: its default, the flag's help (the default is appended), its help section,
    and whether 0 is allowed (otherwise it must be > 0)."""
    return field(default=default, metadata={"help": help, "group": group, "zero": zero})


def flag(name: str) -> str:
    """The command-line flag of field `name` (`max_hits` -> `--max-hits`)."""
    return "--" + name.replace("_", "-")


def _check(item: Field, value: float) -> None:
    zero = item.metadata["zero"]
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{flag(item.name)} must be {'>=' if zero else '>'} 0, got {value:g}")


@dataclass(frozen=True)
class Limits:
    """Every number the server runs by (one field per `serve` flag; see each field's help)."""

    topk: int = _setting(TOPK, "topk when a request omits it (the protocol's)", BATCHING)
    max_batch: int = _setting(256, "most queries per backend call; 1 = no micro-batching", BATCHING)
    max_wait_ms: float = _setting(2.0, "how long a non-full batch waits for more requests", BATCHING, True)
    cache_size: int = _setting(
        65536,
        "query cache: most (client, query, topk) answers kept, least recently used evicted first; 0 = off",
        BATCHING,
        True,
    )
    cache_max_mb: float = _setting(
        256.0, "query cache: memory bound in MiB (estimated bytes of the cached passages)", BATCHING
    )
    stats_interval_s: float = _setting(
        60.0, "log queries, cache hit rate and batches every this many seconds (0 = never)", BATCHING, True
    )
    max_body_bytes: int = _setting(
        1024 * 1024,
        "largest request body; larger gets 413 (1 MiB: a Search-R1 batch of 512 short queries is ~0.5 MB, "
        "256 queries of --max-query-chars fit)",
    )
    max_query_chars: int = _setting(4096, "most characters per query; longer gets 422")
    max_hits: int = _setting(
        8192,
        "most queries x topk per request, which bounds the answer's size (~0.7 KB a wiki-18 passage); more "
        "gets 422 (a Search-R1 batch of 512 queries x topk 3 passes)",
    )
    max_queued_queries: int = _setting(
        16384,
        "most queries waiting for a search or a cache look-up; a request that would pass it gets 429 with "
        "Retry-After",
    )
    max_queued_per_client: int = _setting(
        1024,
        "most queries of one client (a token of --auth-token-file, else an IP address) waiting for a "
        "search or a cache look-up; its request that would pass it gets 429 with Retry-After, other "
        "clients are still admitted (one training node's 512 concurrent one-query rollouts pass twice)",
    )
    fair_batch_ms: float = _setting(
        5.0,
        "while several clients are active, the most estimated search time of one batch (ms), filled from "
        "the least recently served clients first, so a light client's request waits about two such "
        "batches behind a heavy one's backlog; one client alone gets full batches",
    )
    max_refusal_rate: float = _setting(
        10.0,
        "4xx answers per second to one client address (after a 2 s burst) before each further one is held "
        "up to 1 s, so a client repeating bad requests cannot busy the server (0 = off)",
        zero=True,
    )
    max_connections: int = _setting(
        1024, "most open connections or requests in flight (uvicorn's limit_concurrency); past it 503"
    )
    max_connections_per_client: int = _setting(
        512,
        "most open connections from one IP address, below --max-connections so one address never takes "
        "them all; a further connection from it is closed at once",
    )
    refusal_hold_s: float = _setting(
        2.0,
        "seconds a connection past --max-connections-per-client is held, unread, before its 503 and "
        "close (each drawn from half this to this, so sockets refused together are not answered in one "
        "burst; at most --max-connections held at once, then answered at once), so a client reopening "
        "refused sockets makes the server accept and refuse one per socket per hold, not in a busy loop "
        "(0 = answer at once)",
        zero=True,
    )
    header_timeout_s: float = _setting(
        10.0,
        "seconds a connection may take to send a complete request head, from its opening or the end of "
        "its last answer; later it is closed",
    )
    keep_alive_timeout_s: float = _setting(
        5.0, "seconds an idle keep-alive connection is kept open (uvicorn's timeout_keep_alive)"
    )
    max_header_bytes: int = _setting(
        16384,
        "largest request head (h11's max_incomplete_event_size); a larger one gets 431 and the "
        "connection is closed",
    )
    body_timeout_s: float = _setting(
        10.0, "seconds a request body may take to arrive; later gets 408 and the connection is closed"
    )
    write_timeout_s: float = _setting(
        10.0,
        "seconds an answer's unsent bytes may stay above the socket's write buffer mark without the "
        "client reading; then the connection is aborted and the answer dropped",
    )
    max_answer_mb_per_client: float = _setting(
        16.0,
        "MiB of one client's answers built but not yet handed to its sockets; its next answer is built "
        "(one at a time per client) only below it",
    )
    max_answer_mb_per_s_per_client: float = _setting(
        32.0,
        "MiB a second of one client's answers, after a burst of --max-answer-mb-per-client: its next "
        "answer is built once the earlier ones are paid for at this rate, so a client re-asking large "
        "cached answers cannot keep the server joining and sending them (0 = off; a training node's "
        "top-5 searches need well under 10)",
        zero=True,
    )

    def __post_init__(self) -> None:
        for item in fields(self):
            _check(item, getattr(self, item.name))
        if self.max_connections_per_client >= self.max_connections:
            raise ValueError(
                f"--max-connections-per-client {self.max_connections_per_client} must be below "
                f"--max-connections {self.max_connections}, so one address cannot take every connection; "
                "lower --max-connections-per-client too"
            )
        if self.topk > MAX_TOPK:
            raise ValueError(f"--topk must be in 1..{MAX_TOPK}, got {self.topk}")


def _parser(item: Field) -> object:
    kind = type(item.default)

    def parse(text: str) -> object:
        try:
            value = kind(text)
            _check(item, value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{flag(item.name)} ")) from None
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own errors
    return parse


def _shown(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """One flag per `Limits` field, in the help section `groups[field's group]`."""
    for item in fields(Limits):
        assert item.default is not MISSING
        groups[item.metadata["group"]].add_argument(
            flag(item.name),
            type=_parser(item),
            default=item.default,
            help=f"{item.metadata['help']} (default {_shown(item.default)})".replace("%", "%%"),
        )


def from_args(args: argparse.Namespace) -> Limits:
    """The `Limits` of parsed `serve` flags (ValueError naming the flag when they disagree)."""
    return Limits(**{item.name: getattr(args, item.name) for item in fields(Limits)})
