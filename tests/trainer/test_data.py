"""The prompt dataset: formats, prompt kinds, and errors that name the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from grpo_api.models import DatasetSpec
from grpo_trainer.data import DatasetError, load_prompts


class Tokenizer:
    """Whitespace 'tokenizer' (loading a real one is covered by the server tests)."""

    chat_template = "{{ messages }}"

    def __call__(self, text: str) -> dict:
        return {"input_ids": text.split()}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list:
        return [*" ".join(m["content"] for m in messages).split(), "<assistant>"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path: Path, *, min_rows: int = 1, max_prompt_length: int | None = None, **spec) -> Dataset:
    return load_prompts(path, DatasetSpec(path=str(path), **spec), tokenizer=Tokenizer(),
                        max_prompt_length=max_prompt_length, min_rows=min_rows)


ROWS = [{"prompt": "a b c", "answer": "c"}, {"prompt": "d e", "answer": "e"}]


def test_jsonl_parquet_and_save_to_disk_load_the_same_rows(tmp_path: Path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved"))
    for path in (jsonl, tmp_path / "p.parquet", tmp_path / "saved"):
        ds = load(path)
        assert ds["prompt"] == ["a b c", "d e"] and ds["answer"] == ["c", "e"]


def test_conversational_prompts_are_kept_as_messages(tmp_path: Path):
    rows = [{"prompt": [{"role": "user", "content": "hi there"}]}]
    ds = load(write_jsonl(tmp_path / "chat.jsonl", rows), prompt_format="conversational")
    assert ds[0]["prompt"] == [{"role": "user", "content": "hi there"}]


def test_prompt_field_is_renamed_to_prompt(tmp_path: Path):
    ds = load(write_jsonl(tmp_path / "q.jsonl", [{"question": "x y"}]), prompt_field="question")
    assert ds.column_names == ["prompt"]


def test_errors_name_the_file_and_the_field(tmp_path: Path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: not valid JSON"):
        load(bad_json)
    with pytest.raises(DatasetError, match=r"no column 'question' \(dataset.promptField\); columns: prompt, answer"):
        load(write_jsonl(tmp_path / "p.jsonl", ROWS), prompt_field="question")
    with pytest.raises(DatasetError, match=r"n.jsonl line 2: prompt must be a string or a list"):
        load(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "x"}, {"prompt": 3}]))
    with pytest.raises(DatasetError, match=r"promptFormat is conversational but prompts are plain"):
        load(write_jsonl(tmp_path / "p2.jsonl", ROWS), prompt_format="conversational")
    with pytest.raises(DatasetError, match=r"dataset.path .* does not exist"):
        load(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match=r"2 usable prompts, but one step needs 4"):
        load(write_jsonl(tmp_path / "p3.jsonl", ROWS), min_rows=4)


def test_prompts_longer_than_max_prompt_length_are_dropped(tmp_path: Path):
    ds = load(write_jsonl(tmp_path / "p.jsonl", ROWS), max_prompt_length=2)
    assert ds["prompt"] == ["d e"]
