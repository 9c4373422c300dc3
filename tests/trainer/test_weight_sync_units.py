"""The pieces of full fine-tuning's sync that need no server: snapshots, update bodies, backend choice."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from grpo_trainer.errors import TrainingFailed
from grpo_trainer.transport.weight_sync import (
    ALIGN_BYTES,
    GlooChannel,
    IpcChannel,
    make_channel,
    server_backend,
    take_merged_snapshot,
    take_snapshot,
    update_info,
)


def test_the_backend_and_worker_count_come_from_server_info_and_a_lora_server_is_refused_with_the_reason():
    info = {"weight_transfer_config": {"backend": "nccl"},
            "parallel_config": {"tensor_parallel_size": 2, "data_parallel_size": 2}}
    assert server_backend(info) == ("nccl", 4)
    assert server_backend({"weight_transfer_config": {"backend": "gloo"}}) == ("gloo", 1)
    with pytest.raises(TrainingFailed, match=r"takes no weight updates .* started for LoRA"):
        server_backend({"weight_transfer_config": None})
    assert isinstance(make_channel("ipc", server_workers=1), IpcChannel)
    assert isinstance(make_channel("gloo", server_workers=1), GlooChannel)
    with pytest.raises(TrainingFailed, match="over 'tcp', which this trainer cannot send"):
        make_channel("tcp", server_workers=1)


def test_a_snapshot_is_a_copy_in_the_serving_dtype_and_its_update_body_names_every_tensor(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    snapshot = take_snapshot(model, "bfloat16")
    params = dict(model.named_parameters())
    assert list(snapshot.tensors) == list(params)
    name = next(iter(params))
    with torch.no_grad():
        params[name].add_(1.0)  # the model trains on; the copy does not move
    assert not torch.equal(snapshot.tensors[name].float(), params[name].detach().to(torch.bfloat16).float())
    body = update_info(snapshot)
    assert body["names"] == list(params) and set(body["dtype_names"]) == {"bfloat16"} and body["packed"] is False
    assert body["shapes"][0] == list(params[name].shape)
    assert snapshot.size_bytes == sum(p.numel() * 2 for p in params.values())
    assert_packed(snapshot.tensors.values())


def assert_packed(tensors) -> None:
    """Views of one buffer (an ipc push shares it once), each starting on an ALIGN_BYTES boundary, none overlapping."""
    tensors = list(tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    spans = sorted((t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size())
                   for t in tensors)
    assert all(start % ALIGN_BYTES == 0 for start, _ in spans)
    assert all(end <= following for (_, end), (following, _) in itertools.pairwise(spans))
    assert all(t.is_contiguous() for t in tensors)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_a_merged_snapshot_holds_every_base_weight_with_peft_own_merge_of_the_target_modules(
        tiny_model_dir: Path, targets: str | list[str]):
    """Every tensor, in the model's order: vLLM reloads a fused qkv in place only from all of its tensors
    (q and v without k, or weights without their biases, leave the rest uninitialised; found on the H200)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [n for n, _ in base.named_parameters()]
    assert any(n.endswith("k_proj.bias") for n in names)  # Qwen2's qkv biases: never a LoRA target
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at zero: make the delta real
    snapshot = take_merged_snapshot(model, "float32")
    assert list(snapshot.tensors) == names
    merged = dict(model.merge_and_unload().named_parameters())
    original = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    changed = set()
    for name, tensor in snapshot.tensors.items():
        torch.testing.assert_close(tensor, merged[name].detach(), rtol=1e-5, atol=1e-6)
        if not torch.equal(tensor, original[name].detach()):
            changed.add(name.rsplit(".", 2)[-2])
    assert changed == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
                       if targets == "all-linear" else {"q_proj", "v_proj"})
    assert_packed(snapshot.tensors.values())


def test_a_merged_snapshot_of_a_model_without_lora_is_refused(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(TrainingFailed, match="found no LoRA layer"):
        take_merged_snapshot(AutoModelForCausalLM.from_pretrained(tiny_model_dir), "float32")
