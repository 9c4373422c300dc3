"""Dataset files and reward configuration as a hostile stranger writes them: each must end as InvalidSpec naming
the file, line or field before any training (or, for a reward's output, as a failure naming the function), never
as a bare traceback the executor retries as transient, a hang, or silent training on garbage."""

from __future__ import annotations

import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_api.models import DatasetSpec, RewardSpec
from grpo_api.prepare_protocol import EXIT_PERMANENT, latest_event
from grpo_api.sources import ResolvedSources
from grpo_trainer import data
from grpo_trainer.data import DatasetError, load_prompts
from grpo_trainer.errors import RewardFunctionFailed
from grpo_trainer.rewards import RewardConfigError, RewardContext, build_rewards
from tests.fixtures.prepare_cli import invoke, spec_with, write_config
from tests.fixtures.tokenizers import Tokenizer

# --------------------------------------------------------------------------------------------------- dataset


def load(path: Path, **spec: Any) -> Any:
    return load_prompts(path, DatasetSpec(path=str(path), **spec), tokenizer=Tokenizer(), max_prompt_length=None,
                        min_rows=1)


def test_a_line_nested_too_deeply_is_invalid_spec_naming_the_line(tmp_path: Path) -> None:
    # json.loads raises RecursionError (not a ValueError): it escaped read_dataset as a bare traceback, which the
    # trainer exits 1 on (transient: retried with a fresh server).
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} line 2: nested too deeply"):
        load(path)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    filler = "".join(f'{{"prompt": "row {i} {"x" * 200}"}}\n' for i in range(100)).encode()  # > one 8 KiB chunk
    path.write_bytes(filler + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} line 101: not UTF-8 text"):
        load(path)


def test_a_fifo_is_refused_instead_of_blocking_the_initializer(tmp_path: Path) -> None:
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            load(fifo)
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked in open(): a writer that closes at once lets it finish
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("loading a FIFO blocked waiting for a writer")
    assert len(outcome) == 1 and isinstance(outcome[0], DatasetError), outcome
    assert str(outcome[0]) == f"spec.dataset.path: {fifo} is not a regular file"


def test_an_enormous_line_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    # A sparse file costs its writer no disk: without a bound, one line of it is read into memory until the
    # initializer is OOM-killed (exit 137: retried).
    path = tmp_path / "huge.jsonl"
    path.write_text('{"prompt": "ok"}\n')
    os.truncate(path, path.stat().st_size + data.MAX_LINE_BYTES + 1)
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} line 2 is longer than "):
        load(path)


def test_rows_with_different_fields_read_as_load_dataset_json_reads_them(tmp_path: Path) -> None:
    """Dataset.from_list takes its columns from the first row: a later row's extra field vanished silently.
    As `load_dataset("json")` (what a TRL user loads JSONL with), every row's fields are columns and a row
    without one has null there; exact_match gives such a row no reward, not a comparison with "None"."""
    from datasets import load_dataset

    from grpo_trainer.rewards import exact_match

    path = tmp_path / "ragged.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n{"prompt": "c", "hint": "x"}\n')
    got = load(path)
    want = load_dataset("json", data_files=str(path), split="train")
    assert got.column_names == want.column_names == ["prompt", "answer", "hint"]
    assert got.to_list() == want.to_list()
    assert got["answer"] == ["1", None, None]
    assert exact_match(["1", "None", "c"], answer=got["answer"]) == [1.0, None, None]


def test_an_empty_prompt_is_refused_naming_the_line_or_row(tmp_path: Path) -> None:
    # "" tokenizes to no ids with a tokenizer that adds no BOS (Qwen's); the server refuses an empty prompt (400),
    # which fails the attempt as transient whenever that row is drawn, possibly hundreds of steps in.
    path = tmp_path / "blank.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(DatasetError, match=rf"^spec\.dataset\.promptField: {path} line 2: the prompt is empty"):
        load(path)
    parquet = tmp_path / "blank.parquet"
    pq.write_table(pa.table({"prompt": ["a", "  \n"]}), parquet)
    with pytest.raises(DatasetError, match=rf"^spec\.dataset\.promptField: {parquet} row 1: the prompt is empty"):
        load(parquet)


