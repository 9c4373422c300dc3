"""What `grpo prepare` (the run's initializer) tells the operator, and how the operator reads it.

`grpo prepare` writes one JSON object per line on stdout:

    {"grpoPrepare": "progress", "message": "spec.model.source hf://org/m@main: 3/9 files, 1.2 GiB / 4.0 GiB"}
    {"grpoPrepare": "done", "message": "sources ready: model /m, dataset /d.jsonl (64 prompts), 2 reward functions"}
    {"grpoPrepare": "failed", "message": "spec.dataset: ... has no rows", "permanent": true}

Other lines (plain text, library warnings) may appear on stdout or stderr and are ignored. The last
line (done or failed) is also the container's termination message (`/dev/termination-log`, or
`$GRPO_TERMINATION_LOG`), so the operator can read it from the pod status with the same parser.

Exit codes: 0 ready, 1 transient (the Job retries; downloads resume), 2 permanent (a configuration
problem that no retry fixes; the Job's podFailurePolicy fails it at once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final, Literal

#: The key that marks a protocol line; its value is the event kind.
PREPARE_KEY: Final = "grpoPrepare"
PROGRESS: Final = "progress"
DONE: Final = "done"
FAILED: Final = "failed"
EventKind = Literal["progress", "done", "failed"]

EXIT_READY: Final = 0
EXIT_TRANSIENT: Final = 1
EXIT_PERMANENT: Final = 2

#: Kubernetes' default terminationMessagePath; the env variable overrides it (tests, other runtimes).
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
ENV_TERMINATION_LOG = "GRPO_TERMINATION_LOG"

#: Progress messages are short (they go into the run's status); final messages may say more but stay
#: well under the kubelet's 4096-byte termination-message limit.
MAX_PROGRESS_CHARS = 200
MAX_FINAL_CHARS = 2000


@dataclass(frozen=True)
class PrepareEvent:
    kind: EventKind
    message: str
    permanent: bool | None = None  # failed events only


def _clip(message: str, limit: int, *, one_line: bool) -> str:
    if one_line:
        message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 1] + "…"


def format_event(kind: EventKind, message: str, *, permanent: bool | None = None) -> str:
    """One protocol line (no trailing newline); the message is clipped to its kind's limit."""
    limit = MAX_PROGRESS_CHARS if kind == PROGRESS else MAX_FINAL_CHARS
    data: dict[str, object] = {PREPARE_KEY: kind, "message": _clip(message, limit, one_line=kind == PROGRESS)}
    if kind == FAILED:
        data["permanent"] = bool(permanent)
    return json.dumps(data, ensure_ascii=False)


def parse_event(line: str) -> PrepareEvent | None:
    """The event of one line, or None for any other line (plain text, other JSON)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    kind = data.get(PREPARE_KEY)
    message = data.get("message")
    if kind not in (PROGRESS, DONE, FAILED) or not isinstance(message, str):
        return None
    permanent = data.get("permanent")
    return PrepareEvent(kind, message, bool(permanent) if kind == FAILED else None)


def latest_event(log_text: str) -> PrepareEvent | None:
    """The last protocol event in a log (or a termination message), None when there is none."""
    for line in reversed(log_text.splitlines()):
        event = parse_event(line)
        if event is not None:
            return event
    return None


def latest_progress(log_text: str) -> str | None:
    """The message of the last progress, done or failed line; non-protocol lines are ignored."""
    event = latest_event(log_text)
    return event.message if event is not None else None
