"""The GRPO-shaped generation workload shared by the GPU benchmarks.

64 prompts of 64–512 random token ids, each sampled n=8 times with its own
completion length of 64–1,024 tokens (ignore_eos, so every engine produces the
same number of tokens), temperature 1. Deterministic for a seed.
"""

from __future__ import annotations

import contextlib
import json
import platform
import random
import subprocess
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int

    @property
    def completion_tokens(self) -> int:
        return sum(self.max_tokens) * self.n

    def subset(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.max_tokens[:count], self.n)


def grpo_shaped(
    vocab_size: int,
    *,
    prompts: int = 64,
    n: int = 8,
    prompt_len: tuple[int, int] = (64, 512),
    completion_len: tuple[int, int] = (64, 1024),
    first_id: int = 3,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    token_prompts = [
        [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(*prompt_len))] for _ in range(prompts)
    ]
    lengths = [rng.randint(*completion_len) for _ in range(prompts)]
    return Workload(token_prompts, lengths, n)


def machine() -> str:
    """One line describing the machine (GPU name when nvidia-smi answers)."""
    gpu = ""
    with contextlib.suppress(OSError):
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()
    return f"{gpu or 'no GPU'}; {platform.processor() or platform.machine()}; Python {platform.python_version()}"


def figure(
    name: str, value: float, unit: str, *, baseline: str | None = None, baseline_value: float | None = None,
    target: str | None = None, higher_is_better: bool = True,
) -> dict[str, Any]:
    ratio = None
    if baseline_value:
        ratio = value / baseline_value if higher_is_better else baseline_value / value
    return {"name": name, "value": value, "unit": unit, "baseline": baseline, "baseline_value": baseline_value,
            "ratio": ratio, "target": target}


def dump(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
