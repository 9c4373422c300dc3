"""Where an adapter load's time goes in vLLM 0.26 (issue 28: adapter sync p50 <= 100 ms).

On the H200 the server's `engine load` phase (`add_lora`, awaited) is 0.15-0.27 s of a 0.2-0.3 s sync
(bench/results/2026-12-04-h200-lease2/long-sync-server-vllm.log), so it is the largest phase. This runs
the engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that cProfile sees the worker's
`_load_adapter` (safetensors read, the per-tensor cast and `pin_memory`, packing qkv/gate_up, the second
pinning, the copy into the GPU slots), then loads `--versions` fresh versions of an r=32 bf16 adapter
(what the trainer publishes: one file per version, page cache warm), each followed by a short generation
with it, as the server does, evicting versions older than the previous one.

Variants, in one engine: `stock` (vLLM as shipped), `unpinned` (vLLM's PIN_MEMORY off in the LoRA
modules: host tensors are pageable, the copy into the GPU slots is synchronous), so the pinning's share
is measured, not guessed, and `gpu-resident` (the worker loads the adapter's tensors straight onto the GPU
instead of into pinned host memory: packing and the copy into the slots are then device-to-device; the cost is
the registered versions' bytes in GPU memory, 74 MB each here).

    python3 bench/lora_load_profile.py --model /tmp/m15 --adapter /tmp/bench-adapter-r32 --out $OUT/lora_load.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core (and its worker) in this process


def bf16_versions(adapter: Path, work: Path, count: int) -> list[Path]:
    """`count` copies of the adapter in bf16 (as the trainer publishes it), each in its own folder."""
    import torch
    from safetensors.torch import load_file, save_file

    source = load_file(adapter / "adapter_model.safetensors")
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in source.items()}
    shutil.rmtree(work, ignore_errors=True)
    out = []
    for k in range(count):
        d = work / f"v{k + 1}"
        d.mkdir(parents=True)
        save_file(tensors, d / "adapter_model.safetensors", metadata={"format": "pt"})
        shutil.copy(adapter / "adapter_config.json", d / "adapter_config.json")
        out.append(d)
    return out


def set_pinning(on: bool) -> None:
    import vllm.lora.lora_model as lora_model
    import vllm.lora.lora_weights as lora_weights
    import vllm.lora.model_manager as model_manager

    for module in (lora_model, lora_weights, model_manager):
        if hasattr(module, "PIN_MEMORY"):
            module.PIN_MEMORY = on


def set_gpu_resident(llm: Any, on: bool) -> str:
    """The server's own switch (grpo_server/engines/vllm_lora_load.py, through vLLM's worker extension and
    collective_rpc): the worker's LoRA loads put the tensors on its GPU (vLLM loads them to "cpu")."""
    from grpo_server.engines.vllm_lora_load import SET_DEVICE

    return ",".join(map(str, llm.collective_rpc(SET_DEVICE, args=(on,))))


def top(profile: cProfile.Profile, key: str, lines: int) -> str:
    buffer = io.StringIO()
    pstats.Stats(profile, stream=buffer).sort_stats(key).print_stats(lines)
    return buffer.getvalue()


def run_variant(llm: Any, name: str, dirs: list[Path], first_id: int, warmup: int) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompt = [TokensPrompt(prompt_token_ids=list(range(100, 164)))]
    profile = cProfile.Profile()
    rows = []
    for k, d in enumerate(dirs):
        lora_id = first_id + k
        request = LoRARequest(f"{name}-v{k + 1}", lora_id, str(d))
        measured = k >= warmup
        torch.cuda.synchronize()
        started = time.perf_counter()
        if measured:
            profile.enable()
        engine.add_lora(request)
        torch.cuda.synchronize()
        if measured:
            profile.disable()
        loaded = time.perf_counter()
        llm.generate(prompt, params, lora_request=request, use_tqdm=False)
        generated = time.perf_counter()
        if k >= 2:  # the server keeps the previous version for requests still running on it
            engine.remove_lora(lora_id - 2)
        rows.append({"version": k + 1, "add_lora_s": loaded - started, "first_generate_s": generated - loaded,
                     "measured": measured})
    loads = [r["add_lora_s"] for r in rows if r["measured"]]
    gens = [r["first_generate_s"] for r in rows if r["measured"]]
    for lora_id in list(engine.list_loras()):
        engine.remove_lora(lora_id)
    return {
        "variant": name, "rows": rows,
        "add_lora_p50_s": statistics.median(loads), "add_lora_mean_s": statistics.fmean(loads),
        "first_generate_p50_s": statistics.median(gens),
        "profile_cumulative": top(profile, "cumulative", 45), "profile_tottime": top(profile, "tottime", 30),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True, help="a PEFT LoRA adapter of the model (any dtype)")
    parser.add_argument("--versions", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora-load-profile"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm import LLM

    from grpo_server.engines.vllm_lora_load import EXTENSION

    dirs = bf16_versions(args.adapter, args.work, args.versions)
    size = sum(p.stat().st_size for p in dirs[0].iterdir())
    started = time.perf_counter()
    llm = LLM(model=str(args.model), dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=32,
              max_cpu_loras=4, enforce_eager=True, gpu_memory_utilization=0.4, max_model_len=1024,
              worker_extension_cls=EXTENSION)
    engine_start = time.perf_counter() - started
    results = {"engine_start_s": engine_start, "adapter_bytes": size, "variants": []}
    variants = (("stock", True, False), ("unpinned", False, False), ("gpu-resident", True, True),
                ("stock-again", True, False))
    for i, (name, pinned, on_gpu) in enumerate(variants):
        set_pinning(pinned)
        where = set_gpu_resident(llm, on_gpu)
        variant = run_variant(llm, name, dirs, first_id=1 + i * 100, warmup=args.warmup)
        variant["loads_onto"] = where
        results["variants"].append(variant)
        print(f"{name} (loads onto {where}): add_lora p50 {variant['add_lora_p50_s'] * 1000:.1f} ms, mean "
              f"{variant['add_lora_mean_s'] * 1000:.1f} ms; first generate p50 "
              f"{variant['first_generate_p50_s'] * 1000:.1f} ms", flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    for variant in results["variants"][:3]:
        print(f"==== {variant['variant']}: cumulative\n{variant['profile_cumulative']}")
        print(f"==== {variant['variant']}: tottime\n{variant['profile_tottime']}")


if __name__ == "__main__":
    main()
