"""Where the adapter snapshot's time goes (issue 28: the ~52 ms the training loop waits at each publish).

The trainer's loop is blocked while `snapshot_peft_adapter` takes the adapter's state: PEFT finds the LoRA
tensors among the model's parameters, they are cast to the serving dtype and packed into one buffer, and one
device-to-host copy into pinned memory is queued. This times each part on a PEFT model of the given
checkpoint (LoRA r32 on every linear layer, as the spec's defaults), on the GPU when there is one:

- `find_peft`: PEFT's search for the adapter's tensors (`get_peft_model_state_dict`), what every publish did
  until the layout was kept (2026-12-07);
- `find`: `peft_adapter(model)` as it is now (the layout found once, the parameters looked up by name);
- `pack_per_tensor`: a cast per tensor, then the concatenation into one device buffer (until 2026-12-07);
- `pack`: the concatenation, then one cast, as now;
- `pin`: `torch.empty(..., pin_memory=True)` of the adapter's size;
- `snapshot`: the whole `snapshot_peft_adapter` as the trainer calls it, after the GPU went idle;
- `snapshot_busy`: the same right after queueing ~50 ms of matmuls (the optimizer step still running);
- `copy_wait`: after `snapshot_busy`, until its copy event completes.

    python bench/adapter_snapshot.py --model /tmp/m15 --out $OUT/adapter_snapshot.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> list[float]:
    seconds = []
    for _ in range(reps):
        sync()
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_trainer.transport.adapter_files import find_adapter_layout, peft_adapter, snapshot_peft_adapter

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    model = get_peft_model(model.to(device), LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                        target_modules="all-linear", task_type="CAUSAL_LM"))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    target = getattr(torch, args.dtype)
    tensors, _ = peft_adapter(model)
    names = sorted(tensors)
    numel = sum(t.numel() for t in tensors.values())
    nbytes = numel * torch.empty(0, dtype=target).element_size()
    busy = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16 if cuda else torch.float32)

    def pack_per_tensor() -> Any:
        return torch.cat([tensors[n].detach().to(target).reshape(-1) for n in names])

    def pack() -> Any:
        return torch.cat([tensors[n].detach().reshape(-1) for n in names]).to(target)

    def pin() -> Any:
        return torch.empty(numel, dtype=target, pin_memory=cuda)

    def queue_busy() -> None:
        for _ in range(20 if cuda else 0):
            busy @ busy  # queued GPU work, as the optimizer step's kernels are

    results: dict[str, list[float]] = {
        "find_peft": timed(lambda: find_adapter_layout(model, "default", dict(model.named_parameters())), sync,
                           args.reps),
        "find": timed(lambda: peft_adapter(model), sync, args.reps),
        "pack_per_tensor": timed(lambda: (pack_per_tensor(), sync()), sync, args.reps),
        "pack": timed(lambda: (pack(), sync()), sync, args.reps),
        "pin": timed(pin, sync, args.reps),
        "snapshot": timed(lambda: snapshot_peft_adapter(model, dtype=args.dtype), sync, args.reps),
    }
    busy_s, wait_s = [], []
    for _ in range(args.reps):
        sync()
        queue_busy()
        started = time.perf_counter()
        snap = snapshot_peft_adapter(model, dtype=args.dtype)
        taken = time.perf_counter()
        if snap.copied is not None:
            snap.copied.synchronize()
        busy_s.append(taken - started)
        wait_s.append(time.perf_counter() - taken)
    results["snapshot_busy"], results["copy_wait"] = busy_s, wait_s

    machine = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    report = {
        "benchmark": "adapter snapshot phases",
        "machine": machine,
        "adapter": {"tensors": len(names), "bytes": nbytes, "rank": args.rank, "dtype": args.dtype},
        "median_ms": {k: round(statistics.median(v) * 1000, 2) for k, v in results.items()},
        "max_ms": {k: round(max(v) * 1000, 2) for k, v in results.items()},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
