"""How two processes share one GPU: a decode-shaped loop alone, and beside a training-shaped process.

Why: on the H200 our server generated a 32 x 256-token batch in 0.95 s alone and in 5.9-11 s while the
trainer process trained (prefetchDepth 2), and an adapter load took 0.65 s alone and 5-6 s beside it
(BENCHMARKS.md). Without MPS, kernels of two processes never run at the same time: the GPU gives each
process's context time slices, so a loop of small kernels with a host sync per iteration (what a decode
step is) waits for the other process's slice at every sync.

This measures it without vLLM: process A runs `--iters` decode-shaped iterations (a few small matmuls,
then `.item()`); process B runs large bf16 matmuls back to back (a training step's shape). A's
per-iteration latency alone and beside B, and B's throughput alone and beside A, go to `--out`.
`--mps` repeats the pair under a CUDA MPS control daemon started for this run only (private pipe and
log directories, stopped at the end; the GPU's compute mode is not changed), where kernels of both
processes may run at once.

    python bench/gpu_share.py --out $OUT/gpu_share.json [--mps]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def decode_loop(iters: int, hidden: int, batch: int, layers: int) -> dict[str, float]:
    import torch

    weights = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # warm-up
        y = x
        for w in weights:
            y = torch.nn.functional.silu(y @ w)
        y.sum().item()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        y = x
        for w in weights:
            y = torch.nn.functional.silu(y @ w)
        y.sum().item()  # the host waits for the step, as a sampler does
        times.append(time.perf_counter() - start)
    return {"iter_ms_median": statistics.median(times) * 1e3, "iter_ms_mean": statistics.fmean(times) * 1e3,
            "iter_ms_p90": sorted(times)[int(0.9 * len(times))] * 1e3, "iters": iters}


def train_loop(seconds: float, size: int) -> dict[str, float]:
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        done += 8
    elapsed = time.perf_counter() - start
    return {"tflops": 2 * size**3 * done / elapsed / 1e12, "seconds": elapsed}


def child(role: str, args: argparse.Namespace) -> None:
    if role == "decode":
        result = decode_loop(args.iters, args.hidden, args.batch, args.layers)
    else:
        result = train_loop(args.train_seconds, args.size)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(role: str, args: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, __file__, "--role", role, "--iters", str(args.iters), "--hidden", str(args.hidden),
            "--batch", str(args.batch), "--layers", str(args.layers), "--size", str(args.size),
            "--train-seconds", str(args.train_seconds)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)


def result_of(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child exited {proc.returncode}")
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


def pair(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    decode_alone = result_of(spawn("decode", args, env))
    train_alone = result_of(spawn("train", args, env))
    trainer = spawn("train", args, env)
    time.sleep(min(3.0, args.train_seconds / 4))  # the trainer is past its start-up and running kernels
    decode_beside = result_of(spawn("decode", args, env))
    train_beside = result_of(trainer)
    return {
        "decode_alone": decode_alone, "decode_beside_training": decode_beside,
        "train_alone": train_alone, "train_beside_decode": train_beside,
        "decode_slowdown": decode_beside["iter_ms_median"] / decode_alone["iter_ms_median"],
    }


def with_mps(args: argparse.Namespace) -> dict[str, Any]:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {"skipped": "nvidia-cuda-mps-control is not on PATH"}
    root = Path(tempfile.mkdtemp(prefix="gpu-share-mps-"))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(root / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(root / "log"))
    (root / "pipe").mkdir()
    (root / "log").mkdir()
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        return {"skipped": f"MPS daemon did not start: {started.stderr.strip() or started.returncode}"}
    try:
        return pair(args, env)
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["decode", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=400, help="decode-shaped iterations timed")
    parser.add_argument("--hidden", type=int, default=1536, help="decode matmul width (the 1.5B model's)")
    parser.add_argument("--batch", type=int, default=32, help="decode batch (sequences per step)")
    parser.add_argument("--layers", type=int, default=28, help="matmuls per decode iteration")
    parser.add_argument("--size", type=int, default=8192, help="the training loop's square matmul size")
    parser.add_argument("--train-seconds", type=float, default=12.0, help="how long the training loop runs")
    parser.add_argument("--mps", action="store_true", help="also measure under a private CUDA MPS daemon")
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args()
    if args.role:
        child(args.role, args)
        return
    result: dict[str, Any] = {"benchmark": "one GPU, two processes: decode-shaped loop beside a training loop",
                              "command": "python bench/gpu_share.py" + (" --mps" if args.mps else ""),
                              "time_sliced": pair(args, dict(os.environ))}
    if args.mps:
        result["mps"] = with_mps(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
