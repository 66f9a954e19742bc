"""tests/heavy_slot.py: at most RLVR_HEAVY_SLOTS heavy commands at once, each holding its slot
until it and its children exit; a bad slot count is named. And conftest's helpers for those runs:
the scheduling of their files, ``searches_waiting`` (when the fault tests kill the retriever)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import searches_waiting
from heavy_slot import slot_count

SLOT = Path(__file__).with_name("heavy_slot.py")
HOLD_S = 2.0
"""How long each test command holds its slot."""


def _start(tmp_path: Path, name: str, slots: int, *flags: str) -> subprocess.Popen:
    """A command that records when it starts, holds its slot HOLD_S (in a child), and exits; its file
    holds the start, and after a space the end, in ``time.monotonic()`` seconds."""
    path = str(tmp_path / name)
    script = (
        f"import time; f = open({path!r}, 'w'); f.write(str(time.monotonic())); f.flush(); "
        f"time.sleep({HOLD_S}); f.write(' ' + str(time.monotonic()))"
    )
    env = {**os.environ, "RLVR_HEAVY_SLOTS": str(slots), "RLVR_HEAVY_LOCK_DIR": str(tmp_path)}
    cmd = [sys.executable, str(SLOT), *flags, "bash", "-c", f'{sys.executable} -c "{script}"']
    return subprocess.Popen(cmd, env=env)


def _spans(tmp_path: Path, names: list[str]) -> dict[str, tuple[float, float]]:
    """Per command: (start, end) in monotonic seconds."""
    return {name: tuple(map(float, (tmp_path / name).read_text().split())) for name in names}


@pytest.mark.slow
def test_a_third_command_waits_for_one_of_two_slots(tmp_path):
    procs = [_start(tmp_path, f"started{i}", slots=2) for i in range(3)]
    for proc in procs:
        assert proc.wait(timeout=30) == 0
    starts = sorted(start for start, _ in _spans(tmp_path, [f"started{i}" for i in range(3)]).values())
    assert starts[1] - starts[0] < HOLD_S * 2 / 3  # two ran together
    assert starts[2] - starts[0] >= HOLD_S - 0.1  # the third waited until one had exited (its child too)


@pytest.mark.slow
def test_an_exclusive_command_runs_alone(tmp_path):
    first = _start(tmp_path, "first", 2)
    time.sleep(HOLD_S / 3)  # the first holds one slot; the exclusive one must wait for it
    exclusive = _start(tmp_path, "exclusive", 2, "--all")
    time.sleep(HOLD_S / 3)
    others = [_start(tmp_path, f"other{i}", 2) for i in range(2)]  # started while it waits or runs
    for proc in (first, exclusive, *others):
        assert proc.wait(timeout=30) == 0
    spans = _spans(tmp_path, ["first", "exclusive", "other0", "other1"])
    start, end = spans.pop("exclusive")
    for name, (other_start, other_end) in spans.items():
        assert other_end <= start or other_start >= end, f"{name} ran beside the exclusive command"


def test_a_bad_slot_count_names_the_variable():
    with pytest.raises(ValueError, match="RLVR_HEAVY_SLOTS must be a whole number >= 1, got '0'"):
        slot_count({"RLVR_HEAVY_SLOTS": "0"})
    assert slot_count({}) == 2


def test_the_files_that_hold_every_slot_are_one_unit_of_work_for_the_workers():
    """``make test``'s scheduler (tests/conftest.py): loadfile, but the every-slot files together."""
    from types import SimpleNamespace

    import conftest

    options = {"dist": "loadfile", "tx": ["2*popen"]}
    config = SimpleNamespace(getvalue=options.get, rootpath=conftest.TESTS.parent)
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    units = {scheduler._split_scope(f"tests/{name}::test_x") for name in conftest.EXCLUSIVE_FILES}
    assert units == {conftest.EXCLUSIVE_UNIT}
    assert scheduler._split_scope("tests/e2e/test_demo_e2e.py::test_x") == "tests/e2e/test_demo_e2e.py"
    options["dist"] = "load"
    assert conftest.pytest_xdist_make_scheduler(config, None) is None  # xdist's own


class _Worker:
    """What xdist's scheduler calls on a worker: the test indices it is sent, and its shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_worker_is_handed_a_file_only_when_it_holds_one_test():
    """A worker runs a test once it holds the next one. Holding up to two (xdist's rule), the worker
    that ran the demo file also queued the faults and judge files while the other ran out of files;
    here it gets the next file only when down to one test, and shuts down when none is left."""
    from types import SimpleNamespace

    import conftest

    options = {"dist": "loadfile", "tx": ["2*popen"]}
    config = SimpleNamespace(
        getvalue=options.get, rootpath=conftest.TESTS.parent, option=SimpleNamespace(loadscopereorder=False)
    )
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    tests = ["a.py::1", "a.py::2", "a.py::3", "b.py::1", "c.py::1", "d.py::1"]
    first, second = _Worker("gw0"), _Worker("gw1")
    for worker in (first, second):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, tests)
    scheduler.schedule()
    assert [tests[i] for i in first.sent] == ["a.py::1", "a.py::2", "a.py::3"]  # three: no second file
    assert [tests[i] for i in second.sent] == ["b.py::1", "c.py::1"]  # one test: the next file too
    scheduler.mark_test_complete(first, 0)
    assert len(first.sent) == 3, "handed a file while it still held two tests"
    scheduler.mark_test_complete(first, 1)
    assert [tests[i] for i in first.sent[3:]] == ["d.py::1"]
    scheduler.mark_test_complete(second, 3)
    assert second.shutting_down  # nothing left to hand out


def test_a_request_waiting_unread_is_seen_and_an_idle_port_is_not() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        assert not searches_waiting(port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            assert searches_waiting(port)  # in the accept backlog
            conn, _ = server.accept()
            with conn:
                assert not searches_waiting(port)  # accepted, nothing sent
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            conn, _ = server.accept()
            with conn:
                client.sendall(b"POST /retrieve HTTP/1.1\r\n\r\n")
                assert searches_waiting(port)  # sent, not read
                conn.recv(1024)
                assert not searches_waiting(port)
