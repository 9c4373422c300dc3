"""Two gloo ranks on CPU: a PEFT model sharded with FSDP2 (fully_shard, as Accelerate applies it) and wrapped
for activation checkpointing; each rank takes peft_adapter() and rank 0 writes what it got. Run by
test_adapter_io.py as `python -m tests.trainer.fsdp_adapter_ranks MODEL_DIR OUT_DIR`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def peft_model(model_dir: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    return model


def rank_main(rank: int, model_dir: str, out: str, port: int) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from grpo_trainer.transport.adapter_files import peft_adapter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = peft_model(model_dir)
    layers = type(model.base_model.model.model.layers[0])
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, layers))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert sharded and all(isinstance(p, DTensor) for p in sharded)
    assert any(p.to_local().shape != p.shape for p in sharded), "each rank should hold a part"
    tensors, _ = peft_adapter(model)
    if rank == 0:
        torch.save(tensors, Path(out) / "sharded.pt")
    # both ranks leave together: a rank that tears gloo down while its peer still exchanges with it can abort
    # ("terminate called without an active exception", seen once in CI on rank 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2], free), nprocs=2, join=True)
