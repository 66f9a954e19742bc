"""study/retrievers.py: published retriever files (atomic, sorted, checked) and ``serve_here``, a
real BM25 retriever on loopback with a bearer token, published while healthy and unpublished when
SIGTERM stops it (docs/cluster.md)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import port_free, token_file

from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.probe import search_once
from search_env.retrieval.process import free_port
from study import retrievers
from study.spec import StudyError, load_study
from study.store import layout

START_S = 90.0


def test_published_files_are_written_whole_and_read_sorted(tmp_path):
    assert retrievers.published_urls(tmp_path) == []
    b = retrievers.publish(tmp_path, "http://10.0.0.2:8000", pid=7, started=1.5)
    a = retrievers.publish(tmp_path, "http://10.0.0.1:8001/")
    assert b == tmp_path / "retrievers" / "10.0.0.2_8000.json"
    assert json.loads(b.read_text()) == {
        "host": "10.0.0.2",
        "pid": 7,
        "port": 8000,
        "started": 1.5,
        "url": "http://10.0.0.2:8000",
    }
    assert a.name == "10.0.0.1_8001.json"
    assert sorted(p.name for p in (tmp_path / "retrievers").iterdir()) == [a.name, b.name]  # no temp left
    assert retrievers.published_urls(tmp_path) == ["http://10.0.0.1:8001", "http://10.0.0.2:8000"]
    for bad in ("https://h:1", "http://h", "http://h:1/retrieve", "h:1"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            retrievers.publish(tmp_path, bad)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1]",
        '{"url": "http://10.0.0.3:9", "host": "10.0.0.3", "port": 9, "pid": 1}',
        '{"url": "http://10.0.0.4:9", "host": "10.0.0.4", "port": 9, "pid": 1, "started": 0}',
        '{"url": "http://10.0.0.3:9", "host": "10.0.0.3", "port": 9, "pid": 0, "started": 0}',
    ],
)
def test_a_garbled_file_is_named_with_its_fix(tmp_path, text):
    path = tmp_path / "retrievers" / "10.0.0.3_9.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(StudyError) as err:
        retrievers.published_urls(tmp_path)
    assert str(path) in str(err.value) and f"Fix: delete {path}" in str(err.value)


def _study(tmp_path: Path) -> Path:
    path = tmp_path / "one.yaml"
    path.write_text(
        "name: one\nbase: recipes/micro_sparse.yaml\naxes: {shape: [em_only], seed: [42]}\nsteps: 1\n"
    )
    return path


def _sets(token: Path | None) -> list[str]:
    return [
        "retriever.backend=bm25",
        f"retriever.corpus={SAMPLE_CORPUS}",
        f"retriever.auth_token_file={token if token else 'null'}",
    ]


def test_beyond_loopback_without_a_token_is_refused_before_anything_starts(tmp_path, capsys):
    study = load_study(_study(tmp_path))
    where = layout(study, tmp_path / "runs", tmp_path / "res")
    args = argparse.Namespace(host="10.255.255.1", port=free_port(), set=_sets(None), cells=None)
    assert retrievers.serve_here(study, where, args) == 2
    err = capsys.readouterr().err
    assert "--host 10.255.255.1 is beyond loopback" in err and "retriever.auth_token_file" in err
    assert not (tmp_path / "runs" / "retrievers").exists()


@pytest.mark.slow
def test_serve_here_publishes_while_healthy_and_unpublishes_on_sigterm(tmp_path):
    study = _study(tmp_path)
    token = token_file(tmp_path / "token", secrets.token_hex(16))
    port, runs = free_port(), tmp_path / "runs"
    cmd = [sys.executable, "-m", "study", "retrievers", str(study), "--serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--runs", str(runs), "--set", *_sets(token)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while retrievers.published_urls(runs) != [url]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)[0]
            time.sleep(0.2)
        entry = retrievers.published(runs)[0]
        assert entry.host == "127.0.0.1" and entry.port == port and entry.pid != proc.pid
        search_once(url, require_hits=True, auth_token_file=token)
        assert httpx.post(f"{url}/retrieve", json={"queries": ["x"], "topk": 1}).status_code == 401
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, out
    assert "SIGTERM: stopping the retriever" in out
    assert retrievers.published_urls(runs) == []
    assert (runs / "retrievers" / f"127.0.0.1_{port}.log").is_file()
    assert port_free(port)
