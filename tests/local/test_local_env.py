"""A local run gives its children the spec's `env`, as the pods get it (the user's variables last)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

from grpo_api.models import GRPORun
from grpo_local.runner import LocalRun


def env_dumping_python(tmp: Path) -> str:
    """A stand-in interpreter that prints its environment (the child's log) and exits."""
    script = tmp / "python"
    script.write_text("#!/bin/sh\nenv\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def child_environment(log: Path) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if log.is_file() and "PATH=" in log.read_text():
            break
        time.sleep(0.05)
    return dict(line.split("=", 1) for line in log.read_text().splitlines() if "=" in line)


def test_server_and_trainer_get_their_sections_env_and_may_override_ours(tmp_path: Path) -> None:
    run = GRPORun.model_validate({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": "env-run"},
        "spec": {
            "model": {"name": "tiny", "path": str(tmp_path / "model")},
            "dataset": {"path": str(tmp_path / "prompts.jsonl")},
            "rewards": [{"function": "token_fraction", "args": {"low": 3, "high": 10}}],
            "server": {"engine": "transformers", "env": [{"name": "VLLM_LORA_ENABLE_DUAL_STREAM", "value": "1"}]},
            "trainer": {"env": [{"name": "GRPO_EXTRA", "value": "trainer side"},
                                {"name": "TOKENIZERS_PARALLELISM", "value": "true"}]},
        },
    })
    run_file = tmp_path / "run.yaml"
    run_file.write_text("# the runner reads the parsed object\n")
    local = LocalRun(run=run, run_file=run_file, run_dir=tmp_path / "run", port=18123,
                     python=env_dumping_python(tmp_path))
    local.provision()
    local.ensure_server(1, 1)
    local.create_trainer(1)

    server = child_environment(local.logs_dir / "server-attempt-1.log")
    trainer = child_environment(local.logs_dir / "trainer-attempt-1.log")
    assert server["VLLM_LORA_ENABLE_DUAL_STREAM"] == "1"
    assert "GRPO_EXTRA" not in server and server["TOKENIZERS_PARALLELISM"] == "false"
    assert trainer["GRPO_EXTRA"] == "trainer side"
    assert trainer["TOKENIZERS_PARALLELISM"] == "true", "the spec's value comes last, as in the pod"
    assert "VLLM_LORA_ENABLE_DUAL_STREAM" not in trainer
    for env in (server, trainer):  # ours are still there
        assert env["GRPO_ATTEMPT"] == "1" and env["GRPO_RUN_CONFIG"] == str(local.config_file)


def test_the_trainer_writes_tracker_files_into_the_run_directory(tmp_path: Path) -> None:
    run = GRPORun.model_validate({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": "tracked"},
        "spec": {
            "model": {"name": "tiny", "path": str(tmp_path / "model")},
            "dataset": {"path": str(tmp_path / "prompts.jsonl")},
            "rewards": [{"function": "token_fraction", "args": {"low": 3, "high": 10}}],
            "trainer": {"reportTo": ["tensorboard", "wandb"], "env": [{"name": "WANDB_DIR", "value": "/elsewhere"}]},
        },
    })
    run_file = tmp_path / "run.yaml"
    run_file.write_text("# the runner reads the parsed object\n")
    local = LocalRun(run=run, run_file=run_file, run_dir=tmp_path / "run", port=18124,
                     python=env_dumping_python(tmp_path))
    local.provision()
    local.create_trainer(1)

    trainer = child_environment(local.logs_dir / "trainer-attempt-1.log")
    assert trainer["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "run" / "tracking" / "tracked" / "tensorboard")
    assert trainer["WANDB_DIR"] == "/elsewhere", "the spec's env moves it"
    assert "TRACKIO_DIR" not in trainer
