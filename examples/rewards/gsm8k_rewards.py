"""The correctness reward of examples/grpo-run.yaml (GSM8K), in TRL's reward contract.

GSM8K's `answer` column ends with `#### <number>`; a completion earns 1.0 when the last number it
writes equals that number, else 0.0. The dataset's other columns reach reward functions as keyword
arguments (TRL's contract), so `answer` arrives as a list beside the completions.

    grpo stage -n ml-team --configmap gsm8k-rewards examples/rewards/gsm8k_rewards.py
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _text(completion: Any) -> str:
    """A plain completion is a string; a conversational one a list of messages (the last is ours)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""


def last_number_matches_answer(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's last number equals the reference after `####`, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = _number(reference.rsplit("####", 1)[-1])
        got = _number(_text(completion))
        rewards.append(1.0 if expected is not None and got is not None and abs(got - expected) < 1e-6 else 0.0)
    return rewards