@pytest.mark.parametrize("column", ["completions", "prompts", "trainer_state", "log_metric"])
def test_a_column_named_like_an_argument_trl_passes_itself_is_refused(tmp_path: Path, column: str) -> None:
    # TRL calls reward_func(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
    # log_metric=): a "completions" column raised TypeError (multiple values) inside TRL at the first step, a
    # "trainer_state" column was silently replaced by TRL's object.
    path = tmp_path / "clash.jsonl"
    path.write_text(f'{{"prompt": "a", "{column}": "x"}}\n')
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} has a column {column!r}"):
        load(path)


@pytest.mark.parametrize(
    ("dict_dir", "file", "content"),
    [
        (False, "state.json", "[]"),
        (False, "state.json", '{"_data_files": [{}]}'),
        (False, "dataset_info.json", "[]"),
        (True, "dataset_dict.json", '{"splits": 5}'),
    ],
    ids=["state a list", "data file without a name", "info a list", "splits a number"],
)
def test_save_to_disk_metadata_of_the_wrong_shape_is_invalid_spec(
    tmp_path: Path, dict_dir: bool, file: str, content: str
) -> None:
    # load_from_disk indexes the JSON it reads as it expects it: TypeError, KeyError or AttributeError escaped
    # read_dataset (it caught OSError and ValueError only), a bare traceback the trainer exits 1 on.
    from datasets import Dataset, DatasetDict

    saved = tmp_path / "saved"
    rows = Dataset.from_list([{"prompt": "a b"}])
    (DatasetDict({"train": rows}) if dict_dir else rows).save_to_disk(str(saved))
    (saved / file).write_text(content)
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {saved}: cannot read as arrow: "):
        load(saved)


# --------------------------------------------------------------------------------------------------- prepare


def test_prepare_checks_the_prompts_every_trainer_process_needs(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 nodes × 4 processes × (32 / 2) prompts = 128 per step; the dataset has 64. The trainer refuses it
    # (runner: generation_batch_size × world_size / num_generations), so the initializer must too, before any
    # server starts.
    monkeypatch.setenv("GRPO_TERMINATION_LOG", str(tmp_path / "termination-log"))
    spec = {**spec_with(), "trainer": {"numNodes": 2, "numProcPerNode": 4, "perDeviceBatchSize": 32,
                                       "numGenerations": 2}}
    config = write_config(tmp_path, spec, ResolvedSources(model_dir=str(tiny_model_dir),
                                                           dataset_path=str(tiny_dataset)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.kind == "failed"
    assert event.message.startswith(f"spec.dataset: {tiny_dataset} has 64 usable prompts, but one step needs 128")


# --------------------------------------------------------------------------------------------------- rewards


CTX = RewardContext(max_completion_length=10, dataset_columns=("prompt", "answer"))


def build(*specs: dict[str, Any], paths: list[Path] | None = None) -> list[Any]:
    funcs, _ = build_rewards([RewardSpec.model_validate(s) for s in specs], CTX, paths or [])
    return funcs


def call(func: Any, completions: list[Any]) -> Any:
    """As TRL 1.x calls a reward function."""
    n = len(completions)
    return func(prompts=["p"] * n, completions=completions, completion_ids=[[1]] * n, answer=["a"] * n,
                trainer_state=None, log_extra=None, log_metric=None)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"function": "regex_match", "args": {"pattern": "a", "fullmatch": "false"}}, "fullmatch"),  # was True
        ({"function": "exact_match", "args": {"strip": "no"}}, "strip"),  # was True
        ({"function": "regex_match", "args": {"pattern": None}}, "pattern"),  # was the regex "None"
        ({"function": "regex_match", "args": {"pattern": ["a", "b"]}}, "pattern"),  # was "['a', 'b']"
    ],
    ids=["fullmatch string", "strip string", "pattern null", "pattern list"],
)
def test_builtin_args_of_the_wrong_type_are_refused_not_coerced(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(RewardConfigError, match=rf"^spec\.rewards\[0\]\.args\.{field} must be "):
        build(spec)


def unique_module() -> str:
    return f"hostile_rewards_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize(
    ("source", "args", "reason"),
    [
        ("def score(completions):\n    return [0.0] * len(completions)\n", {},
         "got an unexpected keyword argument 'prompts'"),
        ("def score(prompts, completions, completion_ids, answer, trainer_state):\n    return [0.0]\n", {},
         "got an unexpected keyword argument 'log_extra'"),
        ("def score(completions, scale, **kwargs):\n    return [scale] * len(completions)\n", {},
         "missing a required argument: 'scale'"),
        ("def score(prompts, completions, completion_ids, answer, trainer_state, log_extra, log_metric, scale=1):\n"
         "    return [scale] * len(completions)\n", {"scael": 2}, "got an unexpected keyword argument 'scael'"),
    ],
    ids=["no **kwargs", "misses one of TRL's arguments", "required arg not in args", "misspelt arg"],
)
def test_a_user_function_trl_cannot_call_is_refused_when_built(
    tmp_path: Path, source: str, args: dict[str, Any], reason: str
) -> None:
    # These failed only at the first step's reward call, as RewardFunctionFailed: exit 1, retried with a fresh
    # server until backoffLimit, although no retry can fix them.
    module = unique_module()
    (tmp_path / f"{module}.py").write_text(source)
    with pytest.raises(RewardConfigError, match=rf"^spec\.rewards\[0\]\.function '{module}:score': .*{reason}"):
        build({"function": f"{module}:score", "args": args}, paths=[tmp_path])


