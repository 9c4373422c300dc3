"""The vllm engine's ray stand-in: vLLM's IPC module imports ray, which neither vLLM nor our image installs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest

from grpo_server.engines import ray_stand_in


def test_without_ray_a_spawned_process_imports_the_empty_stand_in(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "ray" else real(name, *args)

    monkeypatch.setattr(ray_stand_in.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(sys, "path", list(sys.path))
    environ = {"PYTHONPATH": "/somewhere"}
    root = ray_stand_in.provide_ray_stand_in(environ)
    assert root is not None and environ["PYTHONPATH"].split(":") == [str(root), "/somewhere"]
    assert sys.path[0] == str(root)
    shown = subprocess.run([sys.executable, "-c", "import ray; print(ray.__doc__)"], env=environ,
                           capture_output=True, text=True, check=True).stdout
    assert "stand-in for ray" in shown


def test_an_installed_ray_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ray_stand_in.importlib.util, "find_spec", lambda name, *a: object())
    environ: dict[str, str] = {}
    assert ray_stand_in.provide_ray_stand_in(environ) is None and environ == {}
