"""Dataset preparation on the real fixture rows; the parquet loads in verl's RLHFDataset."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset

from search_env import data, protocol
from search_env.benchmarks import STUDY_SUITE
from search_env.paths import REPO_ROOT

SAMPLES = REPO_ROOT / "assets" / "eval_samples"
R1 = SAMPLES / "r1-searcher-evalset"


def _lines(path: Path, start: int, stop: int) -> str:
    return "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[start:stop])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A FlashRAG-layout folder made of fixture rows (both schemas; splits overlap on purpose)."""
    root = tmp_path_factory.mktemp("flashrag")
    hotpot, wiki, musique = R1 / "hotpotqa_500.jsonl", R1 / "2wiki_500.jsonl", R1 / "musique_500.jsonl"
    layout = {
        "nq/test": (SAMPLES / "flashrag-quickstart" / "nq_test.jsonl").read_text(encoding="utf-8"),
        "triviaqa/test": _lines(wiki, 0, 100),
        "popqa/test": _lines(hotpot, 0, 100),
        "hotpotqa/dev": _lines(hotpot, 100, 200),
        "2wikimultihopqa/dev": _lines(wiki, 100, 200),
        "musique/dev": _lines(musique, 0, 100),
        "bamboogle/test": (R1 / "bamboogle.flashrag.jsonl").read_text(encoding="utf-8"),
        "musique/train": _lines(musique, 100, 500),
        "nq/train": _lines(hotpot, 0, 500),
        "triviaqa/train": _lines(wiki, 0, 500),
        "hotpotqa/train": _lines(hotpot, 0, 500),
        "2wikimultihopqa/train": _lines(wiki, 0, 500),
    }
    for name, text in layout.items():
        (root / f"{name}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.jsonl").write_text(text, encoding="utf-8")
    return root


def test_both_schemas_parse():
    flashrag = data.parse_row({"id": "test_0", "question": "q", "golden_answers": ["a", "b"]}, "x")
    r1 = data.parse_row({"idx": 1, "question": "q", "answer": "a", "gen_text_store": ""}, "x")
    assert (flashrag.id, flashrag.golds, r1.id, r1.golds) == ("test_0", ["a", "b"], "1", ["a"])
    with pytest.raises(ValueError, match="golden_answers"):
        data.parse_row({"id": 1, "question": "q"}, "f.jsonl:3")
    with pytest.raises(ValueError, match="'question'"):
        data.parse_row({"id": 1, "question": " ", "answer": "a"}, "f.jsonl:3")


def test_train_command_and_count_warning(source, tmp_path, capsys, tiny_model_dir):
    data.main(["train", "--source", str(source), "--out", str(tmp_path)])
    assert "WARNING: musique/train: expected 19938 rows, got 400" in capsys.readouterr().err
    frame = pd.read_parquet(tmp_path / "musique_train.parquet")
    assert len(frame) == 400 and set(frame["agent_name"]) == {"search_agent"}
    first = frame.iloc[0]
    assert first["data_source"] == "musique"
    assert list(first["reward_model"]["ground_truth"]["target"]) == [
        json.loads(_lines(R1 / "musique_500.jsonl", 100, 101))["answer"]
    ]
    assert (
        first["prompt"][0]["content"]
        == protocol.build_messages(first["extra_info"]["question"])[0]["content"]
    )

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = OmegaConf.create(
        {
            "max_prompt_length": 1024,
            "filter_overlong_prompts": True,
            "apply_chat_template_kwargs": protocol.CHAT_TEMPLATE_KWARGS,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    dataset = RLHFDataset(data_files=[str(tmp_path / "musique_train.parquet")], tokenizer=tok, config=config)
    assert len(dataset) == 400
    item = dataset[3]
    assert item["index"] == 3 and item["agent_name"] == "search_agent"
    assert item["tools_kwargs"] == {"search": {"create_kwargs": {"id": "104"}}}
    assert item["raw_prompt"][0]["role"] == "user"


def test_suite_command_writes_parquet_and_eval_jsonl(source, tmp_path, capsys):
    data.main(["suite", "--source", str(source), "--out", str(tmp_path), "--limit", "50"])
    err = capsys.readouterr().err
    assert "WARNING: nq/test: expected 50 rows, got 17" in err
    assert "bamboogle" not in err  # 125 >= 50: the cap is met
    for bench in STUDY_SUITE:
        assert (tmp_path / "suite" / f"{bench.key}.parquet").is_file()
    bamboogle = [
        json.loads(line) for line in (tmp_path / "suite" / "bamboogle.jsonl").read_text().splitlines()
    ]
    assert len(bamboogle) == 50
    assert bamboogle[0] == {
        "id": "test_0",
        "question": "Who was president of the United States in the year that Citibank was founded?",
        "golden_answers": ["james madison"],
    }


def test_validation_split_is_disjoint_and_deterministic(source, tmp_path):
    data.main(["val", "--source", str(source), "--out", str(tmp_path / "a"), "--per-dataset", "20"])
    data.main(["val", "--source", str(source), "--out", str(tmp_path / "b"), "--per-dataset", "20"])
    a = pd.read_parquet(tmp_path / "a" / "val.parquet")
    assert a.equals(pd.read_parquet(tmp_path / "b" / "val.parquet"))
    assert a["data_source"].value_counts().to_dict() == dict.fromkeys(data.VAL_DATASETS, 20)
    taken = {data.question_key(q) for q in a["extra_info"].map(lambda e: e["question"])}
    assert len(taken) == 80
    forbidden = {data.question_key(r.question) for r in data.load_split(str(source), "musique", "train")}
    for bench in STUDY_SUITE:
        forbidden |= {
            data.question_key(r.question) for r in data.load_split(str(source), bench.key, bench.split)
        }
    assert not taken & forbidden


def test_convert_and_offline_hub_error(tmp_path, monkeypatch):
    out = tmp_path / "bamboogle.parquet"
    data.main(
        ["convert", "--input", str(R1 / "bamboogle.jsonl"), "--data-source", "bamboogle", "--out", str(out)]
    )
    assert len(pd.read_parquet(out)) == 125
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="--source DIR"):
        data.load_split("hub", "nq", "test")
