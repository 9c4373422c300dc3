"""A trainer's side of the ipc weight transfer, as a process: `python -m tests.server.weight_ipc_sender`.

It puts the named checkpoint tensors on the GPU the server uses (cuda:0, shared), as the model's own
weights (`original`) or with the last decoder layer's MLP times -3 and the final norm times 3
(`scaled`), packed into one buffer per dtype as the trainer's snapshot packs them (`packed_copies`;
with `--separate`, each in its own allocation), writes the JSON `update_info` of `/update_weights`
(`grpo_trainer.transport.weight_ipc`) to `--out`, prints `ready`, and keeps the tensors alive until its
stdin closes (the server reads them through their IPC handles until `/finish_weight_update` answers), then
frees them and prints `done allocated=N`, the bytes torch still holds on the GPU (0 when every reference
count the server took came back).
`--bad-uuid` offers the last tensor from a GPU that does not exist: vLLM's worker refuses the
`/update_weights` call that carries it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def perturbed(name: str, last_layer: int) -> float | None:
    if f"layers.{last_layer}.mlp" in name:
        return -3.0
    return 3.0 if name == "model.norm.weight" else None


def gpu_tensors(model: Path, names: list[str], kind: str, separate: bool) -> dict[str, Any]:
    """The named checkpoint tensors on cuda:0 (`scaled`: perturbed), packed unless `separate`; nothing else
    of them stays referenced once this returns."""
    import torch
    from safetensors import safe_open

    from grpo_trainer.transport.weight_sync import packed_copies

    last = json.loads((model / "config.json").read_text())["num_hidden_layers"] - 1
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cuda:0") as weights:
            present = set(weights.keys())
            for name in names:
                if name in present:
                    tensors[name] = weights.get_tensor(name)
    with torch.no_grad():
        for name, tensor in tensors.items():
            factor = perturbed(name, last) if kind == "scaled" else None
            if factor is not None:
                tensors[name] = tensor * factor
        if separate:
            return tensors
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in tensors.items():
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        packed: dict[str, torch.Tensor] = {}
        for dtype, group in by_dtype.items():
            views = packed_copies(group, dtype)
            for name, tensor in group:
                views[name].copy_(tensor)
            packed.update(views)
        return packed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--kind", choices=["original", "scaled"], required=True)
    parser.add_argument("--names", required=True, help="JSON list of checkpoint tensor names")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bad-uuid", action="store_true")
    parser.add_argument("--separate", action="store_true", help="each tensor in its own allocation")
    args = parser.parse_args()

    import torch

    from grpo_trainer.transport.weight_ipc import ipc_update_info

    names = json.loads(args.names)
    tensors = gpu_tensors(args.model, names, args.kind, args.separate)
    torch.cuda.synchronize()
    info = ipc_update_info([(name, tensors[name]) for name in names])
    if args.bad_uuid:
        offers = info["ipc_handles"][-1]
        info["ipc_handles"][-1] = {"GPU-00000000-0000-0000-0000-000000000000": next(iter(offers.values()))}
    args.out.write_text(json.dumps(info))
    print("ready", flush=True)
    sys.stdin.read()  # the tensors stay alive until the test closes our stdin
    del tensors
    torch.cuda.ipc_collect()
    # 0 once the server let go of every buffer: torch's IPC reference counts came back to zero
    print(f"done allocated={torch.cuda.memory_allocated()}", flush=True)


if __name__ == "__main__":
    main()
