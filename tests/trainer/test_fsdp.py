"""strategy fsdp: the policy sharded with FSDP2 through Accelerate, which shards over NCCL only.

On CPU (CI) the setting is refused naming the field. On a CUDA machine (the device; BENCHMARKS.md) the
trainer runs as many processes as there are GPUs, up to two: the adapter is gathered from its shards for
every publish (the server checks every tensor's shape against the model, so a shard would be refused),
checkpoints are written and a second attempt resumes from them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from grpo_api.adapters import version_dir
from tests.fixtures.server import start_server
from tests.fixtures.trainer_runs import (
    PUBLISH_LINE,
    STEP_LINE,
    cli_env,
    complete_checkpoints,
    grpo_train,
    next_attempt,
    token_fraction,
    trainer_config,
)

CUDA = torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the refusal is for machines without a CUDA GPU")
def test_fsdp_without_a_gpu_is_refused_naming_the_field(tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path):
    server = start_server(tmp_path / "server", tiny_model_dir)
    try:
        _, path = trainer_config(server, tmp_path / "run", dataset=tiny_dataset,
                                 rewards=[token_fraction(tiny_model_dir)], trainer={"strategy": "fsdp", "maxSteps": 2})
        done = subprocess.run(grpo_train(path), env=cli_env(), capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 2, (done.returncode, out[-3000:])
        assert "spec.trainer.strategy fsdp" in out and "use strategy ddp" in out, out[-3000:]
        assert "grpo train: 1 processes" in out  # launched: Accelerate applies FSDP to a process group only
    finally:
        server.stop(timeout=10)


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device: BENCHMARKS.md)")
def test_gpu_fsdp_publishes_whole_adapters_from_shards_checkpoints_and_resumes(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
):
    procs = min(torch.cuda.device_count(), 2)
    server = start_server(tmp_path / "server", tiny_model_dir)
    try:
        trainer = {"numProcPerNode": procs, "strategy": "fsdp", "perDeviceBatchSize": 4, "numGenerations": 4,
                   "maxCompletionLength": 8, "maxSteps": 4, "syncInterval": 1, "checkpointInterval": 2, "seed": 0,
                   "gradientCheckpointing": True}
        cfg, path = trainer_config(server, tmp_path / "run", dataset=tiny_dataset,
                                   rewards=[token_fraction(tiny_model_dir)], trainer=trainer)
        first = subprocess.run(grpo_train(path), env=cli_env(GRPO_ATTEMPT="1"), capture_output=True, text=True,
                               timeout=600)
        out = first.stdout + first.stderr
        (tmp_path.parent / f"fsdp-{procs}-attempt-1.log").write_text(out)
        assert first.returncode == 0, out[-6000:]
        assert f"trainer: {procs} process(es), strategy fsdp (accelerate FSDP)" in out, out[-3000:]
        published = PUBLISH_LINE.findall(out)
        assert [int(v) for v, _, _, _ in published] == [1, 2, 3, 4], out[-3000:]
        assert len({sha for _, _, _, sha in published}) == 4  # each version holds that step's weights
        assert [int(s) for s, _, _ in STEP_LINE.findall(out)] == [1, 2, 3, 4]
        assert server.health()["adapter"]["version"] == 4  # loaded: every tensor has the model's shape
        weights = load_file(version_dir(Path(cfg.paths.adapter_root), 4) / "adapter_model.safetensors")
        assert len(weights) == 7 * 2 * 2  # every linear layer's lora_A and lora_B, of both decoder layers
        checkpoints = tmp_path / "run" / "checkpoints"
        assert complete_checkpoints(checkpoints) == [2, 4]
        print("checkpoint-4:", sorted(p.name for p in (checkpoints / "checkpoint-4").iterdir()))

        out2 = next_attempt(cfg, path, max_steps=6, attempt=2)
        (tmp_path.parent / f"fsdp-{procs}-attempt-2.log").write_text(out2)
        assert "resuming from" in out2 and "checkpoint-4" in out2
        resumed = PUBLISH_LINE.findall(out2)
        assert resumed[0][2] == "resumed from checkpoint-4", resumed
        assert [int(s) for s, _, _ in STEP_LINE.findall(out2)] == [5, 6]
        assert json.loads((tmp_path / "run" / "progress.json").read_text())["step"] == 6
        assert httpx.get(f"{server.url}/health/", timeout=10).json()["adapter"]["version"] >= 6
    finally:
        server.stop(timeout=10)
