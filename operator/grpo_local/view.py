"""What a person sees of a local run: a live progress view, then a summary table and a reward curve."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from grpo_api.models import Phase
from grpo_local.runner import LocalRun, RunEvent, phase_label


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


class LiveView:
    """A progress bar with step/maxSteps, reward, sync latency and server state (rich)."""

    def __init__(self, console: Console, run: LocalRun) -> None:
        self.console = console
        self.run = run
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task(run.run.metadata.name, total=run.run.spec.trainer.max_steps)

    def renderable(self) -> Group:
        run = self.run
        status = run.status
        latest = run.samples[-1] if run.samples else None
        step = latest.step if latest else status.progress.step
        self.progress.update(self.task, completed=step)
        server = status.server
        sync_ms = latest.sync_seconds * 1000 if latest and latest.sync_seconds is not None else None
        adapter = f"v{latest.adapter_version}" if latest and latest.adapter_version else "–"
        if run.run.spec.mode == "colocate":
            server_state = "–"
        elif run.finished:
            server_state = "ready" if server.ready else "stopped"
        else:
            server_state = "ready" if server.ready else "not ready"
        line = Text.assemble(
            ("phase ", "dim"), (phase_label(status), "bold cyan"),
            ("  attempt ", "dim"), (str(status.attempt), "bold"),
            ("  server ", "dim"), (server_state, "green" if server.ready else "yellow"),
            ("  reward ", "dim"), (_fmt(latest.reward_mean if latest else None), "bold magenta"),
            ("  sync ", "dim"), (f"{_fmt(sync_ms, '.0f')} ms", ""),
            ("  adapter ", "dim"), (adapter, ""),
        )
        return Group(self.progress.get_renderable(), line)

    def event(self, event: RunEvent) -> None:
        style = "yellow" if event.type == "Warning" else "dim"
        self.console.print(f"[{style}]{event.reason}[/]: {event.message}")


def summarize(run: LocalRun, elapsed: float) -> dict[str, Any]:
    history = run.history()
    # The final progress file, not the last history line: that line is written when the last step is
    # logged, while the step's adapter may still be syncing in the background.
    final = run.read_progress()
    rewards = [h.reward_mean for h in history if h.reward_mean is not None]
    syncs = [h.sync_seconds for h in history if h.sync_seconds is not None]
    head, tail = rewards[:5], rewards[-5:]
    adapters = Path(run.config.paths.adapter_root)
    return {
        "run": run.run.metadata.name,
        "phase": str(run.status.phase),
        "reason": run.status.reason,
        "message": run.status.message,
        "attempts": run.status.attempt,
        "steps": history[-1].step if history else run.status.progress.step,
        "maxSteps": run.run.spec.trainer.max_steps,
        "rewardFirst5": sum(head) / len(head) if head else None,
        "rewardLast5": sum(tail) / len(tail) if tail else None,
        "syncMsMean": 1000 * sum(syncs) / len(syncs) if syncs else None,
        "adapterVersion": final.adapter_version if final else (history[-1].adapter_version if history else None),
        "adaptersOnDisk": sorted(p.name for p in adapters.iterdir()) if adapters.is_dir() else [],
        # spec.output: where the export step put the result (status.output), once it did.
        "output": run.status.output.model_dump(by_alias=True, exclude_none=True, mode="json")
        if run.status.output is not None else None,
        "elapsedSeconds": round(elapsed, 1),
        "runDir": str(run.run_dir),
    }


def summary_table(summary: dict[str, Any]) -> Table:
    ok = summary["phase"] == Phase.SUCCEEDED
    table = Table(
        title=f"GRPORun {summary['run']}: {summary['phase']}", title_style="bold green" if ok else "bold red"
    )
    table.add_column("", style="dim")
    table.add_column("")
    rows = [
        ("phase / reason", f"{summary['phase']} / {summary['reason']}"),
        ("attempts", str(summary["attempts"])),
        ("steps", f"{summary['steps']} / {summary['maxSteps']}"),
        ("reward, first 5 steps", _fmt(summary["rewardFirst5"])),
        ("reward, last 5 steps", _fmt(summary["rewardLast5"])),
        ("adapter sync, mean", f"{_fmt(summary['syncMsMean'], '.0f')} ms"),
        ("final adapter", f"v{summary['adapterVersion']}" if summary["adapterVersion"] else "–"),
        *([("exported to", summary["output"]["uri"])] if summary.get("output") else []),
        ("elapsed", f"{summary['elapsedSeconds']} s"),
        ("run directory", summary["runDir"]),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def reward_plot(run: LocalRun, out: Path) -> Path | None:
    """Reward mean (± std) per step, as a PNG."""
    history = [h for h in run.history() if h.reward_mean is not None]
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in history]
    mean = [h.reward_mean or 0.0 for h in history]
    std = [h.reward_std or 0.0 for h in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, mean, marker="o", markersize=3, label="reward mean")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2, label="± std")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(f"GRPORun {run.run.metadata.name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def write_summary(run: LocalRun, console: Console, started: float) -> dict[str, Any]:
    summary = summarize(run, time.monotonic() - started)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    png = reward_plot(run, run.run_dir / "reward.png")
    console.print(summary_table(summary))
    if png is not None:
        console.print(f"reward curve: {png}")
    return summary
