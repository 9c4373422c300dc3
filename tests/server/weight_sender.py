"""A trainer's side of the weight transfer over gloo, as a process: `python -m tests.server.weight_sender`.

It hosts the rendezvous (rank 0, TCPStore master) on a port the kernel picks and prints `hosting PORT`
(a port chosen beforehand could be taken by another process's connection before the store binds it),
then for each update broadcasts the tensors the update names, in order. What it sends is the model's own
weights (`original`), or with every weight of the last decoder layer's MLP and the final norm tripled
(`scaled`); `die-after-one` sends one tensor of the update and exits, as a trainer that crashed mid-transfer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from grpo_server.engines.gloo_weights import STORE_PREFIX


def scaled(name: str, last_layer: int) -> bool:
    return f"layers.{last_layer}.mlp" in name or name == "model.norm.weight"


def weights(model_dir: Path, kind: str) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    last = model.config.num_hidden_layers - 1
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            out[name] = param.detach() * 3.0 if kind == "scaled" and scaled(name, last) else param.detach()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0, help="the store's port (0: one the kernel picks)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--kind", choices=["original", "scaled", "die-after-one"], required=True)
    parser.add_argument("--names", required=True, help="JSON list of the tensor names the update announces")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    limit = dt.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=True, timeout=limit, wait_for_workers=False)
    print(f"hosting {store.port}", flush=True)  # the test reads this line before it asks the server to join
    group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), 0, args.world, limit)
    print("joined", flush=True)
    tensors = weights(args.model, "original" if args.kind == "die-after-one" else args.kind)
    names = json.loads(args.names)
    for name in names:
        group.broadcast(tensors[name].to(getattr(torch, args.dtype)).contiguous(), 0, limit).wait()
        if args.kind == "die-after-one":
            print("dying", flush=True)
            sys.stdout.flush()
            os._exit(3)
    print(f"sent {len(names)}", flush=True)


if __name__ == "__main__":
    main()
