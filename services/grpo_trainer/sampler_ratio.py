"""The importance-sampling correction's ratio between the training policy and the sampler, as TRL computes it.

TRL 1.16 (GRPOTrainer._generate_and_score_completions) scores every generated batch with a no-grad forward of the
policy, `old_per_token_logps`, whose only use when each batch is trained once in one optimizer step is this ratio
against the sampler's (vLLM's) logprobs: the loss itself then takes `per_token_logps.detach()` for the old policy
anyway. In that case the logprobs of that extra forward are the training forward's own, so the trainer forms the
ratio there instead and saves one forward pass of the policy per step (trl_overrides.ServerGRPOTrainer, decided
by `old_logps_from_training_forward`). This module is the ratio and its step metrics, line for line TRL's, so
that both places give the same numbers (tests/trainer/test_old_logps_from_the_training_forward.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: GRPOConfig.vllm_importance_sampling_mode values: <token|sequence>_<truncate|mask>.
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

def old_logps_from_training_forward(
    *, correction: bool, num_iterations: int, gradient_accumulation_steps: int, steps_per_generation: int,
    stale_batches_judged: bool, wanted: bool,
) -> bool:
    """Whether the correction's old-policy logprobs can be the training forward's, detached.

    They can when the policy that scores a batch is the one that trains on it: each batch trained once
    (`num_iterations` 1) within one optimizer step (generation aligned with gradient accumulation, TRL's own test
    for skipping them without vLLM). Not when the drift guard must judge a stale batch before it is trained on
    (`stale_batches_judged`): it reads them at scoring time. Not unless `wanted` (config.Savings)."""
    aligned = gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0
    return wanted and correction and num_iterations == 1 and aligned and not stale_batches_judged


def sampler_ratio(
    policy_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, *,
    mode: str, clip_min: float | None, clip_max: float | None,
) -> torch.Tensor:
    """exp(policy - sampler) per token ((B, T), token modes) or per sequence ((B, 1)), truncated to the clip
    range or set to 0 outside it; tokens the sampler could not score (NaN) count as a ratio of 1."""
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {', '.join(MODES)}")
    log_ratio = torch.nan_to_num((policy_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


@dataclass(frozen=True)
class RatioFigures:
    """One process's share of the step metrics TRL logs for the correction (0-d tensors, gathered by the caller)."""

    logp_difference_mean: torch.Tensor
    logp_difference_max: torch.Tensor
    ratio_min: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor


def ratio_figures(
    policy_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, *, mode: str,
) -> RatioFigures:
    """|policy - sampler| over the scored tokens (NaN left out) and the ratio's min, mean and max, as TRL's
    sampling/sampling_logp_difference/* and sampling/importance_sampling_ratio/* (0 when nothing is counted)."""
    counted = mask.bool()
    delta = torch.abs(policy_logps - sampling_logps)
    delta = delta[counted & ~torch.isnan(delta)]
    flat = ratio.flatten() if mode.startswith("sequence_") else ratio[counted]
    zero = torch.tensor(0.0, device=policy_logps.device)

    def reduce(values: torch.Tensor, how: str) -> torch.Tensor:
        if values.numel() == 0:
            return zero
        reduced: torch.Tensor = getattr(torch, how)(values)
        return reduced

    return RatioFigures(reduce(delta, "mean"), reduce(delta, "max"),
                        reduce(flat, "min"), reduce(flat, "mean"), reduce(flat, "max"))
