"""What the trainer (`grpo train`) tells the executors with its exit code and its last words.

    0  EXIT_SUCCEEDED     the attempt trained to its last step
    1  EXIT_FAILED        the attempt failed, perhaps transiently (the server, the network, a crash; an
                          unforeseen exception's traceback exits 1 too): the next attempt, with a fresh
                          server, may succeed, up to `runPolicy.backoffLimit`
    2  EXIT_INVALID_SPEC  a configuration problem no retry fixes (an unreadable or empty dataset, a reward
                          module that does not import, a setting the trainer does not implement): the run
                          fails at once as `InvalidSpec`, without another attempt or another server

The numbers are the initializer's too (`grpo_api.prepare_protocol`: 0 ready, 1 transient, 2 permanent), and
`grpo serve` exits with 2 when its engine cannot run where it is (no vLLM in the image, no GPU): the executors
fail the run as InvalidSpec in its words instead of waiting for serverReadyTimeoutSeconds and retrying.
The operator's trainer Job fails at once on EXIT_INVALID_SPEC (its podFailurePolicy; the Job's Failed
condition then has reason `PodFailurePolicy`) and it reads the code from the pod's status; `grpo run`
reads it from the process. The last words (the error, naming the field, file and function) go to the
termination log, where the kubelet picks them up as the container's termination message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from grpo_api.prepare_protocol import (
    DEFAULT_TERMINATION_LOG,
    ENV_TERMINATION_LOG,
    EXIT_PERMANENT,
    EXIT_READY,
    EXIT_TRANSIENT,
    MAX_FINAL_CHARS,
)

EXIT_SUCCEEDED: Final = EXIT_READY
EXIT_FAILED: Final = EXIT_TRANSIENT
EXIT_INVALID_SPEC: Final = EXIT_PERMANENT


def termination_log_path() -> Path | None:
    """$GRPO_TERMINATION_LOG, else /dev/termination-log when it exists and is writable (Kubernetes); None
    elsewhere (a plain process has nowhere to leave its last words but its log)."""
    override = os.environ.get(ENV_TERMINATION_LOG)
    if override:
        return Path(override)
    path = Path(DEFAULT_TERMINATION_LOG)
    return path if path.exists() and os.access(path, os.W_OK) else None


def clip_final_message(message: str) -> str:
    """A final message kept well under the kubelet's 4096-byte termination-message limit."""
    return message if len(message) <= MAX_FINAL_CHARS else message[: MAX_FINAL_CHARS - 1] + "…"


def write_termination_message(text: str) -> None:
    """The text (one line, or a few) into the termination log, if there is one; raises OSError when it
    cannot be written."""
    path = termination_log_path()
    if path is not None:
        path.write_text(text + "\n", encoding="utf-8")
