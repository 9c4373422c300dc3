"""Where the pushed-weights server's gap to `LLM.generate` lies: one engine, several ways in (issue 29).

The H100's tenth lease measured, on one host and the same workload (gen_offline.py's and gen_server.py's), the
same engine steps (~998) for `LLM.generate` plain and for the server, but slower ones through the server: 6.5 ms
a step against 8.3 without logprobs. This starts the server's own engine in-process (`VllmEngine` with the
pushed-weights server's arguments: ipc weight transfer, no LoRA, the compact transport, the frozen heap) and
generates the workload

- through vLLM's `AsyncLLM.generate` itself, with `LLM.generate`'s sampling parameters (`raw plain`): vLLM's async
  path, nothing of ours;
- through `VllmEngine.generate` without and with logprobs (`ours plain`; `ours logprobs sampler`, the spec's
  default, through the compact transport; `ours logprobs auto`, scored in a prefill pass): the server's path
  minus HTTP and JSON;
- through `AsyncLLM.generate` again, plain, once as before and once while nvidia-smi samples the GPU every 100 ms
  as gen_server.py's runs do (its `LLM.generate` baselines are not sampled).

Against `LLM.generate` (gen_offline.py --server-engine) and the HTTP server (gen_server.py http --weights ipc)
this splits the gap into vLLM's async front end, our engine wrapper, and HTTP. Each run records tokens/s, its engine
steps (vLLM's own metrics, in this process), and the CPU seconds of this process (the front end) and of the
engine core.

    python bench/gen_async.py --model MODEL_DIR --out $OUT/gen_async.json \
        [--offline $OUT/gen_offline_server_engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_server import GpuBusy, cpu_seconds, process_steps, server_spec, step_figures
from workload import Workload, dump, figure, grpo_shaped, machine


async def each_prompt(work: Workload, one: Callable[[int, list[int], int], Awaitable[int]]) -> int:
    """`one(i, prompt, max_tokens)` for every prompt of the workload at once; the tokens they generated."""
    return sum(await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens,
                                                                                  strict=True)))))


async def raw_run(llm: Any, work: Workload, tag: str) -> int:
    """The workload through vLLM's AsyncLLM.generate, the sampling parameters LLM.generate's plain run uses
    (gen_offline.py), the final output only and no detokenization, as the server asks."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int, ids: list[int], max_tokens: int) -> int:
        params = SamplingParams(n=work.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{tag}-{i}"):
            final = output
        assert final is not None and final.finished
        return sum(len(c.token_ids) for c in final.outputs)

    return await each_prompt(work, one)


async def ours_run(engine: Any, work: Workload, logprobs: bool, source: str = "sampler") -> int:
    """The workload through VllmEngine.generate, as the server's completions route calls it (one prompt a call),
    the sampled tokens' logprobs from `source` (spec.server.logprobsSource: sampler, or auto: scored in a prefill
    pass)."""
    from grpo_server.engines.base import SamplingOptions

    engine.logprobs_source = source

    async def one(i: int, ids: list[int], max_tokens: int) -> int:
        options = SamplingOptions(n=work.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i,
                                  logprobs=logprobs)
        [result] = await engine.generate([ids], options, None)
        assert not logprobs or all(len(c.logprobs) == len(c.token_ids) for c in result.completions)
        return sum(len(c.token_ids) for c in result.completions)

    return await each_prompt(work, one)


async def measure(engine: Any, work: Workload) -> dict[str, dict[str, float]]:
    runs: dict[str, dict[str, float]] = {}
    cases = [("raw plain", lambda w, tag: raw_run(engine.llm, w, tag)),
             ("ours plain", lambda w, tag: ours_run(engine, w, False)),
             ("ours logprobs sampler", lambda w, tag: ours_run(engine, w, True, "sampler")),
             ("ours logprobs auto", lambda w, tag: ours_run(engine, w, True, "auto")),
             ("raw plain again", lambda w, tag: raw_run(engine.llm, w, tag)),
             # gen_server.py samples the GPU's utilization with nvidia-smi every 100 ms during its runs, and
             # LLM.generate's runs are not sampled: does the sampling itself cost the engine anything?
             ("raw plain, nvidia-smi sampling", lambda w, tag: raw_run(engine.llm, w, tag))]
    for name, case in cases:
        await case(work.subset(8), f"warm-{len(runs)}")
        cpu0, steps0 = cpu_seconds(os.getpid()), process_steps()
        gpu = GpuBusy() if "nvidia-smi" in name else None
        t0 = time.perf_counter()
        tokens = await case(work, str(len(runs)))
        wall = time.perf_counter() - t0
        busy = gpu.stop() if gpu is not None else {}  # before the CPU: nvidia-smi is a child of this process
        cpu1, steps1 = cpu_seconds(os.getpid()), process_steps()
        runs[name] = {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
                      "frontend_cpu_s": cpu1["server_cpu_s"] - cpu0["server_cpu_s"],
                      "engine_cpu_s": cpu1["engine_cpu_s"] - cpu0["engine_cpu_s"],
                      **step_figures(steps0, steps1, wall), **busy}
        print(name, json.dumps(runs[name]), flush=True)
    return runs


async def main_async(model: Path) -> tuple[dict[str, dict[str, float]], float]:
    from transformers import AutoTokenizer

    from grpo_server.engines.vllm_engine import VllmEngine

    engine = VllmEngine(model, "bench", server_spec(), AutoTokenizer.from_pretrained(model), weight_transfer="ipc")
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    try:
        return await measure(engine, grpo_shaped(vocab)), start_s
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--offline", type=Path, default=None,
                        help="gen_offline.py --server-engine's JSON: LLM.generate plain, the ratios' baseline")
    args = parser.parse_args()
    runs, start_s = asyncio.run(main_async(args.model))
    base = runs["raw plain"]["tokens_per_s"]
    baseline = "AsyncLLM.generate plain (raw)"
    if args.offline is not None and args.offline.is_file():
        base = json.loads(args.offline.read_text())["runs"]["plain"]["tokens_per_s"]
        baseline = "LLM.generate plain (gen_offline --server-engine)"
    dump(args.out, {
        "benchmark": "one engine (the pushed-weights server's), several ways in: vLLM's AsyncLLM (also while "
                     "nvidia-smi samples the GPU), VllmEngine plain and with logprobs from each source",
        "command": f"python bench/gen_async.py --model {args.model} --out $OUT/gen_async.json"
                   + (f" --offline {args.offline}" if args.offline else ""),
        "machine": machine(), "date": dt.date.today().isoformat(), "engine_start_s": start_s,
        "workload": "64 prompts × n=8, prompts 64–512 tokens, completions 64–1024", "runs": runs,
        "figures": [figure(name, r["tokens_per_s"], "tokens/s", baseline=baseline, baseline_value=base)
                    for name, r in runs.items()],
    })


if __name__ == "__main__":
    main()
