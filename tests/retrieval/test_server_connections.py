"""The retrieval server's connection limits against abusive sockets (security review 3 N1, N2, N4):
a real `python -m search_env.retrieval serve` child on loopback with small caps and short deadlines
(`limits.Limits` fields as flags), raw sockets bound to distinct 127.0.0.0/8 source addresses so the
per-address cap is exercised. Every wait is bounded by `WAIT_S` (never a timing assertion)."""

from __future__ import annotations

import json
import resource
import select
import socket
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.connections import (
    HEAD_DEADLINE_SPREAD,
    OTHER_FILES,
    REFUSAL_HOLD_SPREAD,
    open_files_needed,
    open_files_target,
    spread_s,
)
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.limits import Limits, add_flags, from_args
from search_env.retrieval.process import spawn_server

WAIT_S = 30.0
PER_CLIENT = 4
TOTAL = 16
HOLD_S = 5.0
"""--refusal-hold-s of the module's server (each hold 2.5-5 s): far longer than the moments the test
checks a held socket has been sent nothing (a slow machine only makes the answer later, never sooner)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    serve = ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS), "--max-connections", str(TOTAL)]
    serve += ["--max-connections-per-client", str(PER_CLIENT), "--header-timeout-s", "1"]
    serve += ["--refusal-hold-s", str(HOLD_S)]
    serve += ["--write-timeout-s", "1", "--body-timeout-s", "60", "--max-refusal-rate", "0"]
    with spawn_server(serve, startup_timeout_s=60, log_path=log) as running:
        yield running


def _connect(url: str, source: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(WAIT_S)
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    return sock


def _closed_by_server(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _healthy(url: str) -> None:
    """/health answers 200 (within `WAIT_S`: retried while earlier tests' sockets close)."""
    deadline = time.monotonic() + WAIT_S
    while httpx.get(f"{url}/health", timeout=WAIT_S).status_code != 200:
        assert time.monotonic() < deadline, "/health never answered 200"
        time.sleep(0.05)


def _answered_yet(socks: list[socket.socket]) -> list[socket.socket]:
    """Those of ``socks`` the server has sent something on, or closed (one 0.2 s look at all)."""
    readable, _, _ = select.select(socks, [], [], 0.2)
    return readable


@pytest.mark.slow
def test_idle_sockets_from_one_address_leave_another_served(server) -> None:
    """N1: idle sockets past --max-connections-per-client are held unread for --refusal-hold-s
    (at most --max-connections of them; those past that are answered at once), then get a 503
    naming the flag and are closed; another address is still served; the admitted idle ones are
    closed at --header-timeout-s."""
    admitted = [_connect(server.url, "127.0.0.2") for _ in range(PER_CLIENT)]
    held = [_connect(server.url, "127.0.0.2") for _ in range(TOTAL)]
    past = [_connect(server.url, "127.0.0.2") for _ in range(2)]
    try:
        answers = [_closed_by_server(sock) for sock in past]  # past the held bound: at once
        assert all(b"503" in a.split(b"\r\n")[0] and b"--max-connections-per-client" in a for a in answers)
        assert not _answered_yet(held), "a refused socket was answered before its hold ended"
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200
        assert [_closed_by_server(sock) for sock in admitted] == [b""] * PER_CLIENT  # head deadline
        answers = [_closed_by_server(sock) for sock in held]  # at the end of their hold
        assert all(b"503" in a.split(b"\r\n")[0] and b"--max-connections-per-client" in a for a in answers)
    finally:
        for sock in admitted + held + past:
            sock.close()


def test_a_trickled_request_head_is_cut_at_the_header_deadline(server) -> None:
    """N1: a head sent one header line at a time never completes; the server closes it."""
    with _connect(server.url, "127.0.0.3") as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(0.2)
        closed = False
        for i in range(int(WAIT_S / 0.2)):
            try:
                sock.sendall(f"X-Trickle-{i}: {i}\r\n".encode())
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        assert closed, "a trickled head kept its connection open"
    _healthy(server.url)


def test_a_head_past_the_bound_is_answered_431_naming_the_flag(server) -> None:
    """h11 stops reading an unfinished head at --max-header-bytes (16 KiB): 20 KiB of head without
    its end get a 431 naming the flag, then the connection is closed; a malformed small head still
    gets uvicorn's 400."""
    with _connect(server.url, "127.0.0.4") as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000)
        answer = _closed_by_server(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"--max-header-bytes" in answer
    with _connect(server.url, "127.0.0.4") as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nbad header line\r\n\r\n")
        assert _closed_by_server(sock).startswith(b"HTTP/1.1 400 "), "a malformed head is a 400"
    _healthy(server.url)


def test_a_huge_header_line_is_cut_off_early(server) -> None:
    """N2: h11 bounds the head at --max-header-bytes (16 KiB), so a never-ending header line is
    answered and closed long before 8 MiB are sent."""
    with _connect(server.url, "127.0.0.4") as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent = 0
        try:
            while sent < 8 * 2**20:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _closed_by_server(sock)
    assert sent < 8 * 2**20 or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    _healthy(server.url)


@pytest.mark.slow
def test_a_client_that_never_reads_is_cut_off_at_the_write_deadline(server) -> None:
    """N4: pipelined requests for large answers from a socket that never reads: the server aborts
    the connection at --write-timeout-s instead of holding the answers."""
    corpus = Corpus(SAMPLE_CORPUS)
    queries = [corpus.row(i)["contents"][:300] for i in range(81)]  # many shared terms: 100 hits each
    body = json.dumps({"queries": queries, "topk": 100}).encode()
    head = f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    one = httpx.post(f"{server.url}/retrieve", content=body, headers={"Content-Type": "application/json"})
    assert one.status_code == 200 and len(one.content) > 2**20  # each answer is megabytes
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT_S)
    sock.bind(("127.0.0.5", 0))
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with sock:
        sock.connect((host, int(port)))
        sock.sendall((head.encode() + body) * 4)
        deadline = time.monotonic() + WAIT_S
        while httpx.get(f"{server.url}/health", timeout=WAIT_S).json()["queries_served"] < 81 + 81:
            assert time.monotonic() < deadline, "the first pipelined request was never answered"
            time.sleep(0.05)
        time.sleep(3.0)  # never read meanwhile: past the 1 s write deadline
        received = _closed_by_server(sock)
    assert len(received) < len(one.content), "the whole answer was held for a client that never read"
    _healthy(server.url)


