"""What vLLM 0.26's engine core and front end spend per generated token to hand the sampled tokens' logprobs over,
with vLLM's own transport against the compact one (`GRPO_SERVER_LOGPROB_TRANSPORT=compact`; its rows held in
the engine core until each request's last step, and handed over each step as before December 7,
grpo_server/engines/vllm_compact_logprobs.py), and without logprobs (issue 29: generation with logprobs ran at
0.46x of plain on the H100, its front end busy 100% of the time).

No GPU: the same classes the engine runs between its forward passes, on the CPU. Each decoding step of R requests
(one token each): the engine core builds each request's `EngineCoreOutput` (its logprobs sliced from the step's
`LogprobsLists`, as the scheduler does), encodes the step with vLLM's msgpack encoder; the front end decodes it with
vLLM's decoder and runs vLLM's `OutputProcessor` (flat logprobs, no detokenization, final output only: the
server's settings). Sampling, the forward pass and the scheduler's other work are not here. Both sides run in this
one process, so Python's garbage collector, whose passes grow with the front end's live objects, lands on whichever
stage allocates when it runs: each transport is timed with the collector on (as a process runs) and off (the
transport's own work).

    PYTHONPATH=<vLLM 0.26 unpacked> python bench/vllm_logprobs_transport.py --out bench/results/<dir>/x.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from workload import dump, figure, machine

from grpo_server.engines import vllm_compact_logprobs as compact

STAGES = ("engine: outputs", "engine: encode", "front end: decode", "front end: process")


def one_run(requests: int, steps: int, logprobs: int | None, slice_request: Callable[..., Any],
            hold: bool = False) -> dict[str, float]:
    """Microseconds per generated token in each stage, over `steps` steps of `requests` requests; with `hold`, each
    request's rows wait in the engine core for its last step (compact.hold_rows)."""
    processor = compact.output_processor(requests, steps, logprobs)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    rng = np.random.default_rng(0)
    spent = dict.fromkeys(STAGES, 0.0)
    finished = 0
    held: dict[str, compact.HeldRows] = {}

    def columns_of(request_id: str) -> int:
        return 1  # the server's requests: final output only, logprobs=0, no stop strings
    for step in range(steps):
        token_ids = rng.integers(0, 32000, size=(requests, 1)).astype(np.int32)
        lists = LogprobsLists(token_ids, -rng.random((requests, 1), dtype=np.float32),
                              np.ones(requests, dtype=np.int32), None) if logprobs is not None else None
        sampled = token_ids[:, 0].tolist()
        finish = FinishReason.LENGTH if step == steps - 1 else None
        t0 = time.perf_counter()
        outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[sampled[i]],
                                    new_logprobs=slice_request(lists, i, 1) if lists is not None else None,
                                    finish_reason=finish) for i in range(requests)]
        if hold:
            compact.hold_rows(outputs, columns_of, held)
        t1 = time.perf_counter()
        frames = encoder.encode(EngineCoreOutputs(outputs=outputs))
        t2 = time.perf_counter()
        received = decoder.decode(frames)
        t3 = time.perf_counter()
        finished += len(processor.process_outputs(received.outputs).request_outputs)
        t4 = time.perf_counter()
        for stage, (a, b) in zip(STAGES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4)), strict=True):
            spent[stage] += b - a
    assert finished == requests, finished
    return {stage: seconds / (requests * steps) * 1e6 for stage, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512, help="requests decoding together (64 prompts x 8)")
    parser.add_argument("--steps", type=int, default=128, help="decoding steps, one token per request each")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each transport; the median is reported")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    vllm_slice = LogprobsLists.slice_request
    assert compact.enable(), "the compact transport's self-check failed against this vLLM"
    compact._restore()  # each run below installs what it measures
    transports = ("no logprobs", "vLLM's transport, logprobs=0", "compact transport, logprobs=0",
                  "compact transport, rows each step, logprobs=0")
    runs: dict[str, list[dict[str, float]]] = {f"{t}, gc {g}": [] for g in ("on", "off") for t in transports}
    for _ in range(args.repeats):
        for name in runs:
            if name.startswith("compact"):
                compact._patch_front_side()
            if name.endswith("gc off"):
                gc.disable()
            runs[name].append(one_run(args.requests, args.steps, None if name.startswith("no logprobs") else 0,
                                      compact._slice_rows if name.startswith("compact") else vllm_slice,
                                      hold=name.startswith("compact") and "each step" not in name))
            gc.enable()
            compact._restore()
    medians = {name: {stage: statistics.median(r[stage] for r in rs) for stage in STAGES} for name, rs in runs.items()}
    totals = {name: {"engine core": m[STAGES[0]] + m[STAGES[1]], "front end": m[STAGES[2]] + m[STAGES[3]]}
              for name, m in medians.items()}
    for name in runs:
        print(f"{name}: " + ", ".join(f"{stage} {medians[name][stage]:.2f}" for stage in STAGES)
              + f" µs/token; engine core {totals[name]['engine core']:.2f}, front end {totals[name]['front end']:.2f}")
    figures = []
    for g in ("on", "off"):
        vllm_run, ours = totals[f"{transports[1]}, gc {g}"], totals[f"{transports[2]}, gc {g}"]
        each_step = totals[f"{transports[3]}, gc {g}"]
        figures += [figure(f"{side} per generated token with logprobs, compact transport, gc {g}", ours[side], "µs",
                           baseline="vLLM 0.26's own transport", baseline_value=vllm_run[side],
                           higher_is_better=False) for side in ("engine core", "front end")]
        figures += [figure(f"{side} per generated token with logprobs, compact transport, gc {g}", ours[side], "µs",
                           baseline="the same, rows handed over each step", baseline_value=each_step[side],
                           higher_is_better=False) for side in ("engine core", "front end")]
    dump(args.out, {
        "benchmark": "vLLM 0.26's logprob transport, engine core to front end, per generated token (CPU)",
        "command": f"PYTHONPATH=<vLLM 0.26 unpacked> python bench/vllm_logprobs_transport.py --requests "
                   f"{args.requests} --steps {args.steps} --repeats {args.repeats} --out {args.out}",
        "machine": machine(), "date": dt.date.today().isoformat(),
        "us_per_token": medians, "sides_us_per_token": totals, "figures": figures,
    })


if __name__ == "__main__":
    main()
