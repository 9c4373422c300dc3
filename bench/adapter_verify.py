"""The server's whole check of an adapter's files, as before and as now (issue 28: the sync's load phase).

`verify_adapter_files` hashes every file against the manifest (BLAKE3) and tests every weight for NaN and Inf.
It used to do them one after the other, the finite test's chunks in series; it now runs the finite test beside
the hash, its chunks spread over threads (both release the GIL). This times both on an adapter of
Qwen2.5-1.5B's shape (LoRA r32 on every linear layer: 392 tensors, ~74 MB bf16; `adapter_finite_check.py`'s),
each alone and beside a thread that keeps the GIL busy as the server's event loop does while it serves
generations.

    python bench/adapter_verify.py --out bench/results/<dir>/adapter_verify.json
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from adapter_finite_check import bench_main

import grpo_server.adapter_checks as checks
from grpo_api.adapters import build_manifest
from grpo_server.adapter_checks import CheckedAdapter, verify_adapter_files


@cache
def checked(weights: Path) -> CheckedAdapter:
    manifest = build_manifest(weights.parent, version=1, step=1, base_model_fingerprint="f" * 64)
    return CheckedAdapter(path=weights.parent, digest=manifest.digest(), manifest_version=1, rank=32,
                          weights=weights, manifest=manifest)


def in_series(weights: Path) -> None:
    """The check as it was: the checksums, then the finite test with its chunks one after another."""
    adapter = checked(weights)
    assert adapter.manifest is not None
    threads = checks._FINITE_THREADS
    checks._FINITE_THREADS = 1
    try:
        checks._verify(adapter.path, adapter.manifest)
        checks._check_finite(weights)
    finally:
        checks._FINITE_THREADS = threads


def side_by_side(weights: Path) -> None:
    verify_adapter_files(checked(weights))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, [("in_series", in_series), ("side_by_side", side_by_side)], repeats=5)


if __name__ == "__main__":
    raise SystemExit(main())
