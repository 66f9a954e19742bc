"""What makes two evaluations comparable: the settings recorded with every result, the checks that
refuse mixing them, and content fingerprints of checkpoints (docs/evaluation.md, "Settings").

Results written before settings were recorded in each summary are read through their run.json;
a setting that one side does not record (a suite fingerprint, the retriever) is not compared.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.schema import FULL, comparable
from search_env import protocol

if TYPE_CHECKING:
    from eval.run.rollout import Limits
    from eval.run.suite import Suite

CHECKPOINT_FILE = "checkpoint.json"
"""In a step's results folder: the fingerprint of the checkpoint its rows came from."""
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model_world_size_*_rank_*.pt", "config.json")
"""The saved files a checkpoint's fingerprint reads (not optimizer state, which greedy rollouts ignore)."""
_WHOLE_FILE = 4 << 20
_SAMPLES, _SAMPLE = 16, 64 << 10
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
"""The ``sampling`` setting of a greedy single-sample evaluation (the default; as recorded before
sampling existed, so greedy results stay comparable with older ones)."""


@dataclass(frozen=True)
class Sampling:
    """How each question is rolled out: ``samples`` rollouts (``--samples``) at ``temperature``
    (0 = greedy) and ``top_p``, seeded from ``seed`` (``--sample-seed``) and the row.

    ValueError (naming the flag) for ``samples`` < 1, a negative temperature, ``top_p`` outside
    (0, 1], or several samples at temperature 0 (greedy rollouts would all be the same).
    """

    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"--samples {self.samples} needs --temperature > 0 (e.g. --temperature 0.7): greedy "
                "decoding (--temperature 0, the default) gives every sample the same answer"
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0: one deterministic rollout per question, rows without a ``sample`` index."""
        return self.temperature == 0

    def settings(self) -> dict[str, Any]:
        """The ``sampling`` evaluation setting: :data:`GREEDY` when greedy (seed and top-p unused),
        else temperature, top-p, top-k, samples and the sample seed."""
        if self.greedy:
            return dict(GREEDY)
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": -1,
            "samples": self.samples,
            "seed": self.seed,
        }

    def indices(self) -> list[int | None]:
        """Sample indices of one question: ``[None]`` when greedy (no ``sample`` field), else 0..N-1."""
        return [None] if self.greedy else list(range(self.samples))

    def seed_of(self, benchmark: str, qid: str, sample: int) -> int:
        """The 63-bit seed of one sample of a question, from ``seed`` and the row (a rerun draws the
        same rollouts; samples and questions draw independent ones)."""
        digest = hashlib.blake2b(struct.pack("<qq", self.seed, sample), digest_size=8)
        digest.update(json.dumps([benchmark, qid]).encode())
        return int.from_bytes(digest.digest(), "little") >> 1


def eval_settings(
    suite: Suite,
    limit: int | None,
    subsample_seed: int,
    limits: Limits,
    backend: str,
    prefix_caching: bool = False,
    plan: str = FULL,
    retriever: dict[str, Any] | None = None,
    topk: int = protocol.TOPK,
    sampling: Sampling | None = None,
    judge: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The settings stored in run.json and every summary.json of an evaluation.

    vLLM's prefix caching is recorded for the vllm backend (it may change greedy outputs); the
    pool size and the memory fraction are not (they change speed, not rows). ``retriever`` is
    :func:`search_env.retrieval.probe.check_retrievers`'s identity, filled in when the run starts.
    ``sampling``: :class:`Sampling` (default greedy, one sample). ``judge``
    (:func:`judge_setting`) is recorded only when a judge scores the rows (its URL and concurrency
    are not: they change where and how fast, not the verdicts).
    """
    settings: dict[str, Any] = {
        "suite": suite.name,
        "suite_fingerprint": suite.fingerprint,
        "benchmarks": {b: len(qs) for b, qs in suite.benchmarks.items()},
        "limit": limit,
        "subsample_seed": subsample_seed,
        "plan": plan,
        "backend": backend,
        "sampling": (sampling or Sampling()).settings(),
        "limits": asdict(limits),
        "retriever": retriever or {},
        "topk": topk,
    }
    if backend == "vllm":
        settings["prefix_caching"] = prefix_caching
    if judge is not None:
        settings["judge"] = judge
    return settings


def judge_setting(model: str, prompt_version: str) -> dict[str, str]:
    """The judge's identity as an evaluation setting: its served model name and prompt version."""
    return {"model": model, "prompt_version": prompt_version}


def _file_digest(path: Path) -> str:
    """sha256 of a file, or for a large one of its size and 16 evenly spaced 64 KiB samples + the end."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE:
            h.update(f.read())
        else:
            for i in range(_SAMPLES):
                f.seek(i * (size - _SAMPLE) // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def checkpoint_fingerprint(path: Path) -> str:
    """Content fingerprint (16 hex digits) of a checkpoint's saved weights and model config under
    ``path`` (an HF folder or verl's ``actor/``): the same for a copy, new for a run trained again."""
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in Path(path).rglob(pattern) if f.is_file()})
    if not files:
        raise ValueError(f"{path}: no weights or config.json to fingerprint")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(path)}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()[:16]


_NOT_ROW_SHAPING = ("plan", "rows per benchmark (--limit)", "judge (--judge-model, prompt version)")


def step0_key(model_fingerprint: str, settings: dict[str, Any]) -> str:
    """Key of the untrained model's shared rows: its content and every setting that shapes a row
    (not the judge, which scores rows after they are made)."""
    shared = {k: v for k, v in comparable(settings).items() if k not in _NOT_ROW_SHAPING}
    blob = json.dumps([model_fingerprint, shared], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
