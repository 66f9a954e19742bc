"""``python -m launch prepare``'s pinned downloads, with the hub's download functions replaced by
fakes that write small local files (no network): every fetch names the pinned commit, a file whose
sha256 differs from its pin is refused and nothing lands at the final path, an unknown pin refuses
the download with the fix named, and --pin-on-first-download records what it fetched
(docs/gpu.md, "Pinned downloads")."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import huggingface_hub
import pytest

from launch import prepare

WEIGHTS = b"safetensors bytes of a pinned model"
INDEX = b"faiss bytes of the study's index"
REV_A = "a" * 40
REV_MAIN = "b" * 40


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeHub:
    """snapshot_download / hf_hub_download / resolve_revision stand-ins: they write `files` (path in
    repo -> bytes) under local_dir and keep every call's keyword arguments."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.calls: list[dict] = []

    def snapshot_download(self, **kw) -> str:
        self.calls.append(kw)
        local = Path(kw["local_dir"])
        for name, data in {"config.json": b"{}", **self.files}.items():
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(data)
        return str(local)

    def hf_hub_download(self, repo_id: str, filename: str, **kw) -> str:
        self.calls.append({"repo_id": repo_id, "filename": filename, **kw})
        path = Path(kw["local_dir"]) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.files[filename])
        return str(path)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """DATA_DIR and a pins file in tmp_path, huggingface.co 'online', the hub replaced by a FakeHub."""

    def setup(pins: dict, files: dict[str, bytes]) -> FakeHub:
        pins_file = tmp_path / "pins.json"
        pins_file.write_text(json.dumps({"_doc": "test pins", **pins}, indent=2))
        monkeypatch.setattr(prepare, "PINS_FILE", pins_file)
        monkeypatch.setattr(prepare, "online", lambda timeout_s=5.0: True)
        monkeypatch.setattr(prepare, "resolve_revision", lambda repo, repo_type: REV_MAIN)
        monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
        monkeypatch.delenv("INDEX_SOURCE", raising=False)
        hub = FakeHub(files)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
        return hub

    return setup


def pin(repo: str, revision: str | None, digests: dict[str, str | None], kind: str = "model") -> dict:
    return {"repo": repo, "repo_type": kind, "revision": revision, "sha256": digests, "source": "test"}


def test_encoder_is_fetched_at_its_pinned_commit_and_checked(env, tmp_path) -> None:
    hub = env({"encoder": pin("intfloat/e5-base-v2", REV_A, {"model.safetensors": sha(WEIGHTS)})},
              {"model.safetensors": WEIGHTS})  # fmt: skip
    assert prepare.main(["encoder"]) == 0
    assert [c["revision"] for c in hub.calls] == [REV_A]
    assert hub.calls[0]["repo_id"] == "intfloat/e5-base-v2"
    final = tmp_path / "data" / "models" / "e5-base-v2"
    assert (final / "model.safetensors").read_bytes() == WEIGHTS and (final / "config.json").is_file()
    assert not (final.parent / ".e5-base-v2.partial").exists()
    # a second run finds it present and checks it against the pin from the stamp (no download)
    assert prepare.main(["encoder"]) == 0 and len(hub.calls) == 1


def test_study_index_is_fetched_at_its_pinned_commit(env, tmp_path) -> None:
    hub = env({"index": pin(prepare.STUDY_REPO, REV_A, {prepare.STUDY_INDEX: sha(INDEX)}, "dataset")},
              {prepare.STUDY_INDEX: INDEX})  # fmt: skip
    assert prepare.main(["index"]) == 0
    assert hub.calls[0]["revision"] == REV_A and hub.calls[0]["repo_type"] == "dataset"
    assert (tmp_path / "data" / "wiki18" / "e5_IVF4096_SQ8.index").read_bytes() == INDEX


