"""The local executor of the run lifecycle: `grpo_api.lifecycle.decide` acted out with processes.

The decisions are the operator's (same function, same inputs); only the
effects differ: server processes stand for the server Deployment (one per
replica, each on its own port, listed to the trainer in the run-config), a
trainer process for the attempt's Job, and the run directory for the volume. A
server process that dies is not restarted in place (there is no kubelet): with
one replica its trainer fails, and the next attempt starts with a fresh server
and resumes from the last checkpoint; with several, the trainer carries on with
the others.

An attempt's trainer has ended only when every process of it has (the `grpo train`
launcher, torchrun and every rank, which torchrun starts in sessions of their own:
`processes.Child.alive`), and the next attempt's server starts only then: a rank
that outlived its launcher would otherwise train on against the new server (same
port) and into the same checkpoint folder.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import assert_never

from pydantic import ValidationError

from grpo_api.childenv import child_environment, tracker_environment
from grpo_api.exit_codes import EXIT_INVALID_SPEC
from grpo_api.export_protocol import ENV_EXPORT_CLAIM_ROOT, parse_result
from grpo_api.health import HealthClient
from grpo_api.lifecycle import (
    Action,
    CreateExporter,
    CreateInitializer,
    CreateTrainer,
    DeleteExporter,
    DeleteRun,
    DeleteServer,
    DeleteTrainer,
    Emit,
    EnsureServer,
    HealthCheck,
    Observation,
    Provision,
    RequeueAfter,
    StopServer,
    TrainerState,
    decide,
    wants_health,
)
from grpo_api.models import TERMINAL_PHASES, EnvVar, GRPORun, GRPORunStatus, Phase, WeightTransfer
from grpo_api.prepare_protocol import ENV_TERMINATION_LOG, latest_progress
from grpo_api.protocol import ENV_PARENT_PID, TrainingProgress
from grpo_api.runconfig import RUN_CONFIG_FILE, RunConfig, ServerEndpoints, run_config_for
from grpo_api.weight_transfer import ENV_WEIGHT_TRANSFER
from grpo_local.processes import Child

#: The loop never sleeps longer than this, so the view and Ctrl-C stay responsive.
MAX_TICK_SECONDS = 0.5
HEALTH_TIMEOUT_SECONDS = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RunEvent:
    at: dt.datetime
    type: str
    reason: str
    message: str


@dataclass
class LocalRun:
    """One GRPORun executed on this machine."""

    run: GRPORun
    run_file: Path
    run_dir: Path
    port: int
    python: str = sys.executable
    on_event: Callable[[RunEvent], None] | None = None
    status: GRPORunStatus = field(default_factory=GRPORunStatus)
    #: Ports of the server replicas after the first (`port`); chosen when the run starts.
    replica_ports: list[int] = field(default_factory=list)
    #: Each attempt's server processes, one per replica.
    servers: dict[int, list[Child]] = field(default_factory=dict)
    trainers: dict[int, Child] = field(default_factory=dict)
    initializer: Child | None = None
    exporter: Child | None = None
    events: list[RunEvent] = field(default_factory=list)
    samples: list[TrainingProgress] = field(default_factory=list)
    started_monotonic: float = field(default_factory=time.monotonic)
    #: The same health probe the operator uses.
    health: HealthClient = field(default_factory=lambda: HealthClient(HEALTH_TIMEOUT_SECONDS))

    def __post_init__(self) -> None:
        if not self.run.metadata.uid:
            # Each `grpo run` is a new object, as each `kubectl apply` of a deleted run is: its attempts count from 1
            # again, and the uid tells them from an earlier run's in the directory (the trainer's attempt record).
            metadata = self.run.metadata.model_copy(update={"uid": uuid.uuid4().hex})
            self.run = self.run.model_copy(update={"metadata": metadata})
        wanted = self.run.spec.effective_server.replicas - 1
        while len(self.replica_ports) < wanted:
            port = free_port()
            if port != self.port and port not in self.replica_ports:
                self.replica_ports.append(port)

    @property
    def server_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in (self.port, *self.replica_ports)]

    @property
    def config(self) -> RunConfig:
        urls = self.server_urls
        return run_config_for(
            self.run,
            volume_root=self.run_dir,
            server_url=urls[0],
            server_endpoints=ServerEndpoints(replicas=len(urls), urls=urls),
            token_file=str(self.token_file),
            base_dir=self.run_file.resolve().parent,
        )

    @property
    def token_file(self) -> Path:
        return self.run_dir / "token"

    @property
    def config_file(self) -> Path:
        return self.run_dir / RUN_CONFIG_FILE

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def finished(self) -> bool:
        return self.status.phase in TERMINAL_PHASES

    # -- one reconcile step ----------------------------------------------------------------------

    def step(self) -> float:
        """Observe, decide, act, record; returns how long to wait before the next step."""
        decision = decide(self.run.spec, self.status, self.observe())
        for action in decision.actions:
            self.apply(action)
        self.status = decision.status
        self.record()
        delay = decision.requeue_after
        return MAX_TICK_SECONDS if delay is None else max(0.05, min(delay, MAX_TICK_SECONDS))

    def observe(self) -> Observation:
        attempt = self.status.attempt
        older = sum(1 for a, cs in self.servers.items() for c in cs if a < attempt and c.alive())
        checks = self.check_health() if wants_health(self.run.spec, self.status) else ()
        server_said = self.server_failed_permanently(attempt)
        trainer, message, trainer_failed_permanently = self.trainer_state(attempt)
        initializer, init_message = self.child_state(self.initializer)
        init_progress = self.initializer_progress()
        if initializer == TrainerState.FAILED and init_progress:
            init_message = init_progress  # its own last words (the protocol's failed line), not the exit code
        exporter, export_message = self.child_state(self.exporter)
        export_said = read_text(self.export_log).strip() if self.exporter is not None else ""
        if exporter == TrainerState.FAILED and export_said:
            export_message = export_said  # its own last words, not the exit code
        progress = self.read_progress()
        if progress is not None and (not self.samples or self.samples[-1].step != progress.step):
            self.samples.append(progress)
        return Observation(
            now=dt.datetime.now(dt.UTC),
            older_servers_alive=older,
            health=checks[0] if checks else None,
            replica_health=checks if len(checks) > 1 else (),
            trainer=trainer,
            trainer_message=message,
            trainer_failed_permanently=trainer_failed_permanently,
            progress=progress,
            server_url=self.config.server_url,
            server_message=server_said or "",
            server_failed_permanently=server_said is not None,
            initializer=initializer,
            initializer_message=init_message,
            initializer_progress=init_progress,
            exporter=exporter,
            exporter_message=export_message,
            export_result=parse_result(export_said) if exporter == TrainerState.SUCCEEDED else None,
        )

    def server_failed_permanently(self, attempt: int) -> str | None:
        """What a server process of the attempt that exited with EXIT_INVALID_SPEC said (its termination log,
        else its last error line); None when none did."""
        for child in self.servers.get(attempt, []):
            if child.poll() == EXIT_INVALID_SPEC:
                said = read_text(Path(child.env[ENV_TERMINATION_LOG])).strip()
                return said or last_error_line(child.log_path)
        return None

    def initializer_progress(self) -> str | None:
        if self.initializer is None or not self.initializer.log_path.is_file():
            return None
        with self.initializer.log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            return latest_progress(f.read().decode("utf-8", errors="replace"))

    def check_health(self) -> tuple[HealthCheck, ...]:
        """One check per replica of the attempt."""
        children = self.servers.get(self.status.attempt, [])
        checks = []
        for i, url in enumerate(self.server_urls):
            health = self.health.check(url, self.run.spec.effective_server.health_path)
            server = children[i] if i < len(children) else None
            if not health.reachable and server is not None and server.poll() is not None:
                error = f"server process exited with code {server.poll()}; see {server.log_path}"
                health = HealthCheck(reachable=False, error=error)
            checks.append(health)
        return tuple(checks)

    def trainer_state(self, attempt: int) -> tuple[TrainerState, str, bool]:
        """The attempt's trainer process: its state, what it said, and whether it failed permanently (it
        exited with EXIT_INVALID_SPEC: a configuration problem, in its own words in its termination log).
        It is never seen as preempted: no scheduler takes a local process away and says so (a Pod's
        DisruptionTarget), and a process killed from outside (a signal, the OOM killer) is told from a crash
        by nothing, so it counts as a failed attempt."""
        child = self.trainers.get(attempt)
        if child is not None and child.poll() is not None and child.alive():
            # The launcher ended, processes of its attempt did not (torchrun, ranks): the attempt ends with them.
            child.kill()
            if child.alive():
                return TrainerState.ACTIVE, f"waiting for the processes of attempt {attempt} to end", False
        state, message = self.child_state(child)
        if child is None or state != TrainerState.FAILED:
            return state, message, False
        said = read_text(self.termination_log(attempt)).strip()
        if child.poll() == EXIT_INVALID_SPEC:
            return state, said or message, True
        return state, f"exit code {child.poll()}: {said}" if said else message, False

    def termination_log(self, attempt: int) -> Path:
        """Where the trainer of this attempt leaves its last words (a pod's /dev/termination-log)."""
        return self.logs_dir / f"trainer-attempt-{attempt}.termination-log"

    def child_state(self, child: Child | None) -> tuple[TrainerState, str]:
        if child is None:
            return TrainerState.ABSENT, ""
        code = child.poll()
        if code is None:
            return TrainerState.ACTIVE, ""
        if code == 0:
            return TrainerState.SUCCEEDED, ""
        return TrainerState.FAILED, f"exit code {code}: {last_error_line(child.log_path)}"

    def read_progress(self) -> TrainingProgress | None:
        path = Path(self.config.paths.progress_file)
        try:
            return TrainingProgress.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            return None

    # -- actions ---------------------------------------------------------------------------------

    def apply(self, action: Action) -> None:
        match action:
            case Provision():
                self.provision()
            case EnsureServer(attempt=attempt, replicas=replicas):
                self.ensure_server(attempt, replicas)
            case StopServer() | DeleteServer():
                self.stop_servers()
            case CreateInitializer():
                self.create_initializer()
            case CreateExporter():
                self.create_exporter()
            case DeleteExporter():
                if self.exporter is not None and self.exporter.alive():
                    self.exporter.stop()
            case CreateTrainer(attempt=attempt):
                self.create_trainer(attempt)
            case DeleteTrainer(attempt=attempt):
                child = self.trainers.get(attempt)
                if child is not None and child.alive():
                    child.stop()
            case Emit():
                event = RunEvent(dt.datetime.now(dt.UTC), action.type, action.reason, action.message)
                self.events.append(event)
                with (self.run_dir / "events.log").open("a") as f:
                    f.write(f"{event.at.isoformat()} {event.type} {event.reason}: {event.message}\n")
                if self.on_event is not None:
                    self.on_event(event)
            case RequeueAfter() | DeleteRun():
                pass  # the loop's pace; a local run has nothing to delete after its TTL
            case _:
                assert_never(action)

    def provision(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if not self.token_file.exists():
            self.token_file.write_text(secrets.token_urlsafe(32))
            self.token_file.chmod(0o600)
        self.config_file.write_text(self.config.to_yaml())

    def child_env(self, attempt: int, extra: Sequence[EnvVar] = ()) -> dict[str, str]:
        """The child's variables; the container's `env` of the spec comes last, as in the pod, so it may
        override ours on purpose."""
        ours = dict(
            child_environment(
                run_config=str(self.config_file),
                attempt=attempt,
                token_file=str(self.token_file),
                server_url=self.config.server_url,
            )
        )
        ours.update({
            "GRPO_TRAINER_METRICS_PORT": os.environ.get("GRPO_TRAINER_METRICS_PORT", "0"),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # server.weightTransfer auto: server and trainer share this machine's GPU. The initializer and the
            # trainer read it too, to know whether the trainer needs vLLM (nccl does, ipc does not).
            ENV_WEIGHT_TRANSFER: str(WeightTransfer.IPC),
        })
        return {**ours, **{e.name: e.literal for e in extra if e.value_from is None}}

    def ensure_server(self, attempt: int, replicas: int) -> None:
        if self.end_older_trainers(attempt):
            return  # not before every process of an earlier attempt is gone; asked again at the next step
        for other, children in self.servers.items():
            for child in children:
                if other != attempt and child.alive():
                    child.stop()
        if replicas < 1 or attempt in self.servers:
            return
        started = []
        for i, port in enumerate((self.port, *self.replica_ports)[:replicas]):
            suffix = "" if i == 0 else f"-replica-{i}"
            child = Child(
                role="server",
                attempt=attempt,
                argv=[self.python, "-m", "grpo_cli.main", "serve", "--config", str(self.config_file),
                      "--host", "127.0.0.1", "--port", str(port)],
                log_path=self.logs_dir / f"server-attempt-{attempt}{suffix}.log",
                env={**self.child_env(attempt, self.run.spec.effective_server.env),
                     ENV_TERMINATION_LOG: str(self.logs_dir / f"server-attempt-{attempt}{suffix}.termination-log")},
            )
            Path(child.env[ENV_TERMINATION_LOG]).unlink(missing_ok=True)  # an earlier `grpo run` here left it
            child.start()
            started.append(child)
        self.servers[attempt] = started

    def server_children(self) -> list[Child]:
        return [c for children in self.servers.values() for c in children]

    def end_older_trainers(self, attempt: int) -> list[Child]:
        """Stop every trainer of an earlier attempt that has a process left; those that still have one."""
        for other, child in self.trainers.items():
            if other < attempt and child.alive():
                child.stop()
        return [c for a, c in self.trainers.items() if a < attempt and c.alive()]

    def stop_servers(self) -> None:
        for child in self.server_children():
            if child.alive():
                child.stop()

    def create_initializer(self) -> None:
        """`grpo prepare` as a process: fetches hf:// sources into the run directory (the hub is reached
        here, unlike in the server and trainer), writes inline reward modules, checks everything loads."""
        if self.initializer is not None:
            return
        env = self.child_env(0, self.run.spec.trainer.env)
        if "HF_HUB_OFFLINE" not in os.environ:
            env.pop("HF_HUB_OFFLINE", None)
        child = Child(
            role="initializer",
            attempt=0,
            argv=[self.python, "-m", "grpo_cli.main", "prepare", "--config", str(self.config_file)],
            log_path=self.logs_dir / "initializer.log",
            env=env,
        )
        child.start()
        self.initializer = child

    @property
    def export_log(self) -> Path:
        """The export step's termination log: its result line, or why it failed."""
        return self.logs_dir / "export.termination-log"

    def create_exporter(self) -> None:
        """`grpo export` as a process, once: a pvc:// claim is the folder <run dir>/claims/<claim>, and the
        credentials are the variables of `grpo run`'s own environment (GRPO_EXPORT_TOKEN, AWS_*, ...), as no
        Secret exists here."""
        output = self.run.spec.output
        if self.exporter is not None or output is None:
            return
        self.export_log.unlink(missing_ok=True)  # an earlier `grpo run` of this directory left it
        env = {ENV_TERMINATION_LOG: str(self.export_log), **self.child_env(0, self.run.spec.trainer.env)}
        destination = output.parsed
        if destination.scheme == "pvc":
            claim = self.run_dir / "claims" / destination.target
            claim.mkdir(parents=True, exist_ok=True)
            env[ENV_EXPORT_CLAIM_ROOT] = str(claim)
        child = Child(
            role="exporter",
            attempt=0,
            argv=[self.python, "-m", "grpo_cli.main", "export", "--config", str(self.config_file)],
            log_path=self.logs_dir / "export.log",
            env=env,
        )
        child.start()
        self.exporter = child

    def create_trainer(self, attempt: int) -> None:
        if attempt in self.trainers:
            return
        self.end_older_trainers(attempt)
        self.termination_log(attempt).unlink(missing_ok=True)  # an earlier `grpo run` of this directory left it
        # The trackers that write files write them into the run directory (as on the claim of a cluster's run).
        tracking = dict(tracker_environment(self.run.spec.trainer.report_to, volume_root=str(self.run_dir),
                                            run_name=self.run.metadata.name))
        child = Child(
            role="trainer",
            attempt=attempt,
            argv=[self.python, "-m", "grpo_cli.main", "train", "--config", str(self.config_file)],
            log_path=self.logs_dir / f"trainer-attempt-{attempt}.log",
            # The trainer dies with this process (a `grpo run` killed outright leaves no trainer behind).
            env={ENV_TERMINATION_LOG: str(self.termination_log(attempt)), **tracking,
                 **self.child_env(attempt, self.run.spec.trainer.env), ENV_PARENT_PID: str(os.getpid())},
        )
        child.start()
        self.trainers[attempt] = child

    def shutdown(self) -> None:
        """End every child: trainers first (they talk to the server), then servers."""
        once = [c for c in (self.initializer, self.exporter) if c is not None]
        for child in [*once, *self.trainers.values(), *self.server_children()]:
            if child.alive():
                child.stop()
        self.health.close()

    def record(self) -> None:
        # status.failedAttempts holds the failed-attempt count, as on a cluster.
        record = {"status": self.status.model_dump(mode="json", by_alias=True, exclude_none=True)}
        _write_json(self.run_dir / "status.json", record)
        children = [
            {"role": c.role, "attempt": c.attempt, "pid": c.pid, "log": str(c.log_path), "exitCode": c.poll()}
            for c in [*([self.initializer] if self.initializer else []), *self.server_children(),
                      *self.trainers.values(), *([self.exporter] if self.exporter else [])]
        ]
        _write_json(self.run_dir / "processes.json",
                    {"port": self.port, "ports": [self.port, *self.replica_ports], "children": children})

    # -- history for the summary -----------------------------------------------------------------

    def history(self) -> list[TrainingProgress]:
        """Every step's progress: the trainer's history file when present, else what the loop sampled."""
        path = Path(self.config.paths.history_file)
        rows: dict[int, TrainingProgress] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    item = TrainingProgress.model_validate_json(line)
                except ValidationError:
                    continue
                rows[item.step] = item  # a resumed attempt may rewrite a step: keep the latest
        for item in self.samples:
            rows.setdefault(item.step, item)
        return [rows[k] for k in sorted(rows) if k > 0]


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_text(path: Path) -> str:
    """The file's text, "" when it does not exist (a process that ended without last words)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def last_error_line(log_path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log that looks like an error, for status messages."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error:", "Exception", "refused", "failed")):
            return line[:limit]
    return lines[-1][:limit] if lines else "empty log"


def phase_label(status: GRPORunStatus) -> str:
    label = str(status.phase)
    if status.phase == Phase.STARTING_SERVER and status.reason:
        label += f" ({status.reason})"
    return label
