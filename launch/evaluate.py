"""``python -m launch eval RUN_DIR [python -m eval run flags]``: evaluate every checkpoint of a run.

Starts a retriever over CORPUS unless RETRIEVER_URL names running ones, probes each with one real
search, runs ``python -m eval run`` (one process per GPU of GPUS, on one results folder), prints
the table and stops what it started, by PID. Settings come from the environment (:data:`HELP`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from launch.procs import stop_on_sigterm, stop_process
from launch.retriever import LocalRetriever
from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.auth import AuthFileError, load_tokens
from search_env.retrieval.probe import ProbeError, search_once, wait_healthy

HELP = """environment (defaults in brackets):
  SUITE          suite folder/file or built-in name: fixtures | test | val        [fixtures]
  PLAN           auto | full | sequential (docs/evaluation.md)                    [auto: sequential on a GPU]
  LIMIT          rows per benchmark (seeded subsample); empty = all; full plan only [4 for fixtures, else all]
  OUT            results root; the run goes to OUT/<run>                         [results/eval_<suite>]
  BACKEND        auto | hf | vllm                                                 [auto]
  SAMPLES        rollouts per question; > 1 adds pass@1..pass@N and avg@N, needs TEMPERATURE > 0 [1]
  TEMPERATURE    sampling temperature (0 = greedy)                               [0]
  SAMPLE_SEED    seed of the samples (not the run's training seed)               [0]
  GPUS           comma-separated GPU ids, one evaluation process each; empty = one []
  RETRIEVER_URL  running retrieval server(s), comma-separated; empty = start one  []
  RETRIEVER_PORT port of the retriever started here                             [8010]
  CORPUS         corpus of that retriever                                        [the bundled wiki-18 sample]
  INDEX, ENCODER with both: that retriever is dense (this faiss index over CORPUS + this E5 folder) []
  RETRIEVER_GPU  its --gpu: on = the index on the GPU(s) where it fits, auto = on CPU, off = all CPU
                 [on when torch sees a GPU, else auto]
  RETRIEVER_AUTH_TOKEN_FILE
                 bearer-token file, mode 600 (training's retriever.auth_token_file): the retriever
                 started here gets --auth-token-file; probes and searches send the token    []
  JUDGE_URL, JUDGE_MODEL
                 an OpenAI-compatible endpoint and its served model name (both or neither): an
                 LLM judge also scores the rows (launch/serve_judge.sh; docs/evaluation.md)   []
  TIMEOUT_S      hard wall-clock limit of the evaluation in seconds; 0 = none      [0]
  PYTHON         interpreter (launch/_common.sh picks it; the first line printed names it)"""
BM25_STARTUP_S = 60
DENSE_STARTUP_S = 1800
"""Reading (and copying to the GPU) the 16 GB wiki-18 index takes minutes."""


class EvalError(RuntimeError):
    """Stop before evaluating, with this message and ``status``."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _path(value: str) -> Path:
    return Path(value).expanduser().absolute()


@dataclass
class Settings:
    """eval.sh's environment, read once (:data:`HELP`)."""

    suite: str
    plan: str
    limit: str
    out: Path
    backend: str
    gpus: list[str]
    urls: list[str]
    port: int
    corpus: Path
    index: str
    encoder: str
    retriever_gpu: str
    timeout_s: float
    auth_token_file: str = ""
    """Absolute, or empty for none (RETRIEVER_AUTH_TOKEN_FILE)."""
    judge_url: str = ""
    judge_model: str = ""
    """JUDGE_URL, JUDGE_MODEL: both or neither (empty: no judge)."""
    sampling: list[str] = field(default_factory=list)
    """``--samples``/``--temperature``/``--sample-seed`` for SAMPLES/TEMPERATURE/SAMPLE_SEED (given ones only)."""
    extra: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        suite = env.get("SUITE") or "fixtures"
        if Path(suite).exists():
            suite = str(_path(suite))
        plan = env.get("PLAN") or "auto"
        limit = env.get("LIMIT")
        if limit is None:
            limit = "4" if suite == "fixtures" and plan != "sequential" else ""
        name = os.path.splitext(os.path.basename(suite.rstrip("/")))[0]
        try:
            port, timeout_s = int(env.get("RETRIEVER_PORT") or 8010), float(env.get("TIMEOUT_S") or 0)
        except ValueError as err:
            raise EvalError(f"RETRIEVER_PORT and TIMEOUT_S must be numbers: {err}") from None
        token_file = env.get("RETRIEVER_AUTH_TOKEN_FILE") or ""
        if token_file:
            token_file = os.path.abspath(os.path.expanduser(token_file))
            try:
                load_tokens(token_file)
            except AuthFileError as err:
                raise EvalError(f"RETRIEVER_AUTH_TOKEN_FILE: {err}") from None
        judge_url, judge_model = env.get("JUDGE_URL") or "", env.get("JUDGE_MODEL") or ""
        if bool(judge_url) != bool(judge_model):
            raise EvalError("JUDGE_URL and JUDGE_MODEL go together: set both (or neither)")
        sampling = []
        for var, flag, kind in (
            ("SAMPLES", "--samples", int),
            ("TEMPERATURE", "--temperature", float),
            ("SAMPLE_SEED", "--sample-seed", int),
        ):
            if env.get(var):
                try:
                    sampling += [flag, str(kind(env[var]))]
                except ValueError:
                    raise EvalError(f"{var} must be a number ({kind.__name__}), got {env[var]!r}") from None
        return cls(
            suite=suite,
            plan=plan,
            limit=limit,
            out=_path(env["OUT"]) if env.get("OUT") else REPO_ROOT / "results" / f"eval_{name}",
            backend=env.get("BACKEND") or "auto",
            gpus=[g for g in (env.get("GPUS") or "").split(",") if g],
            urls=[u for u in (env.get("RETRIEVER_URL") or "").split(",") if u],
            port=port,
            corpus=_path(env.get("CORPUS") or str(SAMPLE_CORPUS)),
            index=env.get("INDEX") or "",
            encoder=env.get("ENCODER") or "",
            retriever_gpu=env.get("RETRIEVER_GPU") or "",
            timeout_s=timeout_s,
            auth_token_file=token_file,
            judge_url=judge_url,
            judge_model=judge_model,
            sampling=sampling,
        )


def _gpu_visible() -> bool:
    import torch  # heavy: torch, only to place a dense retriever's index

    return torch.cuda.is_available()


def serve_args(s: Settings) -> tuple[list[str], int]:
    """The local retriever's ``python -m search_env.retrieval`` arguments and its start-up limit."""
    if not s.corpus.is_file():
        raise EvalError(f"CORPUS {s.corpus} not found; set CORPUS or RETRIEVER_URL")
    url = f"http://127.0.0.1:{s.port}"
    try:
        wait_healthy(url, 0)
    except TimeoutError:
        pass
    else:
        raise EvalError(
            f"port {s.port} already serves a retriever; set RETRIEVER_URL={url} to use it, or RETRIEVER_PORT "
            "to another port"
        )
    serve, startup_s = ["--backend", "bm25"], BM25_STARTUP_S
    if s.index or s.encoder:
        if not (Path(s.index).is_file() and (Path(s.encoder) / "config.json").is_file()):
            raise EvalError(
                f"a dense retriever needs INDEX (a faiss index file, got '{s.index}') and ENCODER (a model "
                f"folder with config.json, got '{s.encoder}')"
            )
        gpu = s.retriever_gpu or ("on" if _gpu_visible() else "auto")  # evaluation: the index on the GPU(s)
        serve = ["--backend", "dense", "--index", s.index, "--encoder", s.encoder, "--gpu", gpu]
        startup_s = DENSE_STARTUP_S
    if s.auth_token_file:
        serve += ["--auth-token-file", s.auth_token_file]
    return serve, startup_s


def start_retriever(s: Settings, log_dir: Path) -> LocalRetriever:
    """The local retriever on 127.0.0.1:RETRIEVER_PORT, healthy; EvalError (status 1) with its log."""
    serve, startup_s = serve_args(s)
    print(f"starting retriever {' '.join(serve)} on 127.0.0.1:{s.port} over {s.corpus}", flush=True)
    args = ["serve", *serve, "--corpus", str(s.corpus), "--host", "127.0.0.1", "--port", str(s.port)]
    retriever = LocalRetriever(args, log_dir / "retriever.log")
    process = retriever.start()
    try:
        wait_healthy(f"http://127.0.0.1:{s.port}", startup_s, process, auth_token_file=s.auth_token_file)
    except (TimeoutError, RuntimeError) as err:
        retriever.stop()
        text = retriever.log_path.read_text(errors="replace")
        raise EvalError(
            f"the retriever did not become healthy within {startup_s} s ({err}); its log:\n{text}", 1
        ) from None
    return retriever


def eval_command(run_dir: Path, s: Settings) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "eval",
        "run",
        "--run-dir",
        str(run_dir),
        "--suite",
        s.suite,
        "--out",
        str(s.out),
    ]
    cmd += ["--backend", s.backend, "--plan", s.plan, "--retriever-url", *s.urls]
    if s.auth_token_file:
        cmd += ["--retriever-auth-token-file", s.auth_token_file]
    if s.judge_url:
        cmd += ["--judge-url", s.judge_url, "--judge-model", s.judge_model]
    return cmd + (["--limit", s.limit] if s.limit else []) + s.sampling + s.extra


def _wait(process: subprocess.Popen, timeout_s: float) -> int:
    """Its exit status; 124 after stopping it at ``timeout_s`` (0 = no limit), as timeout(1)."""
    try:
        return process.wait(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        stop_process(process, 10)
        return 124


def evaluate(run_dir: Path, s: Settings, workers: list[subprocess.Popen]) -> int:
    """One ``python -m eval run``, or one per GPU with the first one's table printed at the end."""
    cmd = eval_command(run_dir, s)
    if not s.gpus:
        print("+ " + " ".join(cmd), flush=True)
        workers.append(subprocess.Popen(cmd, cwd=REPO_ROOT))
        return _wait(workers[0], s.timeout_s)
    s.out.mkdir(parents=True, exist_ok=True)
    logs = [s.out / f"{run_dir.name}.gpu{gpu}.log" for gpu in s.gpus]
    for gpu, log in zip(s.gpus, logs, strict=True):
        print(f"+ CUDA_VISIBLE_DEVICES={gpu} {' '.join(cmd)}   > {log}", flush=True)
        with open(log, "w") as sink:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            workers.append(
                subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
            )
    rc = 0
    for gpu, log, worker in zip(s.gpus, logs, workers, strict=True):
        if _wait(worker, s.timeout_s) != 0:
            rc = 1
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            print(f"error: the evaluation on GPU {gpu} failed; last lines of {log}:\n{tail}", file=sys.stderr)
    if rc == 0:
        lines = logs[0].read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("| step")), len(lines))
        print("\n".join(lines[start:]), flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bash launch/eval.sh",
        description="Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.",
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="the run's checkpoint folder (holding global_step_N/)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="more `python -m eval run` flags")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.expanduser().absolute()
    stop_on_sigterm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    retriever: LocalRetriever | None = None
    workers: list[subprocess.Popen] = []
    try:
        if not run_dir.is_dir():
            raise EvalError(
                f"RUN_DIR {args.run_dir} is not a folder (expected the run's checkpoints, with global_step_N/)"
            )
        settings = Settings.from_env(dict(os.environ))
        settings.extra = list(args.extra)
        with tempfile.TemporaryDirectory() as log_dir:
            if not settings.urls:
                retriever = start_retriever(settings, Path(log_dir))
                settings.urls = [f"http://127.0.0.1:{settings.port}"]
            for url in settings.urls:
                try:
                    search_once(url, auth_token_file=settings.auth_token_file)
                except ProbeError as err:
                    raise EvalError(f"retriever {url} failed its test search: {err}", 1) from None
            try:
                return evaluate(run_dir, settings, workers)
            finally:
                for worker in workers:
                    stop_process(worker, 10)
                if retriever is not None:
                    retriever.stop()
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        return 130