@pytest.mark.parametrize("function", ["os:system", "json:loads", "builtins:print"])
def test_a_stdlib_function_is_refused_when_built(function: str) -> None:
    with pytest.raises(RewardConfigError, match=rf"^spec\.rewards\[0\]\.function {function!r}: "):
        build({"function": function})


@pytest.mark.parametrize("arg", ["answer", "completions", "trainer_state"])
def test_args_the_trainer_passes_on_every_call_are_refused(tmp_path: Path, arg: str) -> None:
    # functools.partial's keyword is replaced by the call's: the spec's value was silently ignored.
    module = unique_module()
    (tmp_path / f"{module}.py").write_text("def score(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardConfigError, match=rf"^spec\.rewards\[0\]\.args\.{arg}: "):
        build({"function": f"{module}:score", "args": {arg: "x"}}, paths=[tmp_path])


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ('["0.5", 1.0]', r"returned '0\.5' \(str\) at 0"),
        ("[1.0, 1j]", r"returned 1j \(complex\) at 1"),
        ("[math.inf, 0.0]", r"returned inf \(float\) at 0"),
        ("[0.0, [1.0]]", r"returned \[1\.0\] \(list\) at 1"),
    ],
    ids=["string", "complex", "inf", "nested list"],
)
def test_a_reward_that_is_not_a_finite_number_fails_naming_the_function(
    tmp_path: Path, values: str, expected: str
) -> None:
    # Strings and complex numbers raised inside TRL's torch.tensor() (outside the wrapper: no function named);
    # inf trained on: every advantage of its group became NaN.
    module = unique_module()
    (tmp_path / f"{module}.py").write_text(f"import math\n\ndef score(completions, **kwargs):\n    return {values}\n")
    (func,) = build({"function": f"{module}:score"}, paths=[tmp_path])
    with pytest.raises(RewardFunctionFailed, match=rf"^reward function '{module}:score' {expected}"):
        call(func, ["x", "y"])


def test_none_and_nan_stay_what_trl_takes_as_no_reward(tmp_path: Path) -> None:
    module = unique_module()
    (tmp_path / f"{module}.py").write_text(
        "import math\n\ndef score(completions, **kwargs):\n    return [None, math.nan, True, 2]\n"
    )
    (func,) = build({"function": f"{module}:score"}, paths=[tmp_path])
    out = call(func, ["a", "b", "c", "d"])
    assert out[0] is None and math.isnan(out[1]) and out[2:] == [1.0, 2.0]


def test_a_byte_order_mark_is_skipped_as_load_dataset_json_skips_it(tmp_path: Path) -> None:
    from datasets import load_dataset

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load(path)["prompt"] == ["a", "b"] == load_dataset("json", data_files=str(path), split="train")["prompt"]
    path.write_bytes(b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n')  # only a file's first bytes may be one
    with pytest.raises(DatasetError, match=rf"^spec\.dataset: {path} line 2: not valid JSON"):
        load(path)
