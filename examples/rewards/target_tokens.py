"""A user reward function for examples/cpu-run.yaml, in TRL's reward contract.

`grpo stage` copies this file onto the run's volume beside the dataset; the trainer imports user
modules from the dataset's directory and the volume root, so the spec names it `target_tokens:share`.
It rewards the share of completion tokens whose id falls in [low, high), a set of 1/8 of the tiny
test model's vocabulary (what `grpo make-model --preset tiny` makes): about 0.125 at the start of a run,
and it rises as the policy learns.
"""

from __future__ import annotations

from typing import Any


def share(completion_ids: list[list[int]], *, low: int, high: int, max_length: int, **_: Any) -> list[float]:
    """Target tokens per completion, divided by the maximum length (a short completion gains nothing)."""
    return [sum(1 for token in ids if low <= token < high) / max_length for ids in completion_ids]
