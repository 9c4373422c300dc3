"""Errors that end a training run with a reason a person can act on."""

from __future__ import annotations


class TrainingFailed(RuntimeError):
    """The run cannot continue; the message says why and names the file, field or function at fault."""


class ServerUnavailable(TrainingFailed):
    """The generation server could not be reached within the configured timeout."""


class ServerMismatch(TrainingFailed):
    """The server serves a different base model, or is not in the state this attempt expects."""


class AdapterSyncFailed(TrainingFailed):
    """An adapter version could not be made active on the server, even after retries."""


class RewardFunctionFailed(TrainingFailed):
    """A reward function raised or returned the wrong number of rewards."""


class UnsupportedSetting(TrainingFailed):
    """A spec setting this trainer does not implement (full fine-tuning, QLoRA without a GPU, ...)."""
