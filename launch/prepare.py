"""``python -m launch prepare [TARGET ...] [--check]``: fetch what the GPU recipes need into the
paths recipes/base.yaml expects (targets and sources: :data:`TARGETS`, docs/training.md).

Existing files are kept. Without network access nothing is downloaded, and each missing item is
listed with its path and the command that provides it (run it where a network exists).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from search_env.paths import REPO_ROOT

STUDY_REPO = "pantomiman/reason-over-search"
STUDY_INDEX = "retriever/wiki18_100w_e5_ivf4096_sq8.index"
TARGETS = ("model", "encoder", "corpus", "index", "data")
HELP = """targets (default: all):
  model    data/models/Qwen3.5-0.8B          <- HF Qwen/Qwen3.5-0.8B (~1.7 GB)
  encoder  data/models/e5-base-v2            <- HF intfloat/e5-base-v2 (~0.4 GB)
  corpus   data/wiki18/wiki-18.jsonl         <- HF dataset PeterJinGo/wiki-18-corpus (~14 GB)
  index    data/wiki18/e5_IVF4096_SQ8.index  <- INDEX_SOURCE=study (default): the study's own IVF4096,SQ8
           index (HF dataset pantomiman/reason-over-search, ~16 GB, bit for bit the study's retrieval);
           INDEX_SOURCE=flat: HF dataset PeterJinGo/wiki-18-e5-index (Flat, 64.5 GB), re-packed by
           python -m search_env convert-index (~16 GB)
  data     data/parquet/{musique_train,val}.parquet, data/parquet/suite/
           <- HF dataset RUC-NLPIR/FlashRAG_datasets (python -m search_env.data)
environment: DATA_DIR (the data/ prefix of the downloads only; the recipes keep data/..., so pass the
matching overrides to launch/run.sh), INDEX_SOURCE (study | flat)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Layout:
    """Where each target goes under DATA_DIR."""

    data: Path
    index_source: str = "study"

    @property
    def model(self) -> Path:
        return self.data / "models" / "Qwen3.5-0.8B"

    @property
    def encoder(self) -> Path:
        return self.data / "models" / "e5-base-v2"

    @property
    def corpus(self) -> Path:
        return self.data / "wiki18" / "wiki-18.jsonl"

    @property
    def index(self) -> Path:
        return self.data / "wiki18" / "e5_IVF4096_SQ8.index"

    @property
    def parquet(self) -> Path:
        return self.data / "parquet"

    @property
    def download(self) -> Path:
        return self.data / "wiki18" / "download"

    def present(self, target: str) -> bool:
        if target in ("model", "encoder"):
            return (getattr(self, target) / "config.json").is_file()
        if target in ("corpus", "index"):
            return getattr(self, target).is_file()
        return all((self.parquet / f"{n}.parquet").is_file() for n in ("musique_train", "val"))

    def where(self, target: str) -> str:
        if target == "data":
            return f"{self.parquet}/musique_train.parquet, {self.parquet}/val.parquet"
        return str(getattr(self, target))

    def howto(self, target: str) -> str:
        """The command that provides ``target``, to run by hand where a network exists."""
        py = sys.executable
        snapshot = 'from huggingface_hub import snapshot_download as s; s("{}", local_dir="{}")'
        if target == "model":
            return f"{py} -c '{snapshot.format('Qwen/Qwen3.5-0.8B', self.model)}'"
        if target == "encoder":
            return f"{py} -c '{snapshot.format('intfloat/e5-base-v2', self.encoder)}'"
        if target == "corpus":
            return (
                "download wiki-18.jsonl.gz from HF dataset PeterJinGo/wiki-18-corpus, then: "
                f"gunzip -c wiki-18.jsonl.gz > {self.corpus}"
            )
        if target == "index":
            hub = f'from huggingface_hub import hf_hub_download as h; h("{STUDY_REPO}", "{STUDY_INDEX}", repo_type="dataset", local_dir="{self.download}")'
            return (
                f"either (INDEX_SOURCE=study, default, ~16 GB) the study's IVF4096,SQ8 index: {py} -c '{hub}' && "
                f"mv {self.download}/{STUDY_INDEX} {self.index}\n      or (INDEX_SOURCE=flat, 64.5 GB) download "
                "part_aa part_ab from HF dataset PeterJinGo/wiki-18-e5-index, cat part_aa part_ab > e5_Flat.index, "
                f"then: {py} -m search_env convert-index --flat e5_Flat.index --out {self.index}"
            )
        return " && ".join(
            f"{py} -m search_env.data {split} --source hub --out {self.parquet}"
            for split in ("train", "val", "suite")
        )


def snapshot(repo: str, local: Path, kind: str = "model", pattern: str | None = None) -> None:
    from huggingface_hub import snapshot_download  # network client, only when fetching

    snapshot_download(
        repo_id=repo, local_dir=str(local), repo_type=kind, allow_patterns=[pattern] if pattern else None
    )


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def fetch(target: str, at: Layout) -> None:
    """Download ``target`` (CalledProcessError / OSError / the hub's errors when it fails)."""
    if target == "model":
        snapshot("Qwen/Qwen3.5-0.8B", at.model)
    elif target == "encoder":
        snapshot("intfloat/e5-base-v2", at.encoder)
    elif target == "corpus":
        snapshot("PeterJinGo/wiki-18-corpus", at.download, "dataset", "wiki-18.jsonl.gz")
        partial = at.corpus.with_name(at.corpus.name + ".partial")
        with gzip.open(at.download / "wiki-18.jsonl.gz", "rb") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        partial.replace(at.corpus)
    elif target == "index" and at.index_source == "study":
        snapshot(STUDY_REPO, at.download, "dataset", STUDY_INDEX)
        shutil.move(at.download / STUDY_INDEX, at.index)
    elif target == "index":
        snapshot("PeterJinGo/wiki-18-e5-index", at.download, "dataset", "part_a*")
        flat = at.data / "wiki18" / "e5_Flat.index"
        with open(flat, "wb") as dst:
            for part in sorted(at.download.glob("part_a?")):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        run(
            [sys.executable, "-m", "search_env", "convert-index", "--flat", str(flat), "--out", str(at.index)]
        )
    else:
        for split in ("train", "val", "suite"):
            run([sys.executable, "-m", "search_env.data", split, "--source", "hub", "--out", str(at.parquet)])


def online(timeout_s: float = 5.0) -> bool:
    """huggingface.co answers."""
    try:
        urllib.request.urlopen("https://huggingface.co", timeout=timeout_s).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bash launch/prepare.sh",
        description="Fetch what the GPU recipes need, into the paths recipes/base.yaml expects.",
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "targets", nargs="*", metavar="TARGET", help="all (default) or some of: " + " ".join(TARGETS)
    )
    parser.add_argument("--check", action="store_true", help="only list what is missing")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets if t not in (*TARGETS, "all")]
    if unknown:
        print(
            f"error: unknown target '{unknown[0]}' (use: all {' '.join(TARGETS)}, or --check)",
            file=sys.stderr,
        )
        return 2
    source = os.environ.get("INDEX_SOURCE") or "study"
    if source not in ("study", "flat"):
        print(f"error: INDEX_SOURCE='{source}': use study or flat", file=sys.stderr)
        return 2
    os.chdir(REPO_ROOT)
    at = Layout(Path(os.environ.get("DATA_DIR") or "data"), source)
    wanted = [t for t in TARGETS if not args.targets or "all" in args.targets or t in args.targets]
    missing = [t for t in wanted if not at.present(t)]
    if not missing:
        log(f"everything requested is present under {at.data}/")
        return 0
    if args.check or not online():
        if not args.check:
            log("no network access to huggingface.co: nothing downloaded")
        lines = [f"  - {t}: {at.where(t)}\n      {at.howto(t)}" for t in missing]
        print("missing (path <- command):\n" + "\n".join(lines), file=sys.stderr)
        return 1
    for folder in (at.data / "models", at.data / "wiki18", at.parquet):
        folder.mkdir(parents=True, exist_ok=True)
    for target in missing:
        log(f"fetching {target}")
        try:
            fetch(target, at)
        except Exception as err:  # noqa: BLE001 - any failure of a download: say how to do it by hand
            print(
                f"error: fetching {target} failed ({type(err).__name__}: {err}); by hand: {at.howto(target)}",
                file=sys.stderr,
            )
            return 2
    log(f"done: {' '.join(missing)}")
    return 0
