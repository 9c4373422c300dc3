"""A full push's phases through the trainer's own loader: the server's weight loads (vLLM's layerwise reload
against in place, the default) and the snapshot's form (packed against one allocation per tensor).

    python bench/weight_push.py --model /tmp/m15 --out $OUT/weight_push.json          # GPU: vllm, ipc
    python bench/weight_push.py --model M --cpu --out /tmp/weight_push.json          # CPU smoke: transformers, gloo

For each of `--weight-loads` (GRPO_SERVER_WEIGHT_LOADS: layerwise, in-place) it starts `grpo serve` taking
pushed weights (gen_server.start_server: a merged-sync run's server), loads the model as the trainer holds it
(bf16, on the GPU), and pushes `--reps` versions of each of `--forms`, alternating, through
`grpo_trainer.transport.weight_sync.WeightLoader` (health, the channel's start/send/finish, the confirming
`/health/`), recording each push's `PushPhases` and the trainer's allocated GPU memory once the push's snapshot
is freed (it must not grow: a pushed buffer the server let go of is freed):

- packed: `take_snapshot`, the trainer's: every copy a view of one buffer, so the server opens one CUDA IPC
  allocation per push;
- separate: each parameter copied into its own allocation (the trainer's snapshot before packing).

The first push of each form is a warm-up (excluded from the medians). After the last push a greedy completion
must come back on that version. Writes the per-push phases and their medians by `loads/form`, and each ratio
to the first of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_server import TOKEN, start_server, stop_server
from workload import machine

from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER
from grpo_trainer.transport.server_client import ServerClient
from grpo_trainer.transport.weight_sync import PushedWeights, WeightLoader, WeightSnapshot, take_snapshot

FORMS = ("packed", "separate")


def separate_snapshot(model: Any, dtype: str) -> WeightSnapshot:
    import torch

    target = getattr(torch, dtype)
    with torch.no_grad():
        return WeightSnapshot({name: param.detach().to(dtype=target, copy=True).contiguous()
                               for name, param in model.named_parameters()})


def push(loader: WeightLoader, client: ServerClient, snapshot: WeightSnapshot, version: int) -> dict[str, float]:
    started = time.perf_counter()
    loader.load(client, PushedWeights(version=version, snapshot=snapshot))
    total = time.perf_counter() - started
    phases = loader.last_phases
    assert phases is not None
    return {"total": total, **phases.seen, **{f"server_{k}": v for k, v in phases.by_server.items()}}


def medians(pushes: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(p[key] for p in pushes) for key in pushes[0]}


def pushes_on(server_env: dict[str, str], args: argparse.Namespace, model: Any, dtype: str,
              forms: list[str]) -> tuple[dict[str, list[dict[str, float]]], float]:
    """Start a server with `server_env`, push `args.reps` + 1 versions of each form, alternating; the pushes by
    form and the server's start time."""
    import torch

    overrides = {"engine": "transformers", "dtype": dtype} if args.cpu else None
    work = Path(tempfile.mkdtemp(prefix="grpo-bench-push-"))
    proc, _, start_s = start_server(args.model, work, args.port, weights="ipc", overrides=overrides, env=server_env)
    try:
        client = ServerClient(f"http://127.0.0.1:{args.port}", token=TOKEN, generation_timeout=300)
        loader = WeightLoader()
        runs: dict[str, list[dict[str, float]]] = {form: [] for form in forms}
        version = 0
        for rep in range(args.reps + 1):
            for form in forms if rep % 2 == 0 else forms[::-1]:
                snapshot = take_snapshot(model, dtype) if form == "packed" else separate_snapshot(model, dtype)
                version += 1
                runs[form].append(push(loader, client, snapshot, version))
                del snapshot
                if not args.cpu:
                    torch.cuda.ipc_collect()
                    runs[form][-1]["trainer_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
                print(server_env, form, version, json.dumps({k: round(v, 4) for k, v in runs[form][-1].items()}),
                      flush=True)
        body = {"prompt": [[5, 6, 7, 8]], "max_tokens": 4, "temperature": 0.0}
        answer = httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers[WEIGHTS_VERSION_HEADER] == str(version), answer.headers
        loader.close()
        client.close()
    finally:
        stop_server(proc)
    return runs, start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=8, help="pushes of each form after its warm-up")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--weight-loads", default="layerwise,in-place",
                        help="the server's GRPO_SERVER_WEIGHT_LOADS values, one server each (comma-separated)")
    parser.add_argument("--forms", default="packed,separate", help="snapshot forms (comma-separated)")
    parser.add_argument("--cpu", action="store_true", help="transformers engine over gloo, float32 (a smoke)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    forms = [form for form in args.forms.split(",") if form]
    if not forms or set(forms) - set(FORMS):
        parser.error(f"--forms: some of {', '.join(FORMS)}")
    dtype = "float32" if args.cpu else "bfloat16"
    result: dict[str, Any] = {"machine": machine(), "model": str(args.model), "backend": "gloo" if args.cpu else "ipc",
                              "server_start_s": {}, "pushes": {}, "median": {}}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype))
    if not args.cpu:
        model = model.cuda()
    result["tensors"] = len(list(model.parameters()))
    result["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    for loads in [value for value in args.weight_loads.split(",") if value]:
        runs, start_s = pushes_on({"GRPO_SERVER_WEIGHT_LOADS": loads}, args, model, dtype, forms)
        result["server_start_s"][loads] = start_s
        for form, pushes in runs.items():
            result["pushes"][f"{loads}/{form}"] = pushes
            result["median"][f"{loads}/{form}"] = medians(pushes[1:])
    first = next(iter(result["median"]))
    result["total_over_first"] = {key: median["total"] / result["median"][first]["total"]
                                  for key, median in result["median"].items()}
    args.out.write_text(json.dumps(result, indent=1))
    for key, median in result["median"].items():
        print(key, "median", json.dumps({k: round(v, 4) for k, v in median.items()}))
    print(f"total (median) over {first}:", json.dumps({k: round(v, 2) for k, v in result["total_over_first"].items()}))


if __name__ == "__main__":
    main()
