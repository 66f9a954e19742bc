"""The launchers carry the retriever's bearer-token file: the retriever that ``launch run`` or
``launch eval`` starts on loopback gets ``--auth-token-file`` and is probed with the token, so it
answers nobody without it; ``retriever.auth_token_file`` (launch/eval.sh's alias
``RETRIEVER_AUTH_TOKEN_FILE``) reaches ``python -m eval run``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import token_file
from omegaconf import OmegaConf

from launch import preflight, train
from launch.evaluate import DEFAULT_RECIPE, EvalError, eval_command, load_settings, start_retriever
from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.probe import ProbeError, search_once
from search_env.retrieval.process import free_port
from search_env.retriever_guard import RETRIEVER_LOG_ENV

TOKEN = "launch-token-0123456789abcdef"


def _token_file(path: Path, mode: int = 0o600) -> Path:
    return token_file(path, TOKEN, mode)


def _requires_the_token(url: str, token: Path) -> None:
    search_once(url, require_hits=True, auth_token_file=token)
    with pytest.raises(ProbeError, match=r"HTTP 401: the server requires a bearer token"):
        search_once(url)


def _bm25(port: int) -> list[str]:
    """Overrides of recipes/base.yaml for a local BM25 retriever over the bundled sample corpus."""
    return ["retriever.backend=bm25", f"retriever.corpus={SAMPLE_CORPUS}", f"retriever.port={port}"]


@pytest.mark.slow
def test_eval_sh_hands_the_token_file_to_its_retriever_and_the_evaluation(tmp_path: Path) -> None:
    token = _token_file(tmp_path / "token")
    port = free_port()
    env = {"RETRIEVER_AUTH_TOKEN_FILE": os.path.relpath(token)}
    settings = load_settings(DEFAULT_RECIPE, _bm25(port), env)
    assert settings.retriever.auth_token_file == str(token)  # absolute
    serve = settings.retriever.serve_args
    assert serve[serve.index("--auth-token-file") + 1] == str(token)
    cmd = eval_command(tmp_path, settings, tmp_path)
    assert OmegaConf.load(cmd[cmd.index("--config") + 1]).retriever.auth_token_file == str(token)
    plain = load_settings(DEFAULT_RECIPE, _bm25(port), {})
    assert "--auth-token-file" not in plain.retriever.serve_args
    cmd = eval_command(tmp_path, plain, tmp_path)
    assert OmegaConf.load(cmd[cmd.index("--config") + 1]).retriever.auth_token_file is None
    retriever = start_retriever(settings, tmp_path)
    try:
        _requires_the_token(f"http://127.0.0.1:{port}", token)
    finally:
        retriever.stop()


def test_eval_sh_refuses_an_open_token_file_naming_the_setting(tmp_path: Path) -> None:
    shared = _token_file(tmp_path / "shared", mode=0o644)
    with pytest.raises(EvalError, match=f"retriever.auth_token_file: auth token file {shared}.*chmod 600"):
        load_settings(DEFAULT_RECIPE, _bm25(free_port()), {"RETRIEVER_AUTH_TOKEN_FILE": str(shared)})


@pytest.mark.slow
def test_the_training_retriever_requires_the_token_and_is_probed_with_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(RETRIEVER_LOG_ENV, "")  # start_retriever sets it; restored afterwards
    token = _token_file(tmp_path / "token")
    overrides = [
        f"retriever.port={free_port()}",
        f"retriever.corpus={SAMPLE_CORPUS.relative_to(REPO_ROOT)}",
        f"retriever.auth_token_file={token}",
    ]
    setup = preflight.run_setup(REPO_ROOT / "recipes" / "demo_cpu.yaml", overrides, tmp_path)
    assert not setup.problems
    started = train.Started(train.RunDir(tmp_path))
    try:
        train.start_retriever(setup, started)  # wait_healthy + search_once with the token
        _requires_the_token(setup.retriever.urls[0], token)
    finally:
        started.stop()
    assert TOKEN not in (tmp_path / "retriever.log").read_text()
