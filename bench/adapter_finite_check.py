"""The server's finite-weights check of an adapter, idle and beside a busy thread (issue 28, item 3).

The server checks every adapter it loads for NaN and Inf before the engine sees it. It runs in a worker thread
while the event loop serves generations: a check that takes the GIL back once per tensor waits behind the busy
thread each time (a GIL convoy), which made adapter loads beside generation ~8x slower than idle on the H200.
This compares the check the server runs (`_check_finite`: numpy bit tests over runs of same-dtype tensors on the
safetensors bytes) with the per-tensor torch check it replaced (`_check_finite_by_tensor`, still the fallback for
dtypes without a bit test), on an adapter of Qwen2.5-1.5B's shape (LoRA r32 on every linear layer of 28 layers:
392 tensors, ~74 MB bf16), each alone and beside a thread that keeps the GIL busy as the event loop does.

    python bench/adapter_finite_check.py --out bench/results/<dir>/adapter_finite_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from grpo_server.adapter_checks import _check_finite, _check_finite_by_tensor

#: Qwen2.5-1.5B: hidden 1536, intermediate 8960, 28 layers, 2 KV heads of 128.
HIDDEN, INTERMEDIATE, LAYERS, KV = 1536, 8960, 28, 256
LINEARS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE), "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}


def make_adapter(folder: Path, rank: int) -> Path:
    tensors = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in LINEARS.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, dtype=torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, dtype=torch.bfloat16) * 0.01
    path = folder / "adapter_model.safetensors"
    save_file(tensors, str(path))
    return path


def busy(stop: threading.Event) -> None:
    """Pure-Python work that holds the GIL between its switch intervals, as a busy event loop does."""
    total = 0
    while not stop.is_set():
        for i in range(10_000):
            total += i * i


def timed(check: Callable[[Path], object], weights: Path, repeats: int, beside_busy: bool) -> list[float]:
    stop = threading.Event()
    thread = threading.Thread(target=busy, args=(stop,), daemon=True)
    if beside_busy:
        thread.start()
    try:
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            check(weights)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        stop.set()
        if beside_busy:
            thread.join()


def compare(results: dict[str, object], variants: list[tuple[str, Callable[[Path], object]]], weights: Path,
            repeats: int) -> None:
    """Time each (label, check) idle and beside a busy thread into results (`<label>_<idle|busy>_s`, medians), and
    the first's time over the second's as `speedup_<idle|busy>`."""
    for label, check in variants:
        for beside_busy in (False, True):
            seconds = timed(check, weights, repeats, beside_busy)
            key = f"{label}_{'busy' if beside_busy else 'idle'}_s"
            results[key] = round(statistics.median(seconds), 4)
            print(f"{key:32s} median {statistics.median(seconds):8.4f} s  runs {[round(s, 4) for s in seconds]}",
                  flush=True)
    (old_label, _), (new_label, _) = variants
    for where in ("idle", "busy"):
        old, new = results[f"{old_label}_{where}_s"], results[f"{new_label}_{where}_s"]
        assert isinstance(old, float) and isinstance(new, float)
        results[f"speedup_{where}"] = round(old / new, 1) if new else None
        print(f"speedup {where}: {results[f'speedup_{where}']}x")


def bench_main(argv: list[str] | None, doc: str | None, variants: list[tuple[str, Callable[[Path], object]]],
               repeats: int = 3) -> int:
    """The command line of a bench comparing two checks of the r-rank adapter (`compare`), its JSON in --out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, object] = {"machine": platform.platform(), "cpus": os.cpu_count(), "rank": args.rank,
                                  "repeats": args.repeats, "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as tmp:
        weights = make_adapter(Path(tmp), args.rank)
        results["adapter_mb"] = round(weights.stat().st_size / 1e6, 1)
        compare(results, variants, weights, args.repeats)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, [("per_tensor_torch", _check_finite_by_tensor), ("bits_numpy", _check_finite)])


if __name__ == "__main__":
    raise SystemExit(main())
