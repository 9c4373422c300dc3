"""What `grpo wait` decides from one GRPORun object: met, still waiting, or never (the run ended otherwise).
Pure: the watch in `commands` feeds it each version of the run."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from grpo_api.models import ConditionType, Phase

#: Exit codes of `grpo wait` (1 is any error, such as a run not found; 2 a usage error, as click uses it).
EXIT_MET = 0
EXIT_FAILED = 3
EXIT_TIMEOUT = 4
EXIT_ENDED = 5

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")


class Outcome(enum.Enum):
    WAITING = "waiting"
    #: The run is in the asked phase or has the asked condition.
    MET = "met"
    #: The run Failed (and Failed is not what was asked).
    FAILED = "failed"
    #: The run Succeeded without meeting what was asked (e.g. --for Suspended).
    ENDED = "ended"


EXIT_CODES = {Outcome.MET: EXIT_MET, Outcome.FAILED: EXIT_FAILED, Outcome.ENDED: EXIT_ENDED}


@dataclass(frozen=True)
class Target:
    """A phase (`Succeeded`), or a condition and its status (`condition=ServerReady`, `condition=Failed=False`)."""

    phase: str | None = None
    condition: str | None = None
    condition_status: str = "True"

    def __str__(self) -> str:
        if self.phase is not None:
            return f"phase {self.phase}"
        return f"condition {self.condition}={self.condition_status}"


def parse_target(text: str) -> Target:
    """--for: a phase name (any case), `phase=NAME`, or kubectl's `condition=TYPE[=True|False|Unknown]`."""
    key, sep, value = text.partition("=")
    if sep and key.lower() == "condition":
        name, _, state = value.partition("=")
        types = {t.value.lower(): t.value for t in ConditionType}
        if name.lower() not in types:
            raise ValueError(f"unknown condition {name!r}; one of {', '.join(types.values())}")
        states = {s.lower(): s for s in ("True", "False", "Unknown")}
        if state and state.lower() not in states:
            raise ValueError(f"condition status {state!r} is not True, False or Unknown")
        return Target(condition=types[name.lower()], condition_status=states[state.lower()] if state else "True")
    if sep and key.lower() != "phase":
        raise ValueError(f"{text!r}: give a phase (Succeeded), phase=NAME or condition=TYPE[=STATUS]")
    name = value if sep else text
    phases = {p.value.lower(): p.value for p in Phase}
    if name.lower() not in phases:
        raise ValueError(f"unknown phase {name!r}; one of {', '.join(phases.values())}")
    return Target(phase=phases[name.lower()])


def parse_duration(text: str) -> float:
    """kubectl's --timeout: `90`, `90s`, `30m`, `1h30m`; seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    if not text or _DURATION.sub("", text):
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m or 1h30m")
    scale = {"h": 3600, "m": 60, "s": 1}
    return sum(float(number) * scale[unit] for number, unit in _DURATION.findall(text))


def _condition_status(status: dict[str, Any], condition: str) -> str | None:
    for item in status.get("conditions") or []:
        if isinstance(item, dict) and item.get("type") == condition:
            return str(item.get("status"))
    return None


def decide(target: Target, run: dict[str, Any]) -> tuple[Outcome, str]:
    """The outcome for the run as it is now, and a line that says why (its phase, reason and message)."""
    status = run.get("status") or {}
    phase = status.get("phase") or Phase.PENDING.value
    said = phase + (f" ({status['reason']})" if status.get("reason") else "")
    if status.get("message"):
        said += f": {status['message']}"
    if target.phase is not None:
        met = phase == target.phase
    else:
        assert target.condition is not None
        met = _condition_status(status, target.condition) == target.condition_status
    if met:
        return Outcome.MET, said
    if phase == Phase.FAILED.value:
        return Outcome.FAILED, said
    if phase == Phase.SUCCEEDED.value:
        return Outcome.ENDED, said
    return Outcome.WAITING, said
