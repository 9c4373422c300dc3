"""The trainer's exit code tells the executors which kind of failure ended it (grpo_api.exit_codes):
2 for a configuration problem no retry fixes, 1 for anything the next attempt may not meet."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from grpo_api import exit_codes, prepare_protocol
from grpo_api.exit_codes import EXIT_FAILED, EXIT_INVALID_SPEC
from grpo_api.prepare_protocol import ENV_TERMINATION_LOG
from grpo_api.runconfig import RunConfigError
from grpo_trainer.data import DatasetError
from grpo_trainer.errors import (
    AdapterSyncFailed,
    InvalidSpec,
    RewardFunctionFailed,
    ServerMismatch,
    ServerUnavailable,
    TrainingFailed,
    UnsupportedSetting,
    exit_code,
)
from grpo_trainer.rewards import RewardConfigError
from tests.fixtures.server import RunningServer
from tests.fixtures.trainer_runs import REPO, cli_env, grpo_train, token_fraction, trainer_config


@pytest.mark.parametrize(
    "error",
    [
        DatasetError("spec.dataset: /d/p.jsonl is empty: no rows to train on"),
        RewardConfigError("spec.rewards[0].function 'm:f': cannot import module 'm'"),
        UnsupportedSetting("spec.trainer.lora.quantizeBase (QLoRA) needs a CUDA GPU"),
        InvalidSpec("spec.trainer settings rejected by TRL"),
        RunConfigError("/etc/grpo/run-config.yaml: file not found"),
    ],
    ids=type,
)
def test_errors_no_retry_fixes_exit_with_the_invalid_spec_code(error: Exception) -> None:
    assert exit_code(error) == EXIT_INVALID_SPEC == 2


@pytest.mark.parametrize(
    "error",
    [
        ServerUnavailable("generation server did not answer"),
        ServerMismatch("server already has adapter v3 active"),
        AdapterSyncFailed("adapter v4 could not be made active"),
        RewardFunctionFailed("reward function 'judge' raised TimeoutError"),
        TrainingFailed("generation server returned 3 completions, expected 4"),
        RuntimeError("CUDA out of memory"),
    ],
    ids=type,
)
def test_other_errors_exit_with_the_retryable_code(error: Exception) -> None:
    assert exit_code(error) == EXIT_FAILED == 1


def test_the_initializer_and_the_trainer_mean_the_same_by_each_code() -> None:
    assert (prepare_protocol.EXIT_READY, prepare_protocol.EXIT_TRANSIENT, prepare_protocol.EXIT_PERMANENT) == (
        exit_codes.EXIT_SUCCEEDED, exit_codes.EXIT_FAILED, exit_codes.EXIT_INVALID_SPEC)


def test_a_long_final_message_is_clipped_under_the_kubelets_limit() -> None:
    clipped = exit_codes.clip_final_message("x" * 10_000)
    assert len(clipped.encode()) < 4096 and clipped.endswith("…")
    assert exit_codes.clip_final_message("short") == "short"


@pytest.mark.slow
def test_grpo_train_exits_2_on_a_broken_dataset_line_and_leaves_its_words_in_the_termination_log(
    tiny_server: RunningServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """The initializer refuses such a file before any server; should it change on the volume afterwards, the
    trainer refuses it too, and says so with the code that ends the run instead of starting another attempt."""
    lines = tiny_dataset.read_text().splitlines()
    broken = tmp_path / "prompts.jsonl"
    broken.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    _, config = trainer_config(tiny_server, tmp_path / "run", dataset=broken,
                               rewards=[token_fraction(tiny_model_dir)], trainer={"maxSteps": 2})
    last_words = tmp_path / "termination-log"
    result = subprocess.run(grpo_train(config), env=cli_env(**{ENV_TERMINATION_LOG: str(last_words)}),
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == EXIT_INVALID_SPEC, result.stdout[-2000:] + result.stderr[-3000:]
    said = last_words.read_text().strip()
    assert said.startswith(f"spec.dataset: {broken} line 3: not valid JSON"), said
    assert f"grpo train: error (a configuration problem: no retry fixes it): {said}" in result.stderr


@pytest.mark.slow
def test_grpo_train_exits_1_when_the_server_cannot_be_reached(
    tiny_server: RunningServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    _, config = trainer_config(tiny_server, tmp_path / "run", dataset=tiny_dataset, server_url="http://127.0.0.1:9",
                               rewards=[token_fraction(tiny_model_dir)],
                               trainer={"maxSteps": 2, "generationTimeoutSeconds": 1})
    last_words = tmp_path / "termination-log"
    result = subprocess.run(grpo_train(config), env=cli_env(**{ENV_TERMINATION_LOG: str(last_words)}),
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "did not answer GET /health/" in last_words.read_text()