def test_past_max_connections_from_several_addresses_new_requests_get_503(server) -> None:
    """The global cap still holds (uvicorn's limit_concurrency): connections held by half-sent bodies
    from four addresses fill it; a fifth address gets 503 until they close."""
    head = b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    held = []
    try:
        for k in range(TOTAL // PER_CLIENT):
            for _ in range(PER_CLIENT):
                sock = _connect(server.url, f"127.0.1.{k + 1}")
                sock.sendall(head + b'{"queries"')
                held.append(sock)
        deadline = time.monotonic() + WAIT_S
        while httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code != 503:
            assert time.monotonic() < deadline, "/health never answered 503"
            time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
    _healthy(server.url)


def test_every_limit_is_one_flag_with_its_default_and_bad_values_name_the_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("all")
    add_flags({"address, batching and query cache": group, "limits and authentication": group})
    assert from_args(parser.parse_args([])) == Limits()
    assert from_args(parser.parse_args(["--header-timeout-s", "0.5"])).header_timeout_s == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-connections-per-client", "0"])
    with pytest.raises(ValueError, match="--max-connections-per-client 8 must be below --max-connections 8"):
        Limits(max_connections=8, max_connections_per_client=8)
    with pytest.raises(ValueError, match="--write-timeout-s must be > 0"):
        Limits(write_timeout_s=0)


@given(
    limit_s=st.floats(0.01, 3600),
    draw=st.floats(0.0, 1.0, exclude_max=True),
    spread=st.sampled_from([HEAD_DEADLINE_SPREAD, REFUSAL_HOLD_SPREAD]),
)
def test_deadlines_and_holds_are_spread_below_the_flag_never_past_it(
    limit_s: float, draw: float, spread: float
) -> None:
    """Connections opened together close (or are answered) over [(1 - spread) x T, T], never after
    the flag's T (--header-timeout-s, --refusal-hold-s)."""
    deadline = spread_s(limit_s, draw, spread)
    assert (1 - spread) * limit_s - 1e-9 <= deadline <= limit_s
    assert spread_s(limit_s, 0.0, spread) == limit_s


def test_the_open_files_limit_is_raised_to_what_the_limits_need_up_to_the_hard_one() -> None:
    """Admitted sockets, as many held refusals and the server's own files: a soft limit of 1,024
    (many clusters' default) would stop the default server accepting at ~1,000 sockets."""
    limits = Limits()
    needed = open_files_needed(limits)
    assert needed == 2 * limits.max_connections + OTHER_FILES
    assert open_files_needed(Limits(refusal_hold_s=0)) == limits.max_connections + OTHER_FILES
    assert open_files_target(1024, 1 << 20, needed) == needed
    assert open_files_target(1024, 2048, needed) == 2048  # as far as the hard limit allows
    assert open_files_target(1024, resource.RLIM_INFINITY, needed) == needed
    assert open_files_target(1 << 20, 1 << 20, needed) == 1 << 20  # never lowered
    assert open_files_target(resource.RLIM_INFINITY, resource.RLIM_INFINITY, needed) == resource.RLIM_INFINITY
