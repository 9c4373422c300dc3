"""SRC:DEST parsing and validation, and what a SRC sends (files, directories, links)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from grpo_stage.errors import StageError
from grpo_stage.paths import Mapping, check_overlaps, parse_mapping, validate_dest
from grpo_stage.sources import collect


def test_parse_mapping_splits_at_the_last_colon() -> None:
    assert parse_mapping("./my-model:models/my-model") == Mapping(Path("my-model"), "models/my-model")
    assert parse_mapping("run:2024-01-01.jsonl:datasets/p.jsonl") == Mapping(
        Path("run:2024-01-01.jsonl"), "datasets/p.jsonl"
    )
    assert parse_mapping("m:models/m/").dest == "models/m"  # one trailing slash is dropped


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no-colon", "is not SRC:DEST"),
        (":models/m", "empty SRC"),
        ("m:", "DEST is empty"),
        ("m:/", "is absolute"),
        ("m:/data/models/m", "is absolute"),
        ("m:../outside", "contains '..'"),
        ("m:models/../../etc", "contains '..'"),
        ("m:models//m", "empty or '.' part"),
        ("m:./models/m", "empty or '.' part"),
        ("m:models/m//", "empty or '.' part"),
        ("m:.grpo-stage-x", "reserved prefix"),
        ("m:.grpo-stage-manifest.json", "reserved prefix"),
    ],
)
def test_parse_mapping_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_mapping(text)


def test_validate_dest_allows_dots_inside_names() -> None:
    assert validate_dest("models/qwen2.5-0.5b/..hidden") == "models/qwen2.5-0.5b/..hidden"
    assert validate_dest(".cache") == ".cache"


def test_check_overlaps() -> None:
    check_overlaps([parse_mapping("a:models/a"), parse_mapping("b:models/ab"), parse_mapping("c:models2")])
    with pytest.raises(ValueError, match="same DEST"):
        check_overlaps([parse_mapping("a:models/a"), parse_mapping("b:models/a")])
    with pytest.raises(ValueError, match="lies inside DEST"):
        check_overlaps([parse_mapping("a:models"), parse_mapping("b:models/a")])
    with pytest.raises(ValueError, match="lies inside DEST"):
        check_overlaps([parse_mapping("b:models/a/x"), parse_mapping("a:models/a")])


def test_collect_a_directory_and_a_file(model_dir: Path, dataset_file: Path) -> None:
    entries = collect([Mapping(model_dir, "models/my-model"), Mapping(dataset_file, "datasets/prompts.jsonl")])
    names = [e.name for e in entries]
    assert names == [
        "models/my-model",
        "models/my-model/empty",
        "models/my-model/tokenizer",
        "models/my-model/config.json",
        "models/my-model/model.safetensors",
        "models/my-model/run.sh",
        "models/my-model/tokenizer/tokenizer.json",
        "datasets/prompts.jsonl",
    ]
    by_name = {e.name: e for e in entries}
    assert by_name["models/my-model/tokenizer"].is_dir
    assert by_name["models/my-model/model.safetensors"].size == 1 << 20
    assert by_name["datasets/prompts.jsonl"].source == dataset_file
    # Parents come before their children (the receiver creates directories as it goes).
    for i, entry in enumerate(entries):
        parent = entry.name.rpartition("/")[0]
        if parent.startswith("models/my-model"):
            assert parent in names[:i]


def test_collect_refuses_every_link_unless_dereference(model_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "blob"
    outside.write_bytes(b"weights")
    (model_dir / "weights.bin").symlink_to(outside)
    with pytest.raises(StageError, match=r"weights\.bin is a symbolic link to .*blob: .*regular files.*--dereference"):
        collect([Mapping(model_dir, "m")])
    (model_dir / "weights.bin").unlink()

    # The same rule for a link that stays inside the folder, and for one given as SRC.
    (model_dir / "alias.json").symlink_to("config.json")
    with pytest.raises(StageError, match=r"alias\.json is a symbolic link to .*config\.json: .*--dereference"):
        collect([Mapping(model_dir, "m")])
    (tmp_path / "linked-src").symlink_to(model_dir)
    with pytest.raises(StageError, match=r"linked-src is a symbolic link to .*my-model: .*--dereference"):
        collect([Mapping(tmp_path / "linked-src", "m")])

    (model_dir / "weights.bin").symlink_to(outside)
    entries = {e.name: e for e in collect([Mapping(tmp_path / "linked-src", "m")], dereference=True)}
    assert entries["m/weights.bin"].size == len(b"weights")
    assert entries["m/alias.json"].size == (model_dir / "config.json").stat().st_size
    assert entries["m/weights.bin"].file_id is not None and entries["m/weights.bin"].file_id.via_link
    assert entries["m/config.json"].file_id is not None and not entries["m/config.json"].file_id.via_link


def test_collect_refuses_directory_links_broken_links_and_special_files(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "sub").symlink_to("tokenizer")
    for dereference in (False, True):
        with pytest.raises(StageError, match="sub is a symbolic link to a directory"):
            collect([Mapping(model_dir, "m")], dereference=dereference)
    (model_dir / "sub").unlink()

    (model_dir / "dangling").symlink_to("nowhere")
    with pytest.raises(StageError, match=r"dangling is a symbolic link to .*nowhere"):
        collect([Mapping(model_dir, "m")])
    with pytest.raises(StageError, match="dangling is a broken symbolic link"):
        collect([Mapping(model_dir, "m")], dereference=True)
    (model_dir / "dangling").unlink()

    os.mkfifo(model_dir / "pipe")
    with pytest.raises(StageError, match="pipe is neither a regular file nor a directory"):
        collect([Mapping(model_dir, "m")])


def test_collect_names_a_missing_source(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"SRC .*nope does not exist \(argument .*nope:models/x\)"):
        collect([Mapping(tmp_path / "nope", "models/x")])