def test_a_digest_mismatch_refuses_and_installs_nothing(env, tmp_path, capsys) -> None:
    expected = sha(b"the weights the pin vouches for")
    env({"model": pin("Qwen/Qwen3.5-0.8B", REV_A, {"model.safetensors": expected}),
         "index": pin(prepare.STUDY_REPO, REV_A, {prepare.STUDY_INDEX: sha(b"other")}, "dataset")},
        {"model.safetensors": WEIGHTS, prepare.STUDY_INDEX: INDEX})  # fmt: skip
    assert prepare.main(["model"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and expected in err and sha(WEIGHTS) in err
    assert "update the pin" in err and "pins.json" in err and "Pinned downloads" in err
    models = tmp_path / "data" / "models"
    assert not (models / "Qwen3.5-0.8B").exists() and not (models / ".Qwen3.5-0.8B.partial").exists()

    assert prepare.main(["index"]) == 2
    err = capsys.readouterr().err
    assert prepare.STUDY_INDEX in err and sha(INDEX) in err
    wiki = tmp_path / "data" / "wiki18"
    assert not (wiki / "e5_IVF4096_SQ8.index").exists()
    assert not (wiki / "download" / prepare.STUDY_INDEX).exists()


def test_an_unknown_pin_refuses_before_downloading(env, tmp_path, capsys) -> None:
    hub = env({"model": pin("Qwen/Qwen3.5-0.8B", REV_A, {"model.safetensors": None}),
               "index": pin(prepare.STUDY_REPO, None, {prepare.STUDY_INDEX: None}, "dataset")},
              {"model.safetensors": WEIGHTS, prepare.STUDY_INDEX: INDEX})  # fmt: skip
    assert prepare.main(["model", "index"]) == 2
    err = capsys.readouterr().err
    assert "sha256 of model.safetensors" in err and "index (pantomiman/reason-over-search): revision" in err
    assert "--pin-on-first-download" in err and "Pinned downloads" in err
    assert hub.calls == [] and not (tmp_path / "data" / "models" / "Qwen3.5-0.8B").exists()
    assert prepare.main(["--check", "model"]) == 1
    err = capsys.readouterr().err
    assert "model (Qwen/Qwen3.5-0.8B): unknown sha256 of model.safetensors; downloaded only with" in err
    assert "why: test" in err


def test_pin_on_first_download_records_what_it_fetched(env, tmp_path, capsys) -> None:
    hub = env({"model": pin("Qwen/Qwen3.5-0.8B", REV_A, {"model.safetensors": None}),
               "index": pin(prepare.STUDY_REPO, None, {prepare.STUDY_INDEX: None}, "dataset")},
              {"model.safetensors": WEIGHTS, prepare.STUDY_INDEX: INDEX})  # fmt: skip
    assert prepare.main(["model", "index", "--pin-on-first-download"]) == 0
    assert [c["revision"] for c in hub.calls] == [REV_A, REV_MAIN]  # a known revision is kept
    saved = json.loads((tmp_path / "pins.json").read_text())
    assert saved["_doc"] == "test pins"
    assert saved["model"]["revision"] == REV_A
    assert saved["model"]["sha256"] == {"model.safetensors": sha(WEIGHTS)}
    assert saved["index"]["revision"] == REV_MAIN
    assert saved["index"]["sha256"] == {prepare.STUDY_INDEX: sha(INDEX)}
    assert "TRUST ON FIRST USE" in capsys.readouterr().err
    assert prepare.load_pins()["index"].unknown() == []


def test_a_present_file_that_differs_from_its_pin_is_reported(env, tmp_path, capsys) -> None:
    env({"encoder": pin("intfloat/e5-base-v2", REV_A, {"model.safetensors": sha(WEIGHTS)})}, {})
    folder = tmp_path / "data" / "models" / "e5-base-v2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"tampered")
    assert prepare.main(["encoder"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and sha(b"tampered") in err and sha(WEIGHTS) in err


def test_malformed_pins_are_refused_naming_the_key(env, capsys) -> None:
    env({"encoder": pin("intfloat/e5-base-v2", "main", {"model.safetensors": None})}, {})
    assert prepare.main(["encoder"]) == 2
    assert "encoder.revision='main': must be a 40-hex commit sha" in capsys.readouterr().err


def test_a_verified_file_is_hashed_once_and_again_after_any_change(tmp_path, monkeypatch) -> None:
    """The stamp reuses a digest while the file is unchanged; a same-size rewrite with its mtime set
    back (the ctime moves), or a change of its first or last MiB, is hashed again."""
    path, stamps = tmp_path / "f.bin", tmp_path / "stamps.json"
    path.write_bytes(b"one")
    first = prepare.sha256_of(path, stamps)
    assert first == sha(b"one")
    hashed = []
    opened = open

    def counting_open(file, mode="r", *args, **kwargs):
        if mode == "rb" and Path(file) == path:
            hashed.append(1)
        return opened(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert prepare.sha256_of(path, stamps) == first and len(hashed) == 1  # the fingerprint only
    st = path.stat()
    path.write_bytes(b"two")  # same size, mtime restored: only ctime and content differ
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare.sha256_of(path, stamps) == sha(b"two")
    monkeypatch.undo()

    big = tmp_path / "big.bin"
    body = bytearray(os.urandom(3 << 20))
    big.write_bytes(body)
    assert prepare.sha256_of(big, stamps) == sha(bytes(body))
    for where in (0, len(body) // 2, len(body) - 1):  # head, middle (ctime), tail
        time.sleep(0.03)  # past the kernel's timestamp tick (a jiffy), so the write moves the ctime
        st = big.stat()
        body[where] ^= 0xFF
        with open(big, "r+b") as f:
            f.seek(where)
            f.write(body[where : where + 1])
        os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert big.stat().st_size == st.st_size and big.stat().st_mtime_ns == st.st_mtime_ns
        assert prepare.sha256_of(big, stamps) == sha(bytes(body)), where


def test_a_tampered_present_file_with_its_mtime_restored_is_reported(env, tmp_path, capsys) -> None:
    env({"encoder": pin("intfloat/e5-base-v2", REV_A, {"model.safetensors": sha(WEIGHTS)})},
        {"model.safetensors": WEIGHTS})  # fmt: skip
    assert prepare.main(["encoder"]) == 0  # downloaded, checked, its digest stamped
    weights = tmp_path / "data" / "models" / "e5-base-v2" / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(WEIGHTS.upper())  # same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare.main(["encoder"]) == 2
    assert sha(WEIGHTS.upper()) in capsys.readouterr().err


def test_check_names_every_unknown_pin_and_why_even_when_present(env, tmp_path, capsys) -> None:
    env({"model": pin("Qwen/Qwen3.5-0.8B", REV_A, {"model.safetensors": None}),
         "encoder": pin("intfloat/e5-base-v2", REV_A, {"model.safetensors": sha(WEIGHTS)})}, {})  # fmt: skip
    for name in ("Qwen3.5-0.8B", "e5-base-v2"):
        folder = tmp_path / "data" / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(WEIGHTS)
    assert prepare.main(["--check", "model", "encoder"]) == 0
    err = capsys.readouterr().err
    assert "model (Qwen/Qwen3.5-0.8B): unknown sha256 of model.safetensors; present, NOT checked" in err
    assert "why: test" in err and "encoder" not in err.split("everything requested")[0]


def test_the_shipped_pins_are_well_formed() -> None:
    """launch/pins.json: every download prepare pins has an entry, and what is known is well formed."""
    pins = prepare.load_pins()
    assert {"model", "encoder", "index", "flat_index"} <= set(pins)
    assert pins["index"].repo == prepare.STUDY_REPO and prepare.STUDY_INDEX in pins["index"].sha256
    assert pins["encoder"].revision and all(pins["encoder"].sha256.values())
    assert pins["model"].revision


def test_check_and_the_docs_say_exactly_which_shipped_pins_are_unknown(capsys, monkeypatch, tmp_path) -> None:
    """With no hub access here, the model's sha256 and the index's revision and sha256 stay unknown:
    `prepare --check` names exactly those with why, and docs/gpu.md's pin table says "unknown" where
    launch/pins.json has null."""
    pins = prepare.load_pins()
    unknown = {name: p.unknown() for name, p in pins.items() if p.unknown()}
    assert unknown == {
        "model": ["sha256 of model.safetensors-00001-of-00001.safetensors"],
        "index": ["revision", f"sha256 of {prepare.STUDY_INDEX}"],
        "flat_index": ["revision", "sha256 of part_aa", "sha256 of part_ab"],
    }
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("INDEX_SOURCE", raising=False)
    assert prepare.main(["--check", "model", "encoder", "index"]) == 1
    err = capsys.readouterr().err
    assert "model (Qwen/Qwen3.5-0.8B): unknown sha256 of model.safetensors-00001-of-00001.safetensors" in err
    assert f"index ({prepare.STUDY_REPO}): unknown revision, sha256 of {prepare.STUDY_INDEX}" in err
    assert err.count("why: ") == 2 and "encoder (" not in err
    assert prepare.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "corpus: not pinned\n      why: PeterJinGo/wiki-18-corpus" in err
    assert "data: not pinned\n      why: RUC-NLPIR/FlashRAG_datasets" in err
    table = (prepare.REPO_ROOT / "docs" / "gpu.md").read_text()
    for name, p in pins.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}`"))
        revision, digests = row.split("|")[2:4]
        assert ("unknown" in revision) == (p.revision is None), row
        assert ("unknown" in digests) == (None in p.sha256.values()), row
