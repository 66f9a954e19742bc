"""``python -m launch prepare [TARGET ...] [--check] [--pin-on-first-download]``: fetch what the GPU
recipes need into the paths recipes/base.yaml expects (targets and sources: :data:`TARGETS`,
docs/training.md).

The model, the encoder and the index are downloaded at the commit ``launch/pins.json`` names, and
their weight / index files must match its sha256 before they are moved into place (docs/gpu.md,
"Pinned downloads"). Existing files are kept (and checked against a pinned digest). Without network
access nothing is downloaded, and each missing item is listed with its path and the command that
provides it (run it where a network exists).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from search_env.paths import REPO_ROOT
from search_env.safe_fs import remove_tree, replace_durably, write_atomic

PINS_FILE = REPO_ROOT / "launch" / "pins.json"
STUDY_REPO = "pantomiman/reason-over-search"
STUDY_INDEX = "retriever/wiki18_100w_e5_ivf4096_sq8.index"
TARGETS = ("model", "encoder", "corpus", "index", "data")
STAMPS = ".sha256-verified.json"
"""Under DATA_DIR: digests already computed, reused while the file is unchanged (:func:`sha256_of`)."""
FINGERPRINT_BYTES = 1 << 20
HELP = """targets (default: all):
  model    data/models/Qwen3.5-0.8B          <- HF Qwen/Qwen3.5-0.8B (~1.7 GB)
  encoder  data/models/e5-base-v2            <- HF intfloat/e5-base-v2 (~0.4 GB)
  corpus   data/wiki18/wiki-18.jsonl         <- HF dataset PeterJinGo/wiki-18-corpus (~14 GB)
  index    data/wiki18/e5_IVF4096_SQ8.index  <- INDEX_SOURCE=study (default): the study's own IVF4096,SQ8
           index (HF dataset pantomiman/reason-over-search, ~16 GB, the file the study serves);
           INDEX_SOURCE=flat: HF dataset PeterJinGo/wiki-18-e5-index (Flat, 64.5 GB), re-packed by
           python -m search_env.retrieval convert-index (~16 GB)
  data     data/parquet/{musique_train,val}.parquet, data/parquet/suite/
           <- HF dataset RUC-NLPIR/FlashRAG_datasets (python -m search_env.data)
