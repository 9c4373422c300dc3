"""Generation baselines on the GPU: vLLM `LLM.generate` variants and HF `generate`.

Where does the logprobs cost come from? The same engine (enable_lora, processed
logprobs) runs the GRPO-shaped workload plain, with `logprobs=0`, and with the
settings that avoid per-token Python objects in the frontend (`flat_logprobs`,
`detokenize=False`), with and without a LoRA adapter. For each run it records
tokens/s and the CPU seconds of the frontend process and of vLLM's engine core: a
process that burns as much CPU as the wall time is the bottleneck, not the GPU.
With the engine's stats on (`--server-engine`) each run also counts its engine
steps from vLLM's own metrics, as gen_server.py and gen_async.py do.

    python bench/gen_offline.py --model MODEL_DIR --out $OUT/gen_offline.json [--profile DIR]

`--profile DIR` samples this process and vLLM's engine-core child with py-spy during
the LoRA runs with and without logprobs (raw stacks; `bench/profile_summary.py`), and with
`--quick` during the plain and `logprobs=0` runs.

`--server-engine` builds the engine with the arguments `grpo serve` gives vLLM for gen_server.py's
pushed-weights server (`vllm_engine.engine_args`, ipc weight transfer, its worker extension, stats on, no
LoRA) and the batch limits vLLM sets for `vllm serve` on the GPU (H100: 1024 sequences, 8192 tokens a step): is a
gap between the server and `LLM.generate` in the engine's configuration or in the server's path to it?
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, dump, figure, grpo_shaped, machine


def make_adapter(model_dir: Path, out_dir: Path, rank: int = 32, seed: int = 0) -> Path:
    """A random r=`rank` all-linear LoRA adapter saved by PEFT (both A and B random, so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.mul_(0.01)  # small: a plausible trained adapter, not noise that swamps the base
    peft_model.save_pretrained(out_dir)
    del peft_model, model
    gc.collect()
    return out_dir


def offline_steps(llm: Any) -> dict[str, float]:
    """vLLM's step counters in this process (the engine's stats on, as the server's are), as gen_server.py reads
    them from the server's /metrics; none with stats off."""
    from gen_server import process_steps

    return {} if llm.llm_engine.log_stats is False else process_steps()


def run_llm(llm: Any, work: Workload, *, logprobs: int | None, flat: bool, detokenize: bool,
            lora: Any | None) -> dict[str, float]:
    from gen_server import cpu_seconds, step_figures
    from vllm import SamplingParams, TokensPrompt

    def engine_cpu() -> float:  # vLLM's engine core, a child of this process; py-spy (--profile) left out
        return cpu_seconds(os.getpid(), leave_out="py-spy")["engine_cpu_s"]

    params = [
        SamplingParams(n=work.n, temperature=1.0, max_tokens=m, ignore_eos=True, seed=i, logprobs=logprobs,
                       flat_logprobs=flat, detokenize=detokenize)
        for i, m in enumerate(work.max_tokens)
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    before, engine0 = offline_steps(llm), engine_cpu()
    cpu0, t0 = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = step_figures(before, offline_steps(llm), wall)
    steps["engine_cpu_s"] = engine_cpu() - engine0
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if logprobs is not None:
        got = sum(len(c.logprobs or []) for o in outputs for c in o.outputs)
        assert got == tokens, f"expected a logprob per token, got {got} for {tokens}"
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "frontend_cpu_s": cpu, **steps}


def profiled(out: Path | None, name: str, seconds: int) -> subprocess.Popen[bytes] | None:
    """py-spy over this process and its children for `seconds`, if py-spy is installed."""
    spy = shutil.which("py-spy")
    if out is None or spy is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    stem = name.replace(" ", "_").replace("=", "")
    return subprocess.Popen(
        [spy, "record", "--pid", str(os.getpid()), "--subprocesses", "--duration", str(seconds), "--rate", "50",
         "--format", "raw", "--nonblocking", "--output", str(out / f"offline-{stem}.txt")],
        stdout=(out / f"py-spy-{stem}.log").open("wb"), stderr=subprocess.STDOUT,
    )


def server_engine_kwargs(model_dir: Path) -> dict[str, Any]:
    """`LLM` keyword arguments: every engine argument in which gen_server.py's pushed-weights server (ipc) differs
    from vLLM's defaults, and the batch limits the server's engine takes on this GPU (its usage context's)."""
    import dataclasses

    from gen_server import SERVER
    from vllm.engine.arg_utils import EngineArgs

    from grpo_api.models import ServerSpec
    from grpo_server.engines.vllm_engine import USAGE_CONTEXT, engine_args, prepare_ipc_weight_transfer

    ours = engine_args(model_dir, "bench", ServerSpec.model_validate(SERVER), "ipc")
    defaults = EngineArgs(model=str(model_dir))
    kwargs = {f.name: getattr(ours, f.name) for f in dataclasses.fields(EngineArgs)
              if f.name not in ("model", "served_model_name") and getattr(ours, f.name) != getattr(defaults, f.name)}
    tokens, seqs = ours.get_batch_defaults(world_size=1)
    prepare_ipc_weight_transfer()
    # LLM turns stats off unless told; the server's are on
    return {**kwargs, "disable_log_stats": ours.disable_log_stats, "max_num_seqs": seqs[USAGE_CONTEXT],
            "max_num_batched_tokens": tokens[USAGE_CONTEXT], "seed": 0}


def hf_generate(model_dir: Path, work: Workload) -> dict[str, float]:
    """HF generate, padded batch that runs to its longest completion; useful tokens = assigned lengths."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in work.prompts)
    ids = torch.zeros((len(work.prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=1.0, top_k=0,
            max_new_tokens=max(work.max_tokens), min_new_tokens=max(work.max_tokens),
            num_return_sequences=work.n, pad_token_id=0,
        )
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - width) * out.shape[0]
    useful = work.completion_tokens
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens": useful, "generated_padded": generated, "seconds": wall, "tokens_per_s": useful / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--adapter-dir", type=Path, default=Path("/tmp/bench-adapter-r32"))
    parser.add_argument("--hf-prompts", type=int, default=8, help="prompts for the (slow) HF baseline")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy two LoRA runs into this folder")
    parser.add_argument("--quick", action="store_true",
                        help="only the plain and logprobs=0 runs (the baselines of gen_server.py http --weights)")
    parser.add_argument("--server-engine", action="store_true",
                        help="the engine arguments of gen_server.py's pushed-weights server (implies --quick: no LoRA)")
    args = parser.parse_args()
    args.quick = args.quick or args.server_engine

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    work = grpo_shaped(vocab)
    adapter = make_adapter(args.model, args.adapter_dir)
    engine_kwargs = server_engine_kwargs(args.model) if args.server_engine else {
        "dtype": "bfloat16", "enable_lora": True, "max_loras": 2, "max_lora_rank": 32,
        "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": 2048, "seed": 0}
    print("engine arguments", {k: str(v) for k, v in engine_kwargs.items()}, flush=True)
    llm = LLM(model=str(args.model), **engine_kwargs)
    lora = LoRARequest("bench-v1", 1, str(adapter))
    warm = work.subset(8)
    run_llm(llm, warm, logprobs=None, flat=False, detokenize=True, lora=None)
    run_llm(llm, warm, logprobs=0, flat=True, detokenize=False, lora=lora if engine_kwargs.get("enable_lora") else None)

    runs: dict[str, dict[str, float]] = {}
    variants = [
        ("plain", None, False, True, None),
        ("logprobs=0", 0, False, True, None),
        ("logprobs=0 flat_logprobs", 0, True, True, None),
        ("logprobs=0 detokenize=False", 0, False, False, None),
        ("logprobs=0 flat_logprobs detokenize=False", 0, True, False, None),
        ("lora plain", None, False, True, lora),
        ("lora logprobs=0", 0, False, True, lora),
        ("lora logprobs=0 flat_logprobs detokenize=False", 0, True, False, lora),
    ]
    profile = {"lora plain", "lora logprobs=0 flat_logprobs detokenize=False"}
    if args.quick:
        variants = variants[:2]
        profile = {"plain", "logprobs=0"}
    for name, logprobs, flat, detok, req in variants:
        spy = profiled(args.profile, name, 8) if name in profile else None
        runs[name] = run_llm(llm, work, logprobs=logprobs, flat=flat, detokenize=detok, lora=req)
        if spy is not None:
            spy.wait(60)
        print(name, json.dumps(runs[name]), flush=True)
    del llm
    gc.collect()
    if not args.quick:
        runs["hf generate"] = hf_generate(args.model, work.subset(args.hf_prompts))
        print("hf generate", json.dumps(runs["hf generate"]), flush=True)

    base = runs["plain"]["tokens_per_s"]
    figures = [
        figure(f"LLM.generate {name}", r["tokens_per_s"], "tokens/s", baseline="LLM.generate plain",
               baseline_value=base)
        for name, r in runs.items() if name != "hf generate"
    ]
    if "hf generate" in runs:
        figures.append(figure("HF generate (useful tokens)", runs["hf generate"]["tokens_per_s"], "tokens/s",
                              baseline="LLM.generate plain", baseline_value=base))
    figures += [
        figure(f"frontend CPU share, {name}", r["frontend_cpu_s"] / r["seconds"], "CPU s / wall s")
        for name, r in runs.items() if "frontend_cpu_s" in r
    ]
    dump(args.out, {
        "benchmark": "generation baselines (vLLM LLM.generate variants, HF generate)",
        "command": f"python bench/gen_offline.py --model {args.model} --out $OUT/gen_offline.json"
                   + (" --quick" if args.quick else "") + (" --server-engine" if args.server_engine else ""),
        "engine_arguments": {k: str(v) for k, v in engine_kwargs.items()},
        "machine": machine(), "date": dt.date.today().isoformat(),
        "workload": f"{len(work.prompts)} prompts × n={work.n}, prompts 64–512 tokens, completions 64–1024",
        "runs": runs, "figures": figures,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    })


if __name__ == "__main__":
    main()
