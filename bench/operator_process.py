"""The operator of a checkout as a subprocess, for the operator benchmarks."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fixtures.server import free_port


def start_operator(
    kubeconfig: Path, namespace: str, log: Path, *, pythonpath: str | None = None,
    extra_args: tuple[str, ...] = (), settle_seconds: float = 3.0,
) -> tuple[subprocess.Popen[bytes], int]:
    """`grpo operator` on one namespace and its metrics port, once the metrics answer and kopf has listed
    what is there.

    pythonpath: where `grpo_cli` is imported from (another checkout's sources); the installed one if None.
    """
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli.main", "operator", "--namespace", namespace,
             "--metrics-port", str(port), "--liveness-port", "0", *extra_args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"operator did not start; see {log}")
        time.sleep(0.2)
    time.sleep(settle_seconds)  # kopf's initial listing
    return proc, port


def machine_info() -> dict[str, Any]:
    """The machine a figure was measured on, and how busy it was."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_1m": round(os.getloadavg()[0], 2)}
