"""LoRA under mixed precision without PEFT's float32 copy of each adapted layer's input.

PEFT keeps the adapter in float32 (its default, which TRL keeps) and casts each adapted layer's input to it; under
the trainer's bf16 or fp16 autocast the adapter's matmuls run in half precision whatever their input, so that cast
and autocast's cast back are two copies of the layer's activations each way that change no result. The runner
trains with PEFT's casts off (peft.helpers.disable_input_dtype_casting) where this module says so.
"""

from __future__ import annotations

from typing import Any

import torch


def drops_adapter_input_casts(trainer: Any, *, wanted: bool) -> bool:
    """Whether the trainer trains without PEFT's cast of each adapted layer's input to the adapter's dtype.

    PEFT casts it to float32 (its default adapter dtype, which TRL keeps); under the trainer's bf16 or fp16 autocast
    every such matmul runs in half precision whatever its input, so the cast and autocast's cast back change no
    result and cost two copies of the layer's activations, each way. Dropped under autocast without LoRA dropout
    (dropout draws its mask per dtype, so there the casts stay): tests/trainer/test_adapter_input_casts.py, the same
    outputs and gradients, bit for bit. Not unless `wanted` (config.Savings)."""
    dropout = any(isinstance(layer, torch.nn.Dropout) and layer.p > 0 for module in trainer.model.modules()
                  if isinstance(dropouts := getattr(module, "lora_dropout", None), torch.nn.ModuleDict)
                  for layer in dropouts.values())
    return wanted and bool(trainer.args.bf16 or trainer.args.fp16) and not dropout
