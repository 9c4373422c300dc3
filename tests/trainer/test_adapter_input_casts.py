"""LoRA under autocast without PEFT's per-layer input casts: the same outputs and gradients, bit for bit, fewer copies.

PEFT casts each adapted layer's input to the adapter's dtype (float32 by default, which TRL keeps) before the
adapter's matmuls, and autocast casts it back to bf16 for them. The trainer turns that cast off while it trains
under autocast (adapter_casts.drops_adapter_input_casts). A bf16 base with a float32 adapter, under CPU autocast,
shows both halves of the claim: nothing changes but the number of copies. With LoRA dropout the casts stay:
dropout draws its mask per dtype, so its masks would differ.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from grpo_trainer.adapter_casts import drops_adapter_input_casts
from grpo_trainer.config import ENV_ADAPTER_INPUT_CASTS, Savings
from grpo_trainer.errors import InvalidSpec


def lora_model(model_dir: Path, dropout: float) -> Any:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)  # PEFT's default: the adapter in float32 over the bf16 base
    adapter = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in adapter} == {torch.float32} and model.get_base_model().dtype == torch.bfloat16
    for p in adapter:  # B starts at 0; make both factors carry a gradient
        torch.nn.init.normal_(p, std=0.05)
    model.train()
    return model


def step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logits, the adapter's gradients and how many dtype copies one forward and backward under bf16 autocast ran."""
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
    copies = sum(event.count for event in prof.key_averages() if event.key == "aten::_to_copy")
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads, copies


def test_casts_off_under_autocast_change_no_output_or_gradient_and_save_copies(tiny_model_dir: Path):
    model = lora_model(tiny_model_dir, 0.0)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    cast_logits, cast_grads, cast_copies = step(model, ids)
    assert drops_adapter_input_casts(trainer(model, bf16=True), wanted=True)
    with disable_input_dtype_casting(model):  # as the runner trains when it drops them
        logits, grads, copies = step(model, ids)
    print(f"\n{cast_copies} dtype copies a step with PEFT's casts, {copies} without")
    assert torch.equal(logits, cast_logits)
    assert grads.keys() == cast_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, cast_grads[name]), name
    layers = sum(1 for name in grads if name.endswith("lora_A.default.weight"))
    assert cast_copies - copies >= 2 * layers  # each adapted layer's cast and autocast's cast back, at least


def test_casts_stay_without_autocast_with_lora_dropout_or_when_asked(tiny_model_dir: Path):
    model = lora_model(tiny_model_dir, 0.0)
    assert drops_adapter_input_casts(trainer(model, bf16=True), wanted=True)
    assert not drops_adapter_input_casts(trainer(model, bf16=False), wanted=True)  # float32 training needs them
    # a mask drawn in float32 differs from one drawn in bf16
    assert not drops_adapter_input_casts(trainer(lora_model(tiny_model_dir, 0.1), bf16=True), wanted=True)
    # as TRL trains: the benchmark's colocate baseline
    assert not Savings.from_environment({ENV_ADAPTER_INPUT_CASTS: "keep"}).drop_adapter_input_casts
    assert not drops_adapter_input_casts(trainer(model, bf16=True), wanted=False)
    assert Savings.from_environment({ENV_ADAPTER_INPUT_CASTS: "OFF"}).drop_adapter_input_casts
    with pytest.raises(InvalidSpec, match=ENV_ADAPTER_INPUT_CASTS):
        Savings.from_environment({ENV_ADAPTER_INPUT_CASTS: "never"})


def trainer(model: Any, *, bf16: bool) -> Any:
    """What drops_adapter_input_casts reads of TRL's trainer."""
    return SimpleNamespace(model=model, args=SimpleNamespace(bf16=bf16, fp16=False))
