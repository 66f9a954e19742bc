"""``python -m eval run --retriever-auth-token-file``: the retrievers' bearer-token file reaches the
rollouts' search tool (its path, never the token) but not the evaluation settings, so results with
and without it stay comparable; an unusable file is refused naming the flag and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import token_file

from eval.run.cli import build_run_parser, prepare
from eval.run.rollout import tool_and_loop_files
from eval.run.runner import write_run_json
from eval.run.settings import step0_key
from eval.schema import differences
from search_env.paths import REPO_ROOT

TOKEN = "eval-token-0123456789abcdef"
MODEL = REPO_ROOT / "assets" / "demo_base"
"""The shipped demo base model: an HF folder, evaluated as step 0."""


def _token_file(path: Path, mode: int = 0o600) -> Path:
    return token_file(path, TOKEN, mode)


def _plan(out: Path, *extra: str):
    args = [
        "--run-dir",
        str(MODEL),
        "--suite",
        "samples",
        "--out",
        str(out),
        "--shape",
        "f1_only",
        "--seed",
        "1",
        "--plan",
        "full",
        "--limit",
        "2",
        "--backend",
        "hf",
        "--retriever-url",
        "http://127.0.0.1:8000",
        *extra,
    ]
    return prepare(build_run_parser().parse_args(args))


@pytest.mark.slow
def test_the_token_file_reaches_the_search_tool_but_not_the_settings(tmp_path: Path) -> None:
    token = _token_file(tmp_path / "token")
    plain = _plan(tmp_path / "out")
    authed = _plan(tmp_path / "out", "--retriever-auth-token-file", str(token))
    assert plain.retriever_auth_token_file is None and authed.retriever_auth_token_file == str(token)
    assert authed.eval_settings == plain.eval_settings
    assert differences(authed.eval_settings, plain.eval_settings) == []
    assert step0_key("model", authed.eval_settings) == step0_key("model", plain.eval_settings)
    write_run_json(plain)
    write_run_json(authed)  # the same results folder: comparable
    run_json = (authed.run_root / "run.json").read_text()
    assert TOKEN not in run_json and str(token) not in run_json
    tools, _ = tool_and_loop_files(
        authed.limits,
        authed.retriever_urls,
        tmp_path / "step0",
        MODEL,
        auth_token_file=authed.retriever_auth_token_file,
    )
    config = yaml.safe_load(tools.read_text())["tools"][0]["config"]
    assert config["auth_token_file"] == str(token) and TOKEN not in tools.read_text()


@pytest.mark.slow
def test_an_unusable_token_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    shared = _token_file(tmp_path / "shared", mode=0o640)
    with pytest.raises(ValueError, match=f"--retriever-auth-token-file: auth token file {shared}.*chmod 600"):
        _plan(tmp_path / "out", "--retriever-auth-token-file", str(shared))
    with pytest.raises(ValueError, match="--retriever-auth-token-file: .*cannot read it"):
        _plan(tmp_path / "out", "--retriever-auth-token-file", str(tmp_path / "absent"))
