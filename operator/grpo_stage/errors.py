"""The one error type of grpo stage."""

from __future__ import annotations


class StageError(Exception):
    """A failure to report to the user, naming the file, claim or pod (the CLI makes it a click error)."""
