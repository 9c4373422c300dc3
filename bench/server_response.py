"""CPU cost of turning engine results into a `/v1/completions` HTTP body, on the GRPO-shaped workload.

The engine is not involved: the input is the engine-level result of the GRPO-shaped
workload (64 prompts × n=8, completions 64–1,024 tokens: 274,064 sampled tokens with one
logprob each, as TRL asks for with `logprobs=0`), built from seeded random ids. What is
timed is the server's own code from `PromptResult`s to the JSON bytes sent (the response
models, logprob token names, serialisation), i.e. the part of the HTTP path that runs on
the server's event loop for every generation batch. Baseline in the same run: `json.dumps`
of the bare token ids and logprobs, the least any JSON answer carrying them must cost.

    python bench/server_response.py --model MODEL_DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import dump, figure, grpo_shaped, machine

from grpo_server.engines.base import Completion, PromptResult
from grpo_server.responses import Tagging, TokenNamer, completion_response
from grpo_server.routes import tagged
from grpo_server.schemas import CompletionResponse
from grpo_server.service import Generated


def engine_results(vocab: int) -> list[PromptResult]:
    work = grpo_shaped(vocab)
    rng = random.Random(1)
    results = []
    for prompt, length in zip(work.prompts, work.max_tokens, strict=True):
        completions = []
        for _ in range(work.n):
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            lps = [-rng.random() * 5 for _ in range(length)]
            completions.append(Completion(token_ids=ids, logprobs=lps, top_logprobs=[[(t, lp)] for t, lp in
                                                                                     zip(ids, lps, strict=True)],
                                          text="", finish_reason="length"))
        results.append(PromptResult(prompt, completions))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a model directory (for its tokenizer)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tokenizer)
    results = engine_results(vocab)
    tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    tag = Tagging(request_id="cmpl-bench", created=0, model="bench", boot_id="b" * 32, adapter_version=1)
    generated = Generated(results=results, adapter_version=1)

    @functools.cache
    def decode(token_id: int) -> str:  # as GenerationService.decode_token: cached per token id
        return str(tokenizer.decode([token_id]))

    def ours() -> int:
        names = TokenNamer(decode, as_ids=True)
        def build() -> CompletionResponse:
            return completion_response(results, tag, names, with_logprobs=True, return_token_ids=True)

        return len(asyncio.run(tagged(build, generated, tag.boot_id)).body)

    def floor() -> int:
        body = [{"token_ids": c.token_ids, "logprobs": c.logprobs} for r in results for c in r.completions]
        return len(json.dumps(body).encode())

    timings: dict[str, float] = {}
    for name, fn in (("ours", ours), ("json floor", floor)):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        timings[name] = best
        print(f"{name}: {best:.3f} s for {tokens} tokens ({tokens / best:,.0f} tokens/s)", flush=True)
    if args.out:
        dump(args.out, {
            "benchmark": "server response building (/v1/completions, logprobs=0, token ids)",
            "command": f"python bench/server_response.py --model {args.model} --out FILE",
            "machine": machine(), "date": dt.date.today().isoformat(),
            "runs": {k: {"seconds": v, "tokens_per_s": tokens / v} for k, v in timings.items()},
            "figures": [figure("response building, ours", tokens / timings["ours"], "tokens/s",
                               baseline="json.dumps of bare ids + logprobs",
                               baseline_value=tokens / timings["json floor"])],
        })


if __name__ == "__main__":
    main()
