"""Errors that end a training run with a reason a person can act on, and the exit code each one means."""

from __future__ import annotations

from grpo_api.exit_codes import EXIT_FAILED, EXIT_INVALID_SPEC
from grpo_api.runconfig import RunConfigError


class TrainingFailed(RuntimeError):
    """The run cannot continue; the message says why and names the file, field or function at fault."""


class InvalidSpec(TrainingFailed):
    """A configuration problem no retry fixes (the dataset, a reward, a setting): the run fails as
    InvalidSpec instead of starting another attempt with a fresh server."""


class ServerUnavailable(TrainingFailed):
    """The generation server could not be reached within the configured timeout."""


class ServerMismatch(TrainingFailed):
    """The server serves a different base model, or is not in the state this attempt expects."""


class AdapterSyncFailed(TrainingFailed):
    """An adapter version could not be made active on the server, even after retries."""


class AttemptSuperseded(TrainingFailed):
    """A later attempt of the run has claimed the volume: this process's attempt is over, and it may write
    nothing more there (checkpoints.AttemptFence)."""


class RewardFunctionFailed(TrainingFailed):
    """A reward function raised or returned the wrong number of rewards."""


class UnsupportedSetting(InvalidSpec):
    """A spec setting this trainer does not implement (full fine-tuning, QLoRA without a GPU, ...)."""


def exit_code(exc: BaseException) -> int:
    """The trainer's exit code for the error that ended it (grpo_api.exit_codes): EXIT_INVALID_SPEC when no
    retry can help, EXIT_FAILED otherwise (the next attempt, with a fresh server, may succeed)."""
    return EXIT_INVALID_SPEC if isinstance(exc, InvalidSpec | RunConfigError) else EXIT_FAILED


def causes(exc: BaseException) -> list[BaseException]:
    """exc and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
