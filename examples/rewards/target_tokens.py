"""A user reward function for examples/cpu-run.yaml, in TRL's reward contract.

`grpo stage --configmap tiny-rewards` puts this file into a ConfigMap that the run names as its
`rewardCode` source; the trainer imports its modules from that read-only mount, so the spec names it
`target_tokens:share`.
It rewards the share of completion tokens whose id falls in [low, high), a set of 1/8 of the tiny
test model's vocabulary (what `grpo make-model --preset tiny` makes): about 0.125 at the start of a run,
and it rises as the policy learns.
"""

from __future__ import annotations

from typing import Any


def share(completion_ids: list[list[int]], *, low: int, high: int, max_length: int, **_: Any) -> list[float]:
    """Target tokens per completion, divided by the maximum length (a short completion gains nothing)."""
    return [sum(1 for token in ids if low <= token < high) / max_length for ids in completion_ids]
