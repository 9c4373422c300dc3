"""The server's checksum of an adapter: sha256 (manifests before) against BLAKE3 (now), idle and beside a busy thread.

The server verifies every file of an adapter against its manifest before it serves it, on the sync's path, in a
worker thread beside the event loop. On the H100 (2026-12-06) the sha256 of the 74 MB r=32 adapter of the 1.5B shape
took 0.075 s of the server's 0.078 s load. This times `grpo_api.adapters.file_digest` (what `verify_files` runs) in
both notations on the same adapter as `adapter_finite_check.py`, each alone and beside a thread that keeps the GIL
busy as the event loop does.

    python bench/manifest_digest.py --out bench/results/<dir>/manifest_digest.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from adapter_finite_check import make_adapter, timed

from grpo_api.adapters import file_digest

SHA256_LIKE = "0" * 64  # a bare hex digest: file_digest hashes the file with sha256, as for an earlier manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, object] = {"machine": platform.platform(), "cpus": os.cpu_count(), "rank": args.rank,
                                  "repeats": args.repeats,
                                  "command": "python bench/manifest_digest.py --out OUT/manifest_digest.json"}
    with tempfile.TemporaryDirectory() as tmp:
        weights = make_adapter(Path(tmp), args.rank)
        results["adapter_mb"] = round(weights.stat().st_size / 1e6, 1)
        assert file_digest(weights).startswith("blake3:") and len(file_digest(weights, SHA256_LIKE)) == 64
        for label, like in (("sha256", SHA256_LIKE), ("blake3", None)):
            for beside_busy in (False, True):
                seconds = timed(lambda path, like=like: file_digest(path, like), weights, args.repeats, beside_busy)
                key = f"{label}_{'busy' if beside_busy else 'idle'}_s"
                results[key] = round(statistics.median(seconds), 4)
                print(f"{key:20s} median {statistics.median(seconds):7.4f} s  runs {[round(s, 4) for s in seconds]}",
                      flush=True)
    for where in ("idle", "busy"):
        old, new = results[f"sha256_{where}_s"], results[f"blake3_{where}_s"]
        assert isinstance(old, float) and isinstance(new, float)
        results[f"speedup_{where}"] = round(old / new, 1) if new else None
        print(f"speedup {where}: {results[f'speedup_{where}']}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
