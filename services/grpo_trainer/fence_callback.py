"""The attempt's claim on the volume, checked at the end of every optimizer step.

The Trainer writes a checkpoint right after the step's callbacks have run, so a trainer process whose attempt
has ended (a later attempt claimed the checkpoint folder: `checkpoints.AttemptFence`) stops here, before it
writes one, and before it trains another step. Every rank checks: each writes its part of a checkpoint.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from grpo_trainer.checkpoints import AttemptFence


class FenceCallback(TrainerCallback):
    """Raises AttemptSuperseded at a step's end once the attempt's folders belong to a later attempt."""

    def __init__(self, fence: AttemptFence) -> None:
        self.fence = fence

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        self.fence.check(f"write checkpoint-{step}" if control.should_save else f"train on after step {step}")
