"""Let vLLM's IPC weight-transfer module import on a server without ray.

vLLM 0.26's `vllm/distributed/weight_transfer/ipc_engine.py` imports `ray` at its top, for its
Ray send mode (a trainer's side), which a server never uses; vLLM does not depend on ray and our
server image does not install it. Without ray the engine core fails at start with the ipc backend
(found on the H200: `ModuleNotFoundError: No module named 'ray'` in EngineCore). When ray is missing,
this puts an empty stand-in package first on the path of this process and of the engine's processes
(spawned: they inherit PYTHONPATH). A real ray, when installed, is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

STAND_IN = '"""Empty stand-in for ray (grpo_server.engines.ray_stand_in): vLLM\'s IPC module imports it unused."""\n'


def provide_ray_stand_in(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """The stand-in's directory, put first on `environ`'s PYTHONPATH and this process's sys.path; None
    when ray is importable."""
    if importlib.util.find_spec("ray") is not None:
        return None
    root = Path(tempfile.mkdtemp(prefix="grpo-ray-stand-in-"))
    (root / "ray").mkdir()
    (root / "ray" / "__init__.py").write_text(STAND_IN)
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), environ.get("PYTHONPATH", "")) if p)
    sys.path.insert(0, str(root))
    return root
