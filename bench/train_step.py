"""A GRPO training step's GPU phases, LoRA against full fine-tuning, as TRL 1.16 runs them (issue 28).

On the H100's eleventh lease our LoRA step spent ~0.30 s outside generation and the adapter sync, full fine-tuning
~0.16 s, on the same model and batch. This times what TRL does with the policy in a step, without a server: the
scoring forward (no grad, which the trainer now skips where it may), the training forward and backward through
TRL's fused LM head (log-probs and entropy, never the full logits), and the optimizer step; for full fine-tuning
and for LoRA with the adapter in float32 (PEFT's default, which TRL keeps), the same without PEFT's cast of each
adapted layer's input to float32 (as the trainer trains under autocast: adapter_casts.drops_adapter_input_casts), and
the adapter in bf16.

    python bench/train_step.py --model /tmp/m15 --out $OUT/train_step.json

Random token ids of the learning workload's shape (64 sequences: a short prompt and 64 completion tokens). Needs
torch, transformers and peft only; without TRL the log-probs come from the full logits instead of TRL's head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

try:  # TRL's fused LM head, as GRPOTrainer scores; without TRL (the device before the bundle) the full logits
    from trl.trainer.utils import add_fused_lm_head
except ImportError:
    add_fused_lm_head = None

#: The benchmark's LoRA (bench/grpo_step.py: r32, alpha 64, every linear layer), as lora_config_kwargs builds it.
LORA = {"r": 32, "lora_alpha": 64, "lora_dropout": 0.0, "target_modules": "all-linear", "bias": "none",
        "use_dora": False, "task_type": "CAUSAL_LM"}

VARIANTS = ("full", "lora", "lora_nocast", "lora_bf16")
#: The GPU when there is one; the CPU only to smoke-test this script on a tiny model.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Milliseconds of each call after two warm-up calls, the GPU synchronised around each."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def build(model_dir: Path, variant: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE)
    if add_fused_lm_head is not None:
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does, before PEFT
    if variant != "full":
        model = get_peft_model(model, LoraConfig(**LORA), autocast_adapter_dtype=variant != "lora_bf16")
        if variant == "lora_nocast":  # as the trainer trains under autocast (adapter_casts.drops_adapter_input_casts)
            for module in model.modules():
                if hasattr(module, "cast_input_dtype_enabled"):
                    module.cast_input_dtype_enabled = False
    model.train()
    return model


def measure(model_dir: Path, variant: str, *, batch: int, prompt: int, completion: int, repeats: int) -> dict[str, Any]:
    model = build(model_dir, variant)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prompt + completion), device=DEVICE)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :prompt] = -100
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-7, fused=DEVICE == "cuda")

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        """The completion tokens' log-probs and entropies."""
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            if add_fused_lm_head is not None:
                out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
                return out.log_probs[:, -completion:], out.entropy[:, -completion:]
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion + 1).logits[:, :-1].float()
        logps = torch.log_softmax(logits, dim=-1)
        entropy = -(logps.exp() * logps).sum(-1)
        return logps.gather(-1, ids[:, -completion:, None]).squeeze(-1), entropy

    def scoring() -> None:
        with torch.no_grad():
            forward()

    def train() -> None:
        logps, entropy = forward()
        (logps.mean() + 0.0 * entropy.mean()).backward()

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train()
    phases = (("scoring_forward", scoring), ("train_forward_backward", train), ("optimizer", step))
    figures = {name: timed(fn, repeats) for name, fn in phases}
    result = {
        "variant": variant, "lm_head": "trl fused" if add_fused_lm_head is not None else "full logits",
        "trainable_parameters": sum(p.numel() for p in trainable),
        "trainable_dtype": str(trainable[0].dtype),
        **{f"{name}_ms_median": statistics.median(samples) for name, samples in figures.items()},
        "samples_ms": figures,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=12, help="tokens (the learning dataset: 3-6 words)")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = []
    for variant in args.variants:
        run = measure(args.model, variant, batch=args.batch, prompt=args.prompt_length,
                      completion=args.completion_length, repeats=args.repeats)
        print(json.dumps({k: v for k, v in run.items() if k != "samples_ms"}), flush=True)
        runs.append(run)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()  # the variant's model and optimizer went with measure()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "GRPO training step phases: LoRA against full fine-tuning",
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
        "machine": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        "workload": {"batch": args.batch, "prompt": args.prompt_length, "completion": args.completion_length},
        "runs": runs,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
