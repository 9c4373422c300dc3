"""The prompt dataset: a jsonl or parquet file, a `save_to_disk` directory, or a directory laid out as a hub dataset
repository (loaded by config and split, as `datasets.load_dataset` loads it), with a prompt column.

Prompts are plain strings (tokenized as they are) or conversations (a list of
{role, content} messages; TRL applies the tokenizer's chat template). Either
way the trainer tokenizes and the server receives token ids.

`grpo prepare` loads it with the same function before any server starts, so a dataset that cannot be
trained on fails the run there; each error names the spec field, the file and, for jsonl, the line.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, load_from_disk
from datasets.table import InMemoryTable

from grpo_api.models import DatasetFormat, DatasetSpec, PromptFormat
from grpo_trainer.errors import InvalidSpec
from grpo_trainer.rewards import REWARD_CALL_ARGUMENTS

PROMPT = "prompt"

#: The longest jsonl line read (bytes, with its newline). Each line is read whole into memory, and a sparse file
#: costs its writer no disk: without a bound, one line of it exhausts the memory of the initializer.
MAX_LINE_BYTES = 64 * 1024 * 1024

log = logging.getLogger(__name__)


class DatasetError(InvalidSpec):
    """The dataset cannot be trained on; the message names the field, the file and the line."""


def detect_format(path: Path, declared: DatasetFormat | str) -> DatasetFormat:
    if declared != DatasetFormat.AUTO:
        return DatasetFormat(declared)
    if path.is_dir():
        return DatasetFormat.ARROW if _saved_to_disk(path) else DatasetFormat.REPOSITORY
    if path.suffix in {".jsonl", ".json"}:
        return DatasetFormat.JSONL
    if path.suffix == ".parquet":
        return DatasetFormat.PARQUET
    raise DatasetError(
        f"spec.dataset.format: cannot tell the format of {path} from its name; set it to jsonl, parquet or arrow"
    )


def _open_regular(path: Path) -> int:
    """A descriptor of the file, refused unless it is a regular file: opening a FIFO for reading waits for a
    writer (forever), and a device (/dev/zero) never ends. Non-blocking, so a FIFO cannot hold the open."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DatasetError(f"spec.dataset.path: {path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_jsonl(path: Path, prompt_field: str) -> Dataset:
    rows: list[dict[str, Any]] = []
    fields: dict[str, None] = {}  # every row's, in order of first appearance
    with os.fdopen(_open_regular(path), "rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DatasetError(f"spec.dataset: {path} line {number} is longer than {MAX_LINE_BYTES} bytes")
            try:
                # a byte-order mark opens many files written on Windows: skipped, as load_dataset("json") does
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"spec.dataset: {path} line {number}: not UTF-8 text (byte {exc.start + 1} of the line)"
                ) from exc
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"spec.dataset: {path} line {number}: not valid JSON: {exc}") from exc
            except RecursionError as exc:
                raise DatasetError(f"spec.dataset: {path} line {number}: nested too deeply to read") from exc
            if not isinstance(row, dict):
                raise DatasetError(
                    f"spec.dataset: {path} line {number}: expected a JSON object, got {type(row).__name__}"
                )
            if prompt_field not in row:
                # Dataset.from_list takes its columns from the first row: a prompt missing here would
                # lose the column, or leave this row without one.
                raise DatasetError(
                    f"spec.dataset.promptField: {path} line {number} has no field {prompt_field!r}; "
                    f"its fields: {', '.join(row) or 'none'}"
                )
            prompt = row[prompt_field]
            if not (isinstance(prompt, str) or _is_conversation(prompt)):
                raise DatasetError(
                    f"spec.dataset.promptField: {path} line {number}: {prompt_field} must be a string or a list "
                    f"of {{role, content}} messages, got {type(prompt).__name__}"
                )
            if isinstance(prompt, str) and not prompt.strip():
                raise DatasetError(f"spec.dataset.promptField: {path} line {number}: the prompt is empty")
            fields.update(dict.fromkeys(row))
            rows.append(row)
    # As `load_dataset("json")` reads it: a field some line lacks is null there (Dataset.from_list would take
    # the first row's fields alone, dropping a later row's extra field).
    rows = [{key: row.get(key) for key in fields} for row in rows]
    try:
        return Dataset.from_list(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DatasetError(f"spec.dataset: {path}: a column holds values of different types: {exc}") from exc


def _read_saved(path: Path, split: str) -> Dataset:
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise DatasetError(f"spec.dataset.split: {path} has no split {split!r}; splits: {', '.join(loaded)}")
        loaded = loaded[split]
    if not isinstance(loaded, Dataset):
        raise DatasetError(f"spec.dataset: {path} is not a map-style dataset written by save_to_disk")
    return loaded


def _saved_to_disk(path: Path) -> bool:
    """A directory `save_to_disk` wrote: a DatasetDict's dataset_dict.json, or a Dataset's state.json."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _read_repository(path: Path, spec: DatasetSpec) -> Dataset:
    """The split of the config, read as `load_dataset(path, config, split=split)` reads it: configs from README.md's
    `configs`, else one `default` whose splits come from the data files' names (data/train-00000-of-00002.parquet,
    test.jsonl...). The Arrow files it builds go to a temporary directory; the rows stay in memory."""
    from datasets import get_dataset_config_names, get_dataset_default_config_name, load_dataset_builder

    where = f"{spec.source} ({path})" if spec.source else str(path)
    configs = get_dataset_config_names(str(path))
    config = spec.config or get_dataset_default_config_name(str(path))
    if config is None and len(configs) == 1:
        config = configs[0]
    if config is None:
        raise DatasetError(f"spec.dataset.config: {where} has several configs and no default; name one of "
                           f"{', '.join(configs)}")
    if config not in configs:
        raise DatasetError(f"spec.dataset.config: {where} has no config {config!r}; configs: {', '.join(configs)}")
    with tempfile.TemporaryDirectory(prefix="grpo-dataset-") as cache:
        builder = load_dataset_builder(str(path), config, cache_dir=cache)
        splits = list(builder.config.data_files or {})
        if spec.split not in splits:
            raise DatasetError(f"spec.dataset.split: {where} has no split {spec.split!r} in config {config!r}; "
                               f"splits: {', '.join(splits) or 'none'}")
        builder.download_and_prepare()
        loaded = builder.as_dataset(split=spec.split, in_memory=True)
    if not isinstance(loaded, Dataset):  # pragma: no cover - one split of a map-style builder
        raise DatasetError(f"spec.dataset: {where} split {spec.split!r} is not a map-style dataset")
    return loaded


def read_dataset(path: Path, spec: DatasetSpec) -> Dataset:
    """Read the file or directory; no validation of the columns yet."""
    if not path.exists():
        raise DatasetError(f"spec.dataset.path: {path} does not exist")
    fmt = detect_format(path, spec.format)
    if spec.config is not None and fmt != DatasetFormat.REPOSITORY:
        raise DatasetError(f"spec.dataset.config: {path} is a {fmt.value} dataset, not a dataset repository "
                           "directory; a config applies to a repository (hf:// without a path, or its directory)")
    try:
        if fmt == DatasetFormat.JSONL:
            return _read_jsonl(path, spec.prompt_field)
        if fmt == DatasetFormat.PARQUET:
            return Dataset(InMemoryTable(pq.read_table(path)))
        if fmt == DatasetFormat.REPOSITORY:
            return _read_repository(path, spec)
        return _read_saved(path, spec.split)
    except (DatasetError, MemoryError):
        raise
    except (OSError, ValueError) as exc:
        raise DatasetError(f"spec.dataset: {path}: cannot read as {fmt.value}: {exc}") from exc
    except Exception as exc:  # the readers index the file's own metadata (save_to_disk's JSON) as they expect it
        raise DatasetError(f"spec.dataset: {path}: cannot read as {fmt.value}: {type(exc).__name__}: {exc}") from exc


def _is_conversation(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def prompt_kind(dataset: Dataset, source: str, declared: PromptFormat | str) -> PromptFormat:
    """plain or conversational, checked on every row."""
    kinds = set()
    for index, value in enumerate(dataset[PROMPT]):
        if isinstance(value, str):
            if not value.strip():  # no tokens to generate from (the server refuses an empty prompt)
                raise DatasetError(f"spec.dataset.promptField: {source} row {index}: the prompt is empty")
            kinds.add(PromptFormat.PLAIN)
        elif _is_conversation(value):
            kinds.add(PromptFormat.CONVERSATIONAL)
        else:
            raise DatasetError(
                f"spec.dataset.promptField: {source} row {index}: the prompt must be a string or a list of "
                f"{{role, content}} messages, got {type(value).__name__}"
            )
    if len(kinds) > 1:
        raise DatasetError(f"spec.dataset: the prompts of {source} mix plain strings and conversations; use one kind")
    kind = kinds.pop()
    if declared != PromptFormat.AUTO and kind != declared:
        raise DatasetError(f"spec.dataset.promptFormat is {PromptFormat(declared).value} but the prompts of "
                           f"{source} are {kind.value}")
    return kind


def load_prompts(path: Path, spec: DatasetSpec, *, tokenizer: Any, max_prompt_length: int | None,
                 min_rows: int) -> Dataset:
    """The training dataset with a `prompt` column, validated, long prompts dropped."""
    dataset = read_dataset(path, spec)
    source = str(path)
    if len(dataset) == 0:
        raise DatasetError(f"spec.dataset: {source} is empty: no rows to train on")
    if spec.prompt_field not in dataset.column_names:
        raise DatasetError(
            f"spec.dataset.promptField: {source} has no column {spec.prompt_field!r}; columns: "
            f"{', '.join(dataset.column_names) or 'none'}"
        )
    if spec.prompt_field != PROMPT:
        if PROMPT in dataset.column_names:
            raise DatasetError(f"spec.dataset.promptField is {spec.prompt_field!r} but {source} has a 'prompt' "
                               "column too; rename one")
        dataset = dataset.rename_column(spec.prompt_field, PROMPT)
    for column in REWARD_CALL_ARGUMENTS:
        if column in dataset.column_names:
            raise DatasetError(
                f"spec.dataset: {source} has a column {column!r}, a name TRL gives an argument of its own when it "
                "calls the reward functions with the dataset's columns; rename the column"
            )
    kind = prompt_kind(dataset, source, spec.prompt_format)
    if kind == PromptFormat.CONVERSATIONAL and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"spec.dataset: the prompts of {source} are conversations but the model's tokenizer "
                           "has no chat template")
    if max_prompt_length is not None:
        before = len(dataset)
        dataset = dataset.filter(
            lambda row: prompt_length(tokenizer, row[PROMPT], kind) <= max_prompt_length,
            keep_in_memory=True,
        )
        dropped = before - len(dataset)
        if dropped:
            log.warning(
                "dropped %d of %d prompts longer than %d tokens (trainer.maxPromptLength)",
                dropped, before, max_prompt_length,
            )
    if len(dataset) < min_rows:
        raise DatasetError(
            f"spec.dataset: {source} has {len(dataset)} usable prompts, but one step needs {min_rows} "
            "(spec.trainer: perDeviceBatchSize × gradientAccumulationSteps × numNodes × numProcPerNode "
            "/ numGenerations)"
        )
    return dataset


def prompt_length(tokenizer: Any, prompt: Any, kind: PromptFormat) -> int:
    if kind == PromptFormat.CONVERSATIONAL:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)
    return len(tokenizer(prompt)["input_ids"])
