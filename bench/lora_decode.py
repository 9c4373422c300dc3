"""What the LoRA kernels cost a GRPO step's generation, and which vLLM setting removes it.

A GRPO step of the generation-heavy workload decodes 32 sequences (4 prompts × n=8) of
1,024 tokens; with `prefetchDepth: 2` two such batches, on two adapter versions, decode
together. This runs exactly those batches on `LLM.generate` with our server's sampling path
(`logprobs=0`, `flat_logprobs`, `detokenize=False`, processed logprobs, temperature 1,
ignore_eos), on the base model and with adapters active, once per engine setting; each
setting is a fresh engine in its own process (the settings are fixed at engine start):

- default: what our server asks for (max_loras 4, max_lora_rank 32, CUDA graphs);
- specialize: `specialize_active_lora=True` (kernel grids and CUDA graphs sized by the number of
  adapters in the batch instead of max_loras + 1);
- dual-stream: `VLLM_LORA_ENABLE_DUAL_STREAM=1` (the LoRA path on a second CUDA stream,
  overlapping the base layer's GEMM).

    python bench/lora_decode.py --model MODEL_DIR --adapter ADAPTER_DIR --settings default,specialize \
        --out $OUT/lora_decode.json

A setting takes 130–150 s on an H200 (engine start included); one whose environment changes
vLLM's compile-cache key (dual-stream) compiles afresh and needs up to ~250 s, so run it in a
call of its own.

Each batch's wall time divided by its 1,024 decoding steps is the per-step latency; the LoRA cost
is that latency with adapters over the base model's, in the same engine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import dump, figure, grpo_shaped, machine

#: name → (extra LLM kwargs, extra environment)
SETTINGS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "default": ({}, {}),
    "specialize": ({"specialize_active_lora": True}, {}),
    "dual-stream": ({}, {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}),
}
COMPLETION = 1024


def batches(llm: Any, adapter: Path, vocab: int) -> dict[str, dict[str, float]]:
    """The step-shaped batches on one engine: base, one adapter, two adapter versions."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    work = grpo_shaped(vocab, prompts=8, completion_len=(COMPLETION, COMPLETION), seed=1)
    v1, v2 = LoRARequest("bench-v1", 1, str(adapter)), LoRARequest("bench-v2", 2, str(adapter))

    def run(prompts: int, loras: list[Any] | None) -> dict[str, float]:
        params = [SamplingParams(n=work.n, temperature=1.0, max_tokens=COMPLETION, ignore_eos=True, seed=i,
                                 logprobs=0, flat_logprobs=True, detokenize=False) for i in range(prompts)]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in work.prompts[:prompts]]
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        assert tokens == prompts * work.n * COMPLETION, tokens
        return {"sequences": prompts * work.n, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
                "ms_per_step": 1000 * wall / COMPLETION}

    run(2, None)  # warm-up: both adapters loaded, graphs used once
    run(2, [v1, v2])
    runs = {
        "32 base": run(4, None),
        "32 lora": run(4, [v1] * 4),
        "64 base": run(8, None),
        "64 lora one version": run(8, [v1] * 8),
        "64 lora two versions": run(8, [v1] * 4 + [v2] * 4),
        "32 lora again": run(4, [v1] * 4),
    }
    return runs


def child(args: argparse.Namespace) -> None:
    from vllm import LLM

    kwargs, _ = SETTINGS[args.child]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    llm = LLM(model=str(args.model), dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=32,
              max_cpu_loras=8, logprobs_mode="processed_logprobs", gpu_memory_utilization=0.45,
              max_model_len=2048, seed=0, **kwargs)
    Path(args.result).write_text(json.dumps(batches(llm, args.adapter, vocab)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--out", help="JSON result (parent)")
    parser.add_argument("--settings", default="default,specialize", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--timeout", type=float, default=280, help="seconds per setting")
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, Any] = {}
    for name in args.settings.split(","):
        kwargs, extra_env = SETTINGS[name]
        result = Path(f"/tmp/lora-decode-{name}.json")
        result.unlink(missing_ok=True)
        argv = [sys.executable, __file__, "--model", str(args.model), "--adapter", str(args.adapter),
                "--child", name, "--result", str(result)]
        t0 = time.perf_counter()
        try:
            code = subprocess.run(argv, env={**os.environ, **extra_env}, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = -1
        entry: dict[str, Any] = {"engine_args": kwargs, "env": extra_env, "exit_code": code,
                                 "wall_s": time.perf_counter() - t0}
        if result.is_file():
            entry["runs"] = json.loads(result.read_text())
        results[name] = entry
        print(name, json.dumps(entry), flush=True)
    figures = []
    for name, entry in results.items():
        runs = entry.get("runs", {})
        if "32 base" not in runs:
            continue
        base32, base64 = runs["32 base"]["ms_per_step"], runs["64 base"]["ms_per_step"]
        for run, r in runs.items():
            base = base64 if run.startswith("64") else base32
            figures.append(figure(f"{name}: {run}, ms per decoding step", r["ms_per_step"], "ms",
                                  baseline=f"{name}: {run[:2]} base", baseline_value=base, higher_is_better=False))
    dump(args.out, {
        "benchmark": "LoRA decode cost at GRPO step batch sizes, per vLLM setting",
        "command": f"python bench/lora_decode.py --model {args.model} --adapter {args.adapter} "
                   f"--settings {args.settings} --out $OUT/lora_decode.json",
        "machine": machine(), "date": dt.date.today().isoformat(),
        "workload": f"prompts 64–512 tokens, n=8, {COMPLETION} tokens each, logprobs=0 flat, detokenize off",
        "settings": results, "figures": figures,
    })


if __name__ == "__main__":
    main()
