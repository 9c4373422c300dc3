"""The server's checksum of an adapter: sha256 (manifests before) against BLAKE3 (now), idle and beside a busy thread.

The server verifies every file of an adapter against its manifest before it serves it, on the sync's path, in a
worker thread beside the event loop. On the H100 (2026-12-06) the sha256 of the 74 MB r=32 adapter of the 1.5B shape
took 0.075 s of the server's 0.078 s load. This times `grpo_api.adapters.file_digest` (what `verify_files` runs) in
both notations on the same adapter as `adapter_finite_check.py`, each alone and beside a thread that keeps the GIL
busy as the event loop does.

    python bench/manifest_digest.py --out bench/results/<dir>/manifest_digest.json
"""

from __future__ import annotations

from adapter_finite_check import bench_main

from grpo_api.adapters import file_digest

SHA256_LIKE = "0" * 64  # a bare hex digest: file_digest hashes the file with sha256, as for an earlier manifest


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, __doc__, [("sha256", lambda path: file_digest(path, SHA256_LIKE)), ("blake3", file_digest)],
                      repeats=5)


if __name__ == "__main__":
    raise SystemExit(main())
