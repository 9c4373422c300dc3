"""The prompt dataset: formats, prompt kinds, and errors that name the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from grpo_api.models import DatasetSpec
from grpo_trainer.data import DatasetError, load_prompts
from tests.fixtures.tokenizers import Tokenizer


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


def test_errors_name_the_field_the_file_and_the_line(tmp_path: Path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {bad_json} line 2: not valid JSON"):
        load(bad_json)
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.promptField: .*p\.jsonl line 1 has no field 'question'; "
                                           r"its fields: prompt, answer$"):
        load(write_jsonl(tmp_path / "p.jsonl", ROWS), prompt_field="question")
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.promptField: .*n\.jsonl line 2: prompt must be a string"):
        load(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "x"}, {"prompt": 3}]))
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.promptFormat is conversational but the prompts of "
                                           r".*p2\.jsonl are plain$"):
        load(write_jsonl(tmp_path / "p2.jsonl", ROWS), prompt_format="conversational")
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.path: .*missing\.jsonl does not exist$"):
        load(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match=r"^spec\.dataset: .*p3\.jsonl has 2 usable prompts, but one step needs 4"):
        load(write_jsonl(tmp_path / "p3.jsonl", ROWS), min_rows=4)
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.format: cannot tell the format of .*p\.txt"):
        load(write_jsonl(tmp_path / "p.txt", ROWS))


def test_a_line_without_the_prompt_field_is_named_by_its_number(tmp_path: Path):
    # Dataset.from_list takes its columns from the first row: a row missing the prompt must not slip through.
    path = write_jsonl(tmp_path / "gap.jsonl", [ROWS[0], {"answer": "e"}, ROWS[1]])
    with pytest.raises(DatasetError, match=r"gap\.jsonl line 2 has no field 'prompt'; its fields: answer$"):
        load(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["no bytes", "blank lines"])
def test_an_empty_jsonl_file_is_called_empty_not_missing_a_column(tmp_path: Path, content: str):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} is empty: no rows to train on$"):
        load(path)


def test_a_parquet_file_without_rows_is_called_empty(tmp_path: Path):
    Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(DatasetError, match=r"none\.parquet is empty: no rows to train on$"):
        load(tmp_path / "none.parquet")


def test_a_parquet_file_without_the_prompt_column_names_the_columns(tmp_path: Path):
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.promptField: .*p\.parquet has no column 'question'; "
                                           r"columns: prompt, answer$"):
        load(tmp_path / "p.parquet", prompt_field="question")


def test_prompts_longer_than_max_prompt_length_are_dropped(tmp_path: Path):
    ds = load(write_jsonl(tmp_path / "p.jsonl", ROWS), max_prompt_length=2)
    assert ds["prompt"] == ["d e"]


# --------------------------------------------------------------- a dataset repository, by config and split


def write_repository(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def gsm8k_like(n: int = 6) -> dict[str, dict[str, list[dict]]]:
    return {
        "main": {"train": [{"prompt": f"main q{i}", "answer": str(i)} for i in range(n)],
                 "test": [{"prompt": f"main t{i}", "answer": str(i)} for i in range(2)]},
        "socratic": {"train": [{"prompt": f"socratic q{i}", "answer": str(i)} for i in range(n)]},
    }


def repo_spec(root: Path, **spec) -> DatasetSpec:
    return DatasetSpec(source="hf://openai/gsm8k@main", **spec)


def read(root: Path, **spec) -> Dataset:
    return load_prompts(root, repo_spec(root, **spec), tokenizer=Tokenizer(), max_prompt_length=None, min_rows=1)


@pytest.mark.parametrize(("config", "split"), [("main", "train"), ("main", "test"), ("socratic", "train")])
def test_a_sharded_repository_loads_the_rows_load_dataset_loads_for_its_config_and_split(
    tmp_path: Path, config: str, split: str
):
    from datasets import load_dataset

    from tests.fixtures.hub import sharded_dataset_files

    root = write_repository(tmp_path / "repo", sharded_dataset_files(gsm8k_like()))
    expected = load_dataset(str(root), config, split=split, cache_dir=str(tmp_path / "cache"))
    assert read(root, config=config, split=split).to_list() == expected.to_list()
    assert len(expected) == len(gsm8k_like()[config][split])


def test_split_names_come_from_the_file_names_without_a_readme_config(tmp_path: Path):
    from datasets import load_dataset

    from tests.fixtures.hub import sharded_dataset_files

    root = write_repository(tmp_path / "repo", sharded_dataset_files({"default": gsm8k_like()["main"]},
                                                                     readme_configs=False))
    assert sorted(p.name for p in (root / "data").iterdir())[0] == "test-00000-of-00002.parquet"
    for split in ("train", "test"):
        expected = load_dataset(str(root), split=split, cache_dir=str(tmp_path / "cache")).to_list()
        assert read(root, split=split).to_list() == expected


def test_an_unknown_config_a_missing_split_or_no_config_of_several_fail_naming_the_field_and_the_source(
    tmp_path: Path
):
    from tests.fixtures.hub import sharded_dataset_files

    root = write_repository(tmp_path / "repo", sharded_dataset_files(gsm8k_like()))
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.config: hf://openai/gsm8k@main .* has no config "
                                           r"'nope'; configs: main, socratic$"):
        read(root, config="nope")
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.split: hf://openai/gsm8k@main .* has no split "
                                           r"'validation' in config 'main'; splits: train, test$"):
        read(root, config="main", split="validation")
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.config: hf://openai/gsm8k@main .* has several configs "
                                           r"and no default; name one of main, socratic$"):
        read(root)


def test_a_config_of_a_file_or_a_saved_dataset_is_refused_naming_the_field(tmp_path: Path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.config: .*p\.jsonl is a jsonl dataset"):
        load(jsonl, config="main")
