"""What `grpo get` and `grpo status` print: a GRPORun object (and its Events) in, text out. Pure: the
clock is an argument."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from grpo_api.models import GRPORunStatus, Phase

#: Events `grpo status` shows (the newest).
EVENTS_SHOWN = 10
#: Width of the `Key:` column of `grpo status` (the longest key, Staleness or Completed, and a space).
KEY_WIDTH = 12
#: Width a message may take in the conditions and events tables.
MESSAGE_WIDTH = 100


class StatusUnreadable(ValueError):
    """The run's status does not parse (written by something other than the operator)."""


def parse_status(run: dict[str, Any]) -> GRPORunStatus:
    """The run's status as the model reads it; an empty one for a run the operator has not seen yet."""
    try:
        return GRPORunStatus.model_validate(run.get("status") or {})
    except ValidationError as exc:
        name = (run.get("metadata") or {}).get("name", "?")
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise StatusUnreadable(f"GRPORun {name}: status.{field} cannot be read: {first['msg']}") from exc


def parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def age(since: dt.datetime | None, now: dt.datetime) -> str:
    """Short ages, rounded as kubectl's (seconds below 2 min, minutes below 2 h, ...): 42s, 7m, 3h, 5d."""
    if since is None:
        return "<unknown>"
    seconds = max(0, int((now - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def reward_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded as kubectl pads them (three spaces between)."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _short(text: str | None, width: int = MESSAGE_WIDTH) -> str:
    one_line = " ".join((text or "").split())
    return one_line if len(one_line) <= width else one_line[: width - 1] + "…"


# ------------------------------------------------------------------------------------------- get


GET_HEADER = ("NAME", "PHASE", "STEP", "REWARD", "ADAPTER", "ATTEMPT", "AGE")


def run_row(run: dict[str, Any], now: dt.datetime) -> list[str]:
    meta = run.get("metadata") or {}
    try:
        status = parse_status(run)
    except StatusUnreadable:
        return [meta.get("name", "?"), "<unreadable>", "-", "-", "-", "-",
                age(parse_time(meta.get("creationTimestamp")), now)]
    progress = status.progress
    step = f"{progress.step}/{progress.max_steps}" if progress.max_steps else str(progress.step)
    adapter = f"v{status.adapter.version}" if status.adapter.version is not None else "-"
    return [
        meta.get("name", "?"),
        str(status.phase),
        step,
        reward_text(progress.reward_mean),
        adapter,
        str(status.attempt),
        age(parse_time(meta.get("creationTimestamp")), now),
    ]


def runs_table(runs: list[dict[str, Any]], now: dt.datetime, all_namespaces: bool = False) -> str:
    """`grpo get`: one row per run, sorted by namespace and name."""
    ordered = sorted(runs, key=lambda r: ((r.get("metadata") or {}).get("namespace", ""),
                                         (r.get("metadata") or {}).get("name", "")))
    rows: list[list[str]] = [list(GET_HEADER)]
    for run in ordered:
        row = run_row(run, now)
        rows.append([(run.get("metadata") or {}).get("namespace", ""), *row] if all_namespaces else row)
    if all_namespaces:
        rows[0] = ["NAMESPACE", *rows[0]]
    return table(rows)


# ---------------------------------------------------------------------------------------- status


def _event_time(event: dict[str, Any]) -> dt.datetime | None:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        when = parse_time(event.get(key))
        if when is not None:
            return when
    return parse_time((event.get("metadata") or {}).get("creationTimestamp"))


def latest_events(events: list[dict[str, Any]], count: int = EVENTS_SHOWN) -> list[dict[str, Any]]:
    """The newest `count` events, oldest first (as kubectl describe lists them)."""
    floor = dt.datetime.min.replace(tzinfo=dt.UTC)
    ordered = sorted(events, key=lambda e: _event_time(e) or floor)
    return ordered[-count:] if count > 0 else []


def _staleness(status: GRPORunStatus, now: dt.datetime) -> str:
    """Whether every server replica serves the trainer's current policy version, and since when not."""
    lagging = status.progress.lagging_replicas
    if not lagging:
        return "none: every server replica serves the current policy version" if status.adapter.version else "-"
    parts = [f"{r.url} lags since {age(r.since, now)}" + (f" ({_short(r.reason, 60)})" if r.reason else "")
             for r in lagging]
    return f"{len(lagging)} replica{'s' if len(lagging) != 1 else ''} behind: " + "; ".join(parts)


def status_text(run: dict[str, Any], events: list[dict[str, Any]], now: dt.datetime,
                events_shown: int = EVENTS_SHOWN) -> str:
    """`grpo status RUN`: phase, step, reward, adapter version, staleness, conditions, the last events."""
    meta, spec = run.get("metadata") or {}, run.get("spec") or {}
    status = parse_status(run)
    progress, adapter, server = status.progress, status.adapter, status.server
    policy = spec.get("runPolicy") or {}
    trainer = spec.get("trainer") or {}

    phase = str(status.phase)
    if status.reason:
        phase += f" ({status.reason})"
    lines = [("Run", f"{meta.get('name', '?')} in namespace {meta.get('namespace', '?')}"), ("Phase", phase)]
    if status.message:
        lines.append(("Message", _short(status.message, 200)))
    if policy.get("suspend") and status.phase not in (Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED):
        lines.append(("Suspend", "asked (spec.runPolicy.suspend); the operator has not suspended it yet"))
    backoff = policy.get("backoffLimit", 2)
    lines.append(("Attempt", f"{status.attempt} ({status.failed_attempts} failed, backoffLimit {backoff})"))
    step = f"{progress.step}/{progress.max_steps}" if progress.max_steps else str(progress.step)
    lines.append(("Step", step))
    lines.append(("Reward", reward_text(progress.reward_mean)))
    if adapter.version is not None:
        loaded = f", loaded {age(adapter.loaded_at, now)} ago" if adapter.loaded_at else ""
        lines.append(("Adapter", f"v{adapter.version}{loaded}" + (f" ({adapter.path})" if adapter.path else "")))
    elif trainer.get("tuning") == "full":
        lines.append(("Adapter", "none: tuning full pushes whole weights to the server"))
    else:
        lines.append(("Adapter", "none published yet"))
    lines.append(("Staleness", _staleness(status, now)))
    replicas = (spec.get("server") or {}).get("replicas", 1)
    if spec.get("mode") != "colocate":
        ready = f"ready, {server.ready_replicas}/{replicas} replicas" if server.ready else "not ready"
        lines.append(("Server", ready + (f"; {_short(server.message, 120)}" if server.message else "")))
    lines.append(("Sources", "ready" if status.sources.ready else _short(status.sources.progress) or "not ready yet"))
    created = parse_time(meta.get("creationTimestamp"))
    lines.append(("Age", age(created, now)))
    if status.start_time:
        lines.append(("Started", f"{age(status.start_time, now)} ago"))
    if status.completion_time:
        took = ""
        if status.start_time:
            took = f", after {age(status.start_time, status.completion_time)}"
        lines.append(("Completed", f"{age(status.completion_time, now)} ago{took}"))

    out = [f"{key + ':':<{KEY_WIDTH}}{value}" for key, value in lines]

    if status.conditions:
        out += ["", "Conditions:"]
        rows = [["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]]
        rows += [[c.type, c.status, c.reason, age(c.last_transition_time, now), _short(c.message)]
                 for c in status.conditions]
        out += ["  " + line for line in table(rows).splitlines()]

    shown = latest_events(events, events_shown)
    out += ["", f"Events (the last {len(shown)} of {len(events)}):" if shown else "Events: none"]
    if shown:
        rows = [["AGE", "TYPE", "REASON", "MESSAGE"]]
        for event in shown:
            count = event.get("count") or 1
            when = age(_event_time(event), now) + (f" (x{count})" if count > 1 else "")
            rows.append([when, str(event.get("type", "")), str(event.get("reason", "")),
                         _short(event.get("message"))])
        out += ["  " + line for line in table(rows).splitlines()]
    return "\n".join(out)