pins: model, encoder and index are fetched at the commit launch/pins.json names and their weight /
index files checked against its sha256; a value it lacks makes prepare refuse that download unless
--pin-on-first-download records what was fetched; --check lists each unknown value and why
(docs/gpu.md, "Pinned downloads").
environment: DATA_DIR (the data/ prefix of the downloads only; the recipes keep data/..., so pass the
matching overrides to launch/run.sh), INDEX_SOURCE (study | flat)."""
NOT_PINNED = {
    "corpus": "PeterJinGo/wiki-18-corpus is fetched at main with no revision or sha256: passage text, "
    "read as JSON lines, never executed nor parsed by native index code",
    "data": "RUC-NLPIR/FlashRAG_datasets is fetched at main (datasets.load_dataset, no revision or sha256): "
    "question and answer rows, read as parquet",
}
"""The downloads launch/pins.json has no entry for, and why (``--check`` says so)."""
HEX40 = re.compile(r"[0-9a-f]{40}")
HEX64 = re.compile(r"[0-9a-f]{64}")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- pins


class PinError(RuntimeError):
    """A pin is malformed, missing, or a download does not match it (the message names the fix)."""


@dataclass(frozen=True)
class Pin:
    """One pinned HF repository: the commit to fetch and the sha256 of the files that matter."""

    name: str
    repo: str
    repo_type: str
    revision: str | None
    sha256: dict[str, str | None]
    source: str = ""

    def unknown(self) -> list[str]:
        """The values this pin lacks, as 'revision' / 'sha256 of FILE'."""
        gaps = [] if self.revision else ["revision"]
        return gaps + [f"sha256 of {f}" for f, digest in self.sha256.items() if not digest]

    def as_json(self) -> dict:
        return {"repo": self.repo, "repo_type": self.repo_type, "revision": self.revision,
                "sha256": self.sha256, "source": self.source}  # fmt: skip


UPDATE_HINT = (
    "update the pin: set its revision (a 40-hex commit of the HF repository) and the sha256 of the file "
    "(the 'SHA256' of its Git LFS details on huggingface.co, or `sha256sum` of a copy you trust) in "
    "{pins}, or rerun with --pin-on-first-download to record what is fetched (docs/gpu.md, "
    '"Pinned downloads")'
)


def load_pins(path: Path | None = None) -> dict[str, Pin]:
    """Pins by name (default file: :data:`PINS_FILE`); PinError naming the key and the fix when a
    value is malformed (null is allowed: unknown)."""
    path = path or PINS_FILE
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PinError(f"{path}: cannot read the pins ({err}); restore it from git") from err
    pins = {}
    for name, entry in raw.items():
        if name.startswith("_"):
            continue
        where = f"{path}: {name}"
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), dict):
            raise PinError(f"{where}: needs repo, repo_type, revision and a sha256 mapping")
        revision, digests = entry.get("revision"), entry["sha256"]
        if revision is not None and not (isinstance(revision, str) and HEX40.fullmatch(revision)):
            raise PinError(f"{where}.revision={revision!r}: must be a 40-hex commit sha or null (a branch "
                           "or tag name can move)")  # fmt: skip
        for file, digest in digests.items():
            if digest is not None and not (isinstance(digest, str) and HEX64.fullmatch(digest)):
                raise PinError(f"{where}.sha256[{file}]={digest!r}: must be 64 lowercase hex or null")
        pins[name] = Pin(name, str(entry["repo"]), str(entry.get("repo_type", "model")), revision,
                         dict(digests), str(entry.get("source", "")))  # fmt: skip
    return pins


def save_pin(pin: Pin, path: Path | None = None) -> None:
    """Write ``pin`` into the pins file (other entries and the key order kept), atomically."""
    path = path or PINS_FILE
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    raw[pin.name] = pin.as_json()
    write_atomic(path, json.dumps(raw, indent=2) + "\n")


def fingerprint(path: Path, size: int) -> str:
    """sha256 of the file's size, first MiB and last MiB: cheap to recompute on every check."""
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            handle.seek(max(size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
            digest.update(handle.read())
    return digest.hexdigest()


def sha256_of(path: Path, stamps: Path | None = None) -> str:
    """The file's sha256 (hex). With ``stamps`` (a JSON file), a digest computed earlier is reused only
    while the file has the same device and inode, size, mtime, ctime (which any write changes and no
    user can set back) and :func:`fingerprint`; otherwise the whole file is hashed and recorded."""
    st = path.stat()
    key, seen = f"{st.st_dev}:{st.st_ino}", {}
    now = {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "fingerprint": fingerprint(path, st.st_size),
    }
    if stamps is not None and stamps.is_file():
        try:
            seen = json.loads(stamps.read_text(encoding="utf-8"))
        except ValueError:
            seen = {}
        hit = seen.get(key, {})
        if all(hit.get(name) == value for name, value in now.items()):
            return str(hit["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            digest.update(chunk)
    if stamps is not None:
        seen[key] = {"path": str(path), **now, "sha256": digest.hexdigest()}
        write_atomic(stamps, json.dumps(seen, indent=1) + "\n")
    return digest.hexdigest()


def check_files(pin: Pin, folder: Path, stamps: Path | None) -> dict[str, str]:
    """The sha256 of each pinned file under ``folder``; PinError naming the file, the expected and the
    actual digest and how to update the pin when one differs or is missing."""
    found, pins_path = {}, PINS_FILE
    for file, expected in pin.sha256.items():
        path = folder / file
        if not path.is_file():
            raise PinError(f"{pin.name}: {pin.repo}@{pin.revision} has no file {file} (pinned in "
                           f"{pins_path}); " + UPDATE_HINT.format(pins=pins_path))  # fmt: skip
        actual = sha256_of(path, stamps)
        if expected and actual != expected:
            raise PinError(
                f"{pin.name}: {path} does not match its pin: sha256 expected {expected}, got {actual} "
                f"({pin.repo}@{pin.revision}). Nothing was installed. If the new file is the one you want, "
                + UPDATE_HINT.format(pins=pins_path)
            )
        found[file] = actual
    return found


def resolve_revision(repo: str, repo_type: str) -> str:
    """The commit sha ``main`` of an HF repository points at now (network)."""
    from huggingface_hub import HfApi  # network client, only when fetching

    return str(HfApi().repo_info(repo, repo_type=repo_type, revision="main").sha)


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Where each target goes under DATA_DIR."""

    data: Path
    index_source: str = "study"
    pins: dict[str, Pin] = field(default_factory=dict)

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

    @property
    def stamps(self) -> Path:
        return self.data / STAMPS

    def pin_of(self, target: str) -> Pin | None:
        """The pin a download of ``target`` obeys (None: corpus and data are not pinned)."""
        name = {"model": "model", "encoder": "encoder"}.get(target)
        if target == "index":
            name = "index" if self.index_source == "study" else "flat_index"
        return self.pins.get(name) if name else None

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
        pin = self.pin_of(target)
        rev = f', revision="{pin.revision}"' if pin and pin.revision else ""
        check = " (then check its sha256 against launch/pins.json)" if pin else ""
        snapshot = 'from huggingface_hub import snapshot_download as s; s("{}", local_dir="{}"{})'
        if target == "model":
            return f"{py} -c '{snapshot.format('Qwen/Qwen3.5-0.8B', self.model, rev)}'{check}"
        if target == "encoder":
            return f"{py} -c '{snapshot.format('intfloat/e5-base-v2', self.encoder, rev)}'{check}"
        if target == "corpus":
            return (
                "download wiki-18.jsonl.gz from HF dataset PeterJinGo/wiki-18-corpus, then: "
                f"gunzip -c wiki-18.jsonl.gz > {self.corpus}"
            )
        if target == "index":
            study = self.pins.get("index")
            srev = f', revision="{study.revision}"' if study and study.revision else ""
            hub = f'from huggingface_hub import hf_hub_download as h; h("{STUDY_REPO}", "{STUDY_INDEX}", repo_type="dataset", local_dir="{self.download}"{srev})'
            return (
                f"either (INDEX_SOURCE=study, default, ~16 GB) the study's IVF4096,SQ8 index: {py} -c '{hub}' && "
                f"mv {self.download}/{STUDY_INDEX} {self.index}\n      or (INDEX_SOURCE=flat, 64.5 GB) download "
                "part_aa part_ab from HF dataset PeterJinGo/wiki-18-e5-index, cat part_aa part_ab > e5_Flat.index, "
                f"then: {py} -m search_env.retrieval convert-index --flat e5_Flat.index --out {self.index}"
                f"\n      (check the sha256 of what you download against launch/pins.json)"
            )
        return " && ".join(
            f"{py} -m search_env.data {split} --source hub --out {self.parquet}"
            for split in ("train", "val", "suite")
        )


# ---------------------------------------------------------------- fetching


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def pinned_revision(pin: Pin, first_use: bool) -> str:
    """The commit to fetch: the pinned one, or (trust on first use) the one ``main`` points at now."""
    if pin.revision:
        return pin.revision
    if not first_use:
        raise PinError(missing_pins_message([pin]))
    return resolve_revision(pin.repo, pin.repo_type)


def settle(pin: Pin, revision: str, folder: Path, at: Layout, first_use: bool) -> Pin:
    """Check the pinned files under ``folder``; on trust on first use, the pin with what was fetched."""
    found = check_files(replace(pin, revision=revision), folder, at.stamps)
    if pin.revision and all(pin.sha256.values()):
        return pin
    if not first_use:
        raise PinError(missing_pins_message([pin]))
    return replace(pin, revision=revision, sha256={f: pin.sha256[f] or found[f] for f in pin.sha256})


def record(before: Pin, after: Pin) -> None:
    """Save a pin completed by trust on first use, and say so loudly."""
    if after == before:
        return
    save_pin(after)
    files = ", ".join(f"{f} sha256 {d}" for f, d in after.sha256.items())
    log(f"TRUST ON FIRST USE: recorded {after.name} = {after.repo}@{after.revision} ({files}) in {PINS_FILE}; "
        "nothing vouches for these values but this download: compare them with a copy you trust, then "
        "commit the file")  # fmt: skip


def fetch_snapshot(pin: Pin, final: Path, at: Layout, first_use: bool) -> None:
    """A model folder at the pinned commit: downloaded beside ``final``, checked, then renamed in."""
    from huggingface_hub import snapshot_download  # network client, only when fetching

    if final.exists() and any(final.iterdir()):
        raise PinError(f"{final} exists without config.json (an unfinished copy?): move it away or delete it, "
                       "then rerun prepare")  # fmt: skip
    revision = pinned_revision(pin, first_use)
    staging = final.with_name(f".{final.name}.partial")
    remove_tree(staging, at.data)
    snapshot_download(repo_id=pin.repo, revision=revision, local_dir=str(staging), repo_type=pin.repo_type)
    try:
        done = settle(pin, revision, staging, at, first_use)
    except BaseException:
        remove_tree(staging, at.data)
        raise
    if final.exists():
        final.rmdir()  # empty (checked above)
    replace_durably(staging, final)
    record(pin, done)


def fetch_index_file(pin: Pin, file: str, final: Path, at: Layout, first_use: bool) -> None:
    """The study's index file at the pinned commit: downloaded, checked, then renamed to ``final``."""
    from huggingface_hub import hf_hub_download  # network client, only when fetching

    revision = pinned_revision(pin, first_use)
    got = Path(
        hf_hub_download(
            pin.repo, file, revision=revision, repo_type=pin.repo_type, local_dir=str(at.download)
        )
    )
    try:
        done = settle(pin, revision, at.download, at, first_use)
    except BaseException:
        got.unlink(missing_ok=True)
        raise
    replace_durably(got, final)
    record(pin, done)


def fetch_flat(pin: Pin, at: Layout, first_use: bool) -> None:
    """The Flat index's parts at the pinned commit, checked, joined and re-packed by convert-index."""
    from huggingface_hub import snapshot_download  # network client, only when fetching

    revision = pinned_revision(pin, first_use)
    snapshot_download(repo_id=pin.repo, revision=revision, local_dir=str(at.download),
                      repo_type=pin.repo_type, allow_patterns=list(pin.sha256))  # fmt: skip
    done = settle(pin, revision, at.download, at, first_use)
    flat = at.data / "wiki18" / "e5_Flat.index"
    with open(flat, "wb") as dst:
        for part in sorted(pin.sha256):
            with open(at.download / part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    run(
        [
            sys.executable,
            "-m",
            "search_env.retrieval",
            "convert-index",
            "--flat",
            str(flat),
            "--out",
            str(at.index),
        ]
    )
    record(pin, done)


def fetch(target: str, at: Layout, first_use: bool = False) -> None:
    """Download ``target`` (PinError / CalledProcessError / OSError / the hub's errors when it fails)."""
    pin = at.pin_of(target)
    if target in ("model", "encoder"):
        assert pin is not None
        fetch_snapshot(pin, getattr(at, target), at, first_use)
    elif target == "corpus":
        from huggingface_hub import snapshot_download  # network client, only when fetching

        snapshot_download(repo_id="PeterJinGo/wiki-18-corpus", local_dir=str(at.download),
                          repo_type="dataset", allow_patterns=["wiki-18.jsonl.gz"])  # fmt: skip
        partial = at.corpus.with_name(at.corpus.name + ".partial")
        with gzip.open(at.download / "wiki-18.jsonl.gz", "rb") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        replace_durably(partial, at.corpus)
    elif target == "index" and at.index_source == "study":
        assert pin is not None
        fetch_index_file(pin, STUDY_INDEX, at.index, at, first_use)
    elif target == "index":
        assert pin is not None
        fetch_flat(pin, at, first_use)
    else:
        for split in ("train", "val", "suite"):
            run([sys.executable, "-m", "search_env.data", split, "--source", "hub", "--out", str(at.parquet)])


def missing_pins_message(pins: list[Pin]) -> str:
    gaps = "; ".join(f"{p.name} ({p.repo}): {', '.join(p.unknown())}" for p in pins)
    return (
        f"refusing to download unpinned files: {gaps} unknown in {PINS_FILE}. Either fill them in (docs/gpu.md, "
        '"Pinned downloads"), or rerun with --pin-on-first-download: prepare then fetches the commit main '
        "points at now and records its sha and the files' sha256 there (trust on first use: nothing vouches "
        "for that first copy)"
    )


def unpinned_report(unknown: dict[str, Pin], missing: list[str], never: list[str]) -> str:
    """Each pin with unknown values (by target): which values, what follows, and why (its source);
    then each target of ``never`` (not pinned at all: :data:`NOT_PINNED`)."""
    lines = []
    for target, pin in unknown.items():
        if target in missing:
            effect = "downloaded only with --pin-on-first-download (trust on first use)"
        elif all(pin.sha256.values()):
            effect = "present, checked against its sha256"
        else:
            effect = "present, NOT checked: no digest to compare with"
        lines.append(
            f"  - {target} ({pin.repo}): unknown {', '.join(pin.unknown())}; {effect}\n      why: {pin.source}"
        )
    lines += [f"  - {target}: not pinned\n      why: {NOT_PINNED[target]}" for target in never]
    return f"unpinned in {PINS_FILE}:\n" + "\n".join(lines)


def verify_present(targets: list[str], at: Layout) -> list[str]:
    """Problems of present files whose pin has a digest (each file hashed once: :data:`STAMPS`)."""
    problems = []
    for target in targets:
        pin = at.pin_of(target)
        if pin is None or target == "index" and at.index_source == "flat":
            continue  # the flat parts are gone once re-packed: nothing left to check
        for file, expected in pin.sha256.items():
            path = at.index if target == "index" else getattr(at, target) / file
            if expected and path.is_file() and (actual := sha256_of(path, at.stamps)) != expected:
                problems.append(f"{target}: {path} has sha256 {actual}, its pin {expected} ({pin.repo}@"
                                f"{pin.revision}): delete it and rerun prepare, or " + UPDATE_HINT.format(pins=PINS_FILE))  # fmt: skip
    return problems


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
    parser.add_argument(
        "--pin-on-first-download",
        action="store_true",
        help="fetch a pin's unknown revision / sha256 as main is now and record them in launch/pins.json "
        "(trust on first use)",
    )
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
    try:
        pins = load_pins()
    except PinError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.chdir(REPO_ROOT)
    at = Layout(Path(os.environ.get("DATA_DIR") or "data"), source, pins)
    wanted = [t for t in TARGETS if not args.targets or "all" in args.targets or t in args.targets]
    missing = [t for t in wanted if not at.present(t)]
    problems = verify_present([t for t in wanted if t not in missing], at)
    if problems:
        print("error: present files differ from their pins:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    unknown = {t: p for t in wanted if (p := at.pin_of(t)) is not None and p.unknown()}
    never = [t for t in wanted if t in NOT_PINNED] if args.check else []
    if unknown or never:
        print(unpinned_report(unknown, missing, never), file=sys.stderr)
    if not missing:
        log(f"everything requested is present under {at.data}/")
        return 0
    unpinned = [p for t, p in unknown.items() if t in missing]
    if args.check or not online():
        if not args.check:
            log("no network access to huggingface.co: nothing downloaded")
        lines = [f"  - {t}: {at.where(t)}\n      {at.howto(t)}" for t in missing]
        print("missing (path <- command):\n" + "\n".join(lines), file=sys.stderr)
        return 1
    if unpinned and not args.pin_on_first_download:
        print(f"error: {missing_pins_message(unpinned)}", file=sys.stderr)
        return 2
    for folder in (at.data / "models", at.data / "wiki18", at.download, at.parquet):
        folder.mkdir(parents=True, exist_ok=True)
    for target in missing:
        log(f"fetching {target}")
        try:
            fetch(target, at, args.pin_on_first_download)
        except PinError as err:
            print(f"error: fetching {target}: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # noqa: BLE001 - any failure of a download: say how to do it by hand
            print(
                f"error: fetching {target} failed ({type(err).__name__}: {err}); by hand: {at.howto(target)}",
                file=sys.stderr,
            )
            return 2
    log(f"done: {' '.join(missing)}")
    return 0
