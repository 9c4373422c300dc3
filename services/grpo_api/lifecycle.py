"""The run lifecycle as one pure decision: given what was recorded and what is observed, what happens next.

Both executors keep the same lifecycle by calling `decide()`: the operator turns
its actions into Kubernetes objects, the local runner into processes. Nothing
here performs I/O or reads a clock; the caller passes `now`.

The contract (ARCHITECTURE.md, "Lifecycle of one run"):

- before the first attempt, once per run, the initializer fetches the hf:// sources onto the
  run's volume and checks that the model, the dataset and every reward function load; until it
  succeeds no server starts, and its failure fails the run (`SourceUnavailable`), after the
  initializer's own retries of a transient fetch error (a Job's backoffLimit);
- every attempt gets a fresh server: the trainer of attempt N is created only
  when no server of an older attempt is alive and the server answers its health
  check with status 200, a boot id not recorded for an earlier attempt and no
  adapter loaded; `serverReadyTimeoutSeconds` turns a server that never gets
  there into a failed attempt (`ServerNotReady`);
- a failed attempt starts the next one (fresh server first, the trainer resumes
  from its checkpoint) until `backoffLimit` failures, then the run fails; an attempt whose trainer
  was preempted or evicted starts the next one the same way without counting (`Preempted`, counted
  in `status.preemptions`, up to `preemptionLimit`); a trainer
  that failed on a configuration problem no retry fixes (its exit code says so:
  `grpo_api.exit_codes.EXIT_INVALID_SPEC`) fails the run at once (`InvalidSpec`);
- `activeDeadlineSeconds`, `suspend` and `ttlSecondsAfterFinished` behave as on
  Kubernetes Jobs (resuming resets the deadline's start, as for Jobs);
- a run re-created under the name of one still being deleted creates nothing until what the earlier
  run left is gone, and says what it waits for (`WaitingForOldChildren`);
- with `spec.output`, a trainer that succeeded is followed by the export step (`Exporting`: one Job per
  run, or one process), which uploads the result and reports where it went, its digest and size
  (`status.output`); its failure fails the run (`ExportFailed`) without another attempt, and nothing is
  deleted: the adapters stay on the run's volume; suspend waits until it is done, the deadline ends it;
- a run that a queue admits (Kueue, for a run labelled kueue.x-k8s.io/queue-name: `Observation.admission`)
  waits suspended, creating nothing, until it is admitted; one whose admission is taken back mid-run (a
  preemption by Kueue) is suspended as by `suspend`, its pods deleted and its checkpoint kept, counted in
  `status.preemptions` and not against backoffLimit, and resumes with a new attempt once admitted again;
- terminal phases stay terminal.

Actions are idempotent requests ("this should exist"), re-issued on every call
while they hold, so an executor that crashed half-way converges on the next call.
Executors apply the actions first and record the new status last, in one write: the
failed-attempt count (`status.failedAttempts`) moves with the phase and attempt it
belongs to, so a call whose record was lost is simply decided again and counts nothing twice.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal, TypeVar

from grpo_api import reasons
from grpo_api.export_protocol import ExportResult
from grpo_api.models import (
    TERMINAL_PHASES,
    AdapterStatus,
    CleanupPolicy,
    Condition,
    ConditionType,
    GRPORunSpec,
    GRPORunStatus,
    LaggingReplicaStatus,
    Mode,
    OutputStatus,
    Phase,
    ProgressStatus,
    Reason,
    SourcesStatus,
)
from grpo_api.protocol import HealthResponse, TrainingProgress

#: How often to look again while something is expected to change soon (server start, trainer state).
SERVER_POLL_SECONDS = 2.0
INITIALIZER_POLL_SECONDS = 5.0
EXPORTER_POLL_SECONDS = 5.0
TRAINER_POLL_SECONDS = 10.0
#: Boot ids of one attempt's replicas kept in status.server.bootIds (restarts included).
MAX_KNOWN_BOOT_IDS = 64
#: How long the server of a running attempt may fail its health check before ServerReady turns false
#: (a pod restart or a slow answer under load is not an outage).
SERVER_HEALTH_GRACE_SECONDS = 30.0
#: Events and condition messages stay short (events are capped at 1 KiB by convention).
MAX_MESSAGE_CHARS = 1000
#: How often to look again while a queue has not admitted the run (or took its admission back).
QUEUE_POLL_SECONDS = 2.0
#: How often to look again while what an earlier run of the same name left is going away.
EARLIER_RUN_POLL_SECONDS = 2.0
#: Objects of an earlier run named in a status message (the rest are counted).
MAX_NAMED_OBJECTS = 5

#: Reasons whose events are Warnings (the one table: `grpo_api.reasons`).
WARNING_REASONS = reasons.WARNING_REASONS


# ------------------------------------------------------------------------------------------ inputs


class TrainerState(StrEnum):
    """The current attempt's trainer (a Job, or a process), as observed."""

    ABSENT = "Absent"
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class HealthCheck:
    """The latest GET of the server's health path."""

    reachable: bool
    status_code: int | None = None
    body: HealthResponse | None = None
    error: str = ""

    @property
    def healthy(self) -> bool:
        return self.reachable and self.status_code == 200 and self.body is not None

    def describe(self) -> str:
        if not self.reachable:
            return f"unreachable ({self.error})" if self.error else "unreachable"
        if self.status_code != 200:
            status = self.body.status if self.body is not None else ""
            return f"HTTP {self.status_code}" + (f" ({status})" if status else "")
        return "healthy" if self.body is not None else "HTTP 200 with an unreadable body"


class AdmissionState(StrEnum):
    """A queue's answer for a run it queues (the operator reads Kueue's Workload of the run)."""

    #: Not admitted (yet): the run waits, suspended.
    WAITING = "Waiting"
    ADMITTED = "Admitted"
    #: The admission was taken back (preempted, the queue stopped, the Workload deactivated or deleted).
    EVICTED = "Evicted"


@dataclass(frozen=True)
class QueueAdmission:
    """Whether the queue lets the run's pods exist, and its words for it."""

    state: AdmissionState
    #: Why it waits or was evicted (the queue's own words), or where it was admitted.
    message: str = ""
    #: The status reason while it waits: Queued, or QueueNotFound / PriorityClassNotFound when the run's labels
    #: name an object that does not exist (yet).
    waiting_reason: Reason = Reason.QUEUED


@dataclass(frozen=True)
class Observation:
    """What the executor saw of the world for this run, just before deciding."""

    now: dt.datetime
    #: Server pods (or processes) of attempts older than the current one that still exist.
    older_servers_alive: int = 0
    #: The server's health; None when it was not checked (see `wants_health`).
    health: HealthCheck | None = None
    #: With several server replicas: one check per replica of the attempt the executor found (empty:
    #: `health` is the only one).
    replica_health: tuple[HealthCheck, ...] = ()
    trainer: TrainerState = TrainerState.ABSENT
    trainer_message: str = ""
    #: The failed trainer exited with `grpo_api.exit_codes.EXIT_INVALID_SPEC` (on a cluster, its Job failed
    #: by its podFailurePolicy): a configuration problem that no other attempt, nor a fresh server, fixes.
    trainer_failed_permanently: bool = False
    #: The failed trainer's pod was preempted or evicted (on a cluster, its DisruptionTarget condition; its
    #: words in `trainer_message`): the next attempt does not count against backoffLimit.
    trainer_preempted: bool = False
    #: Trainer progress read directly (local runner); by default the health body's relay is used.
    progress: TrainingProgress | None = None
    #: Where the executor reaches the server; recorded in status.server.url.
    server_url: str | None = None
    #: Trouble with the current attempt's server (pod unschedulable, image pull, crash loop), if
    #: any; recorded in status.server.message.
    server_message: str = ""
    #: A server of the current attempt exited with `grpo_api.exit_codes.EXIT_INVALID_SPEC` (its engine cannot
    #: run there: no vLLM in the image, no GPU), in its words in `server_message`: no fresh server fixes it.
    server_failed_permanently: bool = False
    #: The run's initializer (a Job, or a process): fetches and checks the sources once per run.
    initializer: TrainerState = TrainerState.ABSENT
    #: Why it failed (its termination message), or its trouble while it runs (image pull, scheduling).
    initializer_message: str = ""
    #: Its latest progress line, if any.
    initializer_progress: str | None = None
    #: Children the attempt needs that were deleted and can be created again as they were (e.g.
    #: "Service r-server"): Provision re-creates them, with a Warning event.
    missing_children: tuple[str, ...] = ()
    #: Children that carry the attempt's state (its token Secret, its run-config) found deleted: running
    #: pods keep their old copies, which new ones would not match, so the attempt ends and the next one
    #: provisions them afresh.
    lost_children: tuple[str, ...] = ()
    #: What an earlier run of the same name left (e.g. "PersistentVolumeClaim r-data (of GRPORun uid ...,
    #: being deleted)"): a run re-created under a dying run's name creates nothing until it is gone.
    earlier_run_children: tuple[str, ...] = ()
    #: The run's export step (a Job, or a process), after the trainer succeeded (spec.output).
    exporter: TrainerState = TrainerState.ABSENT
    #: Why it failed (its last words), or its trouble while it runs.
    exporter_message: str = ""
    #: Its result line (where the result went, digest, size), once it succeeded.
    export_result: ExportResult | None = None
    #: The queue's admission of a run a queue admits (Kueue); None when none does (no label, `grpo run`).
    admission: QueueAdmission | None = None


# ----------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Provision:
    """Run-config, shared volume and token (and, in server mode, the server's address) should exist."""


@dataclass(frozen=True)
class CreateInitializer:
    """The run's initializer should exist (created once per run; it resumes a fetch it retries)."""


@dataclass(frozen=True)
class CreateExporter:
    """The run's export step should exist (created once per run, after the trainer succeeded)."""


@dataclass(frozen=True)
class DeleteExporter:
    """The run's export step should not run (the run ended while it did: nothing may land after that)."""


@dataclass(frozen=True)
class EnsureServer:
    """The server should exist for this attempt with this many replicas (a new attempt replaces it)."""

    attempt: int
    replicas: int = 1


@dataclass(frozen=True)
class StopServer:
    """The server should run no replicas (GPUs back); its definition and the volume stay."""


@dataclass(frozen=True)
class DeleteServer:
    """The server and its address should not exist."""


@dataclass(frozen=True)
class CreateTrainer:
    """The trainer of this attempt should exist (created once; never re-created after it finished)."""

    attempt: int


@dataclass(frozen=True)
class DeleteTrainer:
    """The trainer of this attempt should not run."""

    attempt: int


@dataclass(frozen=True)
class DeleteRun:
    """The run itself should be deleted (ttlSecondsAfterFinished passed)."""


@dataclass(frozen=True)
class Emit:
    """Record an event on the run."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class RequeueAfter:
    """Decide again after at most this many seconds."""

    seconds: float


Action = (
    Provision
    | CreateInitializer
    | CreateExporter
    | DeleteExporter
    | EnsureServer
    | StopServer
    | DeleteServer
    | CreateTrainer
    | DeleteTrainer
    | DeleteRun
    | Emit
    | RequeueAfter
)


_A = TypeVar("_A")


@dataclass(frozen=True)
class Decision:
    #: The new status, failed-attempt count included.
    status: GRPORunStatus
    actions: tuple[Action, ...]

    @property
    def requeue_after(self) -> float | None:
        delays = [a.seconds for a in self.actions if isinstance(a, RequeueAfter)]
        return min(delays) if delays else None

    def of_type(self, kind: type[_A]) -> list[_A]:
        return [a for a in self.actions if isinstance(a, kind)]


# ---------------------------------------------------------------------------------------- decision


def wants_health(spec: GRPORunSpec, status: GRPORunStatus) -> bool:
    """Whether the decision will use a health check (executors skip the HTTP call otherwise)."""
    return (
        spec.mode == Mode.SERVER
        and not spec.run_policy.suspend
        and status.phase in (Phase.STARTING_SERVER, Phase.TRAINING)
    )


def decide(
    spec: GRPORunSpec,
    status: GRPORunStatus,
    observed: Observation,
    *,
    generation: int | None = None,
) -> Decision:
    """The new status and the actions that bring the world to it. Pure: same inputs, same outputs."""
    step = _Step(spec, status.model_copy(deep=True), observed)
    step.run()
    step.actions = _one_server_action(step.actions)
    new = step.status
    new.observed_generation = generation
    if (new.phase, new.reason) != (status.phase, status.reason) and new.reason:
        kind: Literal["Normal", "Warning"] = "Warning" if new.reason in WARNING_REASONS else "Normal"
        step.actions.append(Emit(kind, new.reason, new.message or ""))
    new.conditions = _conditions(spec, status.conditions, new, observed.now, generation)
    return Decision(status=new, actions=tuple(step.actions))


def _one_server_action(actions: list[Action]) -> list[Action]:
    """At most one action about the server per decision: the last one (a failed attempt asks for its own
    server, then for the next attempt's; acting on both from one snapshot could flap the template)."""
    server = [i for i, a in enumerate(actions) if isinstance(a, EnsureServer | StopServer | DeleteServer)]
    return [a for i, a in enumerate(actions) if i not in server[:-1]]


def troubled(
    spec: GRPORunSpec | None,
    status: GRPORunStatus,
    reason: Reason,
    message: str,
    now: dt.datetime,
    *,
    generation: int | None = None,
) -> Decision:
    """The executor could not carry out a decision (an unexpected error, a child of an earlier run of the
    same name still going away): the recorded status stays, the Reconciled condition says why, and a
    passed activeDeadlineSeconds still fails the run (deadlines apply whatever else goes wrong)."""
    new = status.model_copy(deep=True)
    actions: list[Action] = []
    message = _truncate(message)
    limit = spec.run_policy.active_deadline_seconds if spec is not None else None
    start = new.start_time
    if (
        new.phase not in TERMINAL_PHASES
        and limit is not None
        and start is not None
        and (now - start).total_seconds() >= limit
    ):
        new.phase = Phase.FAILED
        new.reason = Reason.DEADLINE_EXCEEDED
        new.message = _truncate(f"activeDeadlineSeconds ({limit}) passed on attempt {new.attempt} ({message})")
        new.completion_time = now
        new.server.ready = False
        actions.append(Emit("Warning", Reason.DEADLINE_EXCEEDED, new.message))
        new.conditions = set_condition(
            new.conditions, ConditionType.FAILED, "True", Reason.DEADLINE_EXCEEDED, new.message, now, generation
        )
    new.conditions = set_condition(new.conditions, ConditionType.RECONCILED, "False", reason, message, now, generation)
    new.observed_generation = generation
    return Decision(status=new, actions=tuple(actions))


def held_by_earlier_run(
    spec: GRPORunSpec,
    status: GRPORunStatus,
    observed: Observation,
    what: str,
    *,
    generation: int | None = None,
) -> Decision:
    """The executor, carrying out a decision, found a child's name held by what an earlier run of the same
    name left (`what`, e.g. an object its watch had not shown yet). Before the run made anything (Pending) it
    waits as `decide` would have had it seen the object; later the recorded phase stays, the Reconciled
    condition names the object, a Warning event says so once, and the executor looks again soon."""
    if status.phase == Phase.PENDING:
        seen = replace(observed, earlier_run_children=(*observed.earlier_run_children, what))
        return decide(spec, status, seen, generation=generation)
    message = f"waiting for what an earlier run of this name left to go: {what}"
    decision = troubled(spec, status, Reason.WAITING_FOR_OLD_CHILDREN, message, observed.now, generation=generation)
    if decision.status.phase in TERMINAL_PHASES:
        return decision  # the active deadline passed meanwhile
    actions = list(decision.actions)
    before = get_condition(status.conditions, ConditionType.RECONCILED)
    after = get_condition(decision.status.conditions, ConditionType.RECONCILED)
    if after is not None and (before is None or (before.status, before.reason, before.message)
                              != (after.status, after.reason, after.message)):
        actions.append(Emit("Warning", Reason.WAITING_FOR_OLD_CHILDREN, after.message))
    actions.append(RequeueAfter(EARLIER_RUN_POLL_SECONDS))
    return Decision(status=decision.status, actions=tuple(actions))


def reject(
    status: GRPORunStatus,
    message: str,
    now: dt.datetime,
    *,
    generation: int | None = None,
    reason: Reason = Reason.INVALID_SPEC,
) -> Decision:
    """A run that cannot go on whatever is retried: Failed with this reason (InvalidSpec: the spec got past
    admission but not the models; ChildRejected, ChildConflict: the API server refused a child).

    A run that already finished keeps its outcome; nothing more is created for a rejected run.
    """
    new = status.model_copy(deep=True)
    actions: list[Action] = []
    if new.phase not in TERMINAL_PHASES:
        new.phase = Phase.FAILED
        new.reason = reason
        new.message = _truncate(message)
        new.completion_time = now
        new.server.ready = False
        actions.append(Emit("Warning", reason, new.message))
        new.conditions = set_condition(
            new.conditions, ConditionType.FAILED, "True", reason, new.message, now, generation
        )
    new.observed_generation = generation
    return Decision(status=new, actions=tuple(actions))


@dataclass
class _Step:
    spec: GRPORunSpec
    status: GRPORunStatus
    obs: Observation
    actions: list[Action] = field(default_factory=list)

    @property
    def server_mode(self) -> bool:
        return self.spec.mode == Mode.SERVER

    @property
    def replicas(self) -> int:
        """Server replicas of an attempt."""
        return self.spec.effective_server.replicas

    def health_checks(self) -> tuple[HealthCheck, ...]:
        """Every replica's health check (none when the executor did not check)."""
        if self.obs.replica_health:
            return self.obs.replica_health
        return (self.obs.health,) if self.obs.health is not None else ()

    def known_boot_ids(self) -> set[str]:
        server = self.status.server
        return set(server.boot_ids) | ({server.boot_id} if server.boot_id else set())

    @property
    def now(self) -> dt.datetime:
        return self.obs.now

    def run(self) -> None:
        policy = self.spec.run_policy
        phase = self.status.phase
        if phase in TERMINAL_PHASES:
            self.finished()
        elif policy.suspend and phase != Phase.EXPORTING:
            # The export step runs to its end: what it uploads does not survive a stop half-way.
            self.suspend()
        elif phase == Phase.PENDING and self.obs.earlier_run_children:
            self.wait_for_earlier_run()
        elif self.held_by_queue() and phase != Phase.EXPORTING:
            # Neither does a queue stop the export step: the trainer's admission covers it until the run ends.
            self.queue_hold()
        elif phase == Phase.SUSPENDED:
            self.status.start_time = self.now  # as for Jobs: the active deadline restarts on resume
            reason, said = self.resumed_by()
            if self.status.sources.ready:
                self.start_attempt(self.status.attempt + 1, reason, said)
            else:
                self.initialize(reason, f"{said}; fetching and checking the sources")
        elif phase == Phase.PENDING:
            self.status.start_time = self.now
            reason, said = (Reason.CREATED, "run started") if self.obs.admission is None else self.resumed_by()
            self.initialize(reason, f"{said}; fetching and checking the sources")
        elif self.deadline_passed():
            if phase == Phase.EXPORTING:
                self.actions.append(DeleteExporter())
            self.finish(
                Phase.FAILED,
                Reason.DEADLINE_EXCEEDED,
                f"activeDeadlineSeconds ({policy.active_deadline_seconds}) passed "
                f"on attempt {self.status.attempt}",
            )
        elif phase == Phase.INITIALIZING:
            self.await_sources()
        elif phase == Phase.STARTING_SERVER:
            self.await_server()
        elif phase == Phase.EXPORTING:
            self.await_export()
        else:
            self.watch_trainer()

    # -- transitions -------------------------------------------------------------------------------

    def set_phase(self, phase: Phase, reason: Reason, message: str) -> None:
        self.status.phase = phase
        self.status.reason = reason
        self.status.message = _truncate(message)

    def wait_for_earlier_run(self) -> None:
        """Re-created under the name of a run still being deleted: its children have this run's names, so
        nothing is created (nor adopted, nor started beside them) until they are gone; the status says what
        is waited for, and the executor looks again soon."""
        self.set_phase(Phase.PENDING, Reason.WAITING_FOR_OLD_CHILDREN,
                       f"waiting for what an earlier run of this name left to go: "
                       f"{_enumerate(self.obs.earlier_run_children)}")
        self.actions.append(RequeueAfter(EARLIER_RUN_POLL_SECONDS))

    def initialize(self, reason: Reason, message: str) -> None:
        """Before the first attempt: the initializer fetches the hf:// sources and checks that the model,
        the dataset and every reward function load, so a bad source fails the run before any server."""
        self.actions.append(Provision())
        self.actions.append(CreateInitializer())
        self.set_phase(Phase.INITIALIZING, reason, message)
        self.actions.append(RequeueAfter(SERVER_POLL_SECONDS))

    def await_sources(self) -> None:
        state = self.obs.initializer
        progress = _truncate(self.obs.initializer_progress or "") or None
        if progress is not None:
            self.status.sources.progress = progress
        if state == TrainerState.SUCCEEDED:
            self.status.sources = SourcesStatus(ready=True, progress=progress, completed_at=self.now)
            ready = f"sources ready ({progress})" if progress else "sources ready"
            # The initializer's run provisioned the children already.
            self.start_attempt(self.status.attempt + 1, Reason.SOURCES_READY, ready, provision=False)
            return
        if state == TrainerState.FAILED:
            detail = self.obs.initializer_message or progress or "no message"
            self.finish(Phase.FAILED, Reason.SOURCE_UNAVAILABLE, f"the initializer failed: {detail}")
            return
        trouble_text = self.obs.initializer_message
        stuck = self.initializer_stuck_for()
        limit = self.spec.initializer.start_timeout_seconds
        if trouble_text and stuck is not None and stuck >= limit:
            self.finish(
                Phase.FAILED,
                Reason.SOURCE_UNAVAILABLE,
                f"the initializer did not start within initializer.startTimeoutSeconds ({limit}s): {trouble_text}",
            )
            return
        self.actions.append(CreateInitializer())
        trouble = f" ({trouble_text})" if trouble_text else ""
        self.set_phase(
            Phase.INITIALIZING,
            Reason.FETCHING_SOURCES,
            (progress or "waiting for the initializer to fetch and check the sources") + trouble,
        )
        self.actions.append(RequeueAfter(INITIALIZER_POLL_SECONDS))
        self.requeue_for_deadline()

    def initializer_stuck_for(self) -> float | None:
        """Seconds since the run began initializing, while the initializer has not started (no
        progress line yet); None once it has."""
        if self.obs.initializer_progress or self.status.sources.progress:
            return None
        started = self.status.start_time or self.now
        return (self.now - started).total_seconds()

    def start_attempt(self, attempt: int, reason: Reason, message: str, *, provision: bool = True) -> None:
        """Begin attempt N: fresh server first (server mode), the trainer straight away (colocate)."""
        self.status.attempt = attempt
        self.status.attempt_started_at = self.now
        # The boot id stays recorded: the next server must show a different one.
        self.status.server.ready = False
        self.status.server.message = None  # the trouble of the old server is not the new one's
        self.status.server.unhealthy_since = None
        if provision:
            self.actions.append(Provision())
        if self.server_mode:
            self.actions.append(EnsureServer(attempt, self.replicas))
            self.set_phase(
                Phase.STARTING_SERVER, reason, f"attempt {attempt}: {message}; starting a fresh server"
            )
            self.actions.append(RequeueAfter(SERVER_POLL_SECONDS))
        else:
            self.actions.append(CreateTrainer(attempt))
            self.set_phase(Phase.TRAINING, reason, f"attempt {attempt}: {message}; trainer created")
            self.actions.append(RequeueAfter(TRAINER_POLL_SECONDS))

    def attempt_failed(self, reason: Reason, message: str) -> None:
        attempt = self.status.attempt
        self.status.failed_attempts += 1
        failed = self.status.failed_attempts
        limit = self.spec.run_policy.backoff_limit
        if failed <= limit:
            self.actions.append(Emit("Warning", reason, _truncate(message)))
            self.start_attempt(
                attempt + 1,
                Reason.RETRYING,
                f"attempt {attempt} failed ({reason}), retry {failed} of {limit}",
            )
            return
        final = Reason.BACKOFF_LIMIT_EXCEEDED if reason == Reason.TRAINER_FAILED else reason
        if final != reason:
            self.actions.append(Emit("Warning", reason, _truncate(message)))
        self.finish(
            Phase.FAILED, final, f"{message} (failed attempts: {failed}, backoffLimit: {limit})"
        )

    def attempt_preempted(self, message: str) -> None:
        """The attempt's trainer was taken away (preempted, evicted, its node drained): no fault of the run, so
        the next attempt (a fresh server, the trainer resuming from its checkpoint) does not count against
        backoffLimit. Each one is counted in status.preemptions; past runPolicy.preemptionLimit a preemption
        counts as a failed attempt, so a loop of them still ends."""
        if self.count_preemption():
            self.attempt_failed(Reason.TRAINER_FAILED, f"{message} ({self.preemptions_past_limit()})")
            return
        # The phase's reason is the event: Preempted, with this message.
        self.start_attempt(
            self.status.attempt + 1, Reason.PREEMPTED, f"{message}; {self.preemptions_not_counted()}"
        )

    def count_preemption(self) -> bool:
        """Count a preemption in status.preemptions; True when it is past runPolicy.preemptionLimit (it then
        counts as a failed attempt)."""
        self.status.preemptions += 1
        limit = self.spec.run_policy.preemption_limit
        return limit is not None and self.status.preemptions > limit

    def preemptions_past_limit(self) -> str:
        return (f"preemptions: {self.status.preemptions}, past runPolicy.preemptionLimit "
                f"{self.spec.run_policy.preemption_limit}: counted as a failure")

    def preemptions_not_counted(self) -> str:
        limit = self.spec.run_policy.preemption_limit
        of = f" of {limit}" if limit is not None else ""
        return f"not counted against backoffLimit (preemptions: {self.status.preemptions}{of})"

    def start_export(self, trained: str) -> None:
        """The trainer is done: the server is no longer needed (its cleanup policy applies now, so its GPUs
        are free during the upload) and the export step uploads the result."""
        assert self.spec.output is not None
        self.status.server.ready = self.status.server.ready and self.keeps_server()
        self.release_server()
        self.actions.append(CreateExporter())
        self.set_phase(Phase.EXPORTING, Reason.EXPORTING,
                       f"{trained}; exporting the {self.spec.output.form} to {self.spec.output.destination}")
        self.actions.append(RequeueAfter(EXPORTER_POLL_SECONDS))

    def await_export(self) -> None:
        output = self.spec.output
        assert output is not None
        self.release_server()
        state, result = self.obs.exporter, self.obs.export_result
        if state == TrainerState.SUCCEEDED and result is not None:
            self.status.output = OutputStatus(uri=result.uri, form=result.form, digest=result.digest,
                                              size=result.size, files=result.files, source=result.source or None,
                                              completed_at=self.now)
            self.finish(Phase.SUCCEEDED, Reason.COMPLETED,
                        f"exported the {result.form} to {result.uri} ({result.digest}, {result.size} bytes)")
            return
        if state in (TrainerState.SUCCEEDED, TrainerState.FAILED):
            detail = self.obs.exporter_message or (
                "it ended without a result line" if state == TrainerState.SUCCEEDED else "no message")
            kept = f" (latest: {self.status.adapter.path})" if self.status.adapter.path else ""
            self.finish(Phase.FAILED, Reason.EXPORT_FAILED,
                        f"the export to {output.destination} failed: {detail}; the adapters stay on the run's "
                        f"volume{kept}")
            return
        self.actions.append(CreateExporter())
        trouble = f" ({self.obs.exporter_message})" if self.obs.exporter_message else ""
        self.status.message = _truncate(
            f"exporting the {output.form} to {output.destination}{trouble}")
        self.actions.append(RequeueAfter(EXPORTER_POLL_SECONDS))
        self.requeue_for_deadline()

    def release_server(self) -> None:
        """The server's cleanup policy, once the trainer is done."""
        if not self.server_mode:
            return
        policy = self.spec.run_policy.cleanup_policy
        if policy == CleanupPolicy.STOP_SERVER:
            self.actions.append(StopServer())
        elif policy == CleanupPolicy.DELETE_SERVER:
            self.actions.append(DeleteServer())

    def finish(self, phase: Phase, reason: Reason, message: str) -> None:
        self.set_phase(phase, reason, message)
        self.status.completion_time = self.now
        self.finished()

    def suspend(self) -> None:
        if (self.status.phase, self.status.reason) != (Phase.SUSPENDED, Reason.SUSPENDED):
            self.set_phase(
                Phase.SUSPENDED, Reason.SUSPENDED, f"suspended during attempt {self.status.attempt}"
            )
        self.release_pods()

    def release_pods(self) -> None:
        """A suspended run holds no pod: its trainer goes; its server stops, or with a queue goes (its next
        admission may place it elsewhere); the volume, and with it the checkpoint, stays."""
        self.status.server.ready = False
        self.status.server.message = None
        if self.status.attempt > 0 and self.obs.trainer != TrainerState.ABSENT:
            self.actions.append(DeleteTrainer(self.status.attempt))
        if self.server_mode:
            self.actions.append(StopServer() if self.obs.admission is None else DeleteServer())

    # -- a queue's admission -----------------------------------------------------------------------

    def held_by_queue(self) -> bool:
        return self.obs.admission is not None and self.obs.admission.state != AdmissionState.ADMITTED

    def resumed_by(self) -> tuple[Reason, str]:
        """The reason and words of a start or resume: the queue's admission, or the user's resume."""
        admission = self.obs.admission
        if admission is None:
            return Reason.RESUMED, "resumed"
        return Reason.ADMITTED, f"admitted by Kueue ({admission.message})" if admission.message else "admitted by Kueue"

    def queue_hold(self) -> None:
        """Not admitted: the run waits suspended, creating nothing. An admission taken back while the run ran
        (a preemption by Kueue) ends the attempt as a preempted trainer does, without counting against
        backoffLimit, but the next attempt waits for the queue to admit the run again."""
        admission = self.obs.admission
        assert admission is not None
        phase, attempt = self.status.phase, self.status.attempt
        if phase in (Phase.STARTING_SERVER, Phase.TRAINING):
            message = f"attempt {attempt} evicted by Kueue: {admission.message or 'its admission was taken back'}"
            if self.count_preemption():
                self.status.failed_attempts += 1
                failed, limit = self.status.failed_attempts, self.spec.run_policy.backoff_limit
                over = f"{message} ({self.preemptions_past_limit()})"
                if failed > limit:
                    self.actions.append(Emit("Warning", Reason.TRAINER_FAILED, _truncate(over)))
                    self.finish(Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED,
                                f"{over} (failed attempts: {failed}, backoffLimit: {limit})")
                    return
                counted = f"counted as failed attempt {failed} of backoffLimit {limit}"
            else:
                counted = self.preemptions_not_counted()
            self.hold(Reason.EVICTED, f"{message}; suspended with its checkpoint kept until Kueue admits it "
                                      f"again; {counted}")
        elif phase == Phase.INITIALIZING:
            self.hold(Reason.EVICTED, f"evicted by Kueue before the first attempt: "
                                      f"{admission.message or 'its admission was taken back'}")
        elif admission.state == AdmissionState.EVICTED and self.status.reason == Reason.EVICTED:
            self.hold(Reason.EVICTED, self.status.message or "evicted by Kueue")
        else:
            self.hold(admission.waiting_reason, f"waiting for Kueue to admit it: {admission.message or 'queued'}")
        self.actions.append(RequeueAfter(QUEUE_POLL_SECONDS))

    def hold(self, reason: Reason, message: str) -> None:
        self.set_phase(Phase.SUSPENDED, reason, message)
        self.release_pods()

    # -- steady states -----------------------------------------------------------------------------

    def finished(self) -> None:
        """Terminal: keep the cleanup true, stop a trainer that still runs, delete the run after its TTL."""
        self.status.server.ready = self.status.server.ready and self.keeps_server()
        if self.obs.trainer == TrainerState.ACTIVE and self.status.attempt > 0:
            self.actions.append(DeleteTrainer(self.status.attempt))
        self.release_server()
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        if ttl is None:
            return
        finished_at = self.status.completion_time or self.now
        self.status.completion_time = finished_at
        remaining = (finished_at - self.now).total_seconds() + ttl
        self.actions.append(DeleteRun() if remaining <= 0 else RequeueAfter(remaining))

    def keeps_server(self) -> bool:
        return self.server_mode and self.spec.run_policy.cleanup_policy == CleanupPolicy.KEEP_SERVER

    def children_intact(self) -> bool:
        """Lost children end the attempt (False); missing ones are created again, with an event."""
        attempt = self.status.attempt
        if self.obs.lost_children:
            if self.obs.trainer == TrainerState.ACTIVE:
                self.actions.append(DeleteTrainer(attempt))
            self.attempt_failed(
                Reason.CHILD_DELETED,
                f"attempt {attempt}: {', '.join(self.obs.lost_children)} deleted mid-attempt; its running pods "
                "keep the old copy, which new ones would not match, so the next attempt provisions it afresh",
            )
            return False
        if self.obs.missing_children:
            self.actions.append(Provision())
            self.actions.append(
                Emit(
                    "Warning",
                    Reason.CHILD_RESTORED,
                    f"attempt {attempt}: {', '.join(self.obs.missing_children)} deleted mid-attempt; created again",
                )
            )
        return True

    def await_server(self) -> None:
        attempt = self.status.attempt
        if not self.children_intact():
            return
        if self.obs.server_failed_permanently:
            self.status.failed_attempts += 1
            self.status.server.message = _truncate(self.obs.server_message) or None
            self.finish(
                Phase.FAILED,
                Reason.INVALID_SPEC,
                f"server of attempt {attempt} failed on a configuration problem that no retry fixes: "
                f"{self.obs.server_message or 'exit code 2'}",
            )
            return
        self.actions.append(EnsureServer(attempt, self.replicas))
        self.status.server.message = _truncate(self.obs.server_message) or None
        started = self.status.attempt_started_at or self.now
        self.status.attempt_started_at = started
        timeout = self.spec.run_policy.server_ready_timeout_seconds
        waited = (self.now - started).total_seconds()
        if self.obs.older_servers_alive:
            reason, detail = (
                Reason.WAITING_FOR_OLD_SERVER,
                (f"waiting for {self.obs.older_servers_alive} server(s) of an earlier attempt to go away"),
            )
        else:
            fresh, verdict = self.fresh_servers()
            if verdict is None:
                boots = [body.boot_id for body in fresh]
                self.status.server.boot_id = boots[0]
                self.status.server.boot_ids = boots
                self.status.server.ready = True
                self.status.server.ready_replicas = len(boots)
                self.status.server.url = self.obs.server_url or self.status.server.url
                self.actions.append(CreateTrainer(attempt))
                who = (f"server {boots[0]} passed its health check" if len(boots) == 1
                       else f"{len(boots)} server replicas ({', '.join(boots)}) passed their health checks")
                self.set_phase(
                    Phase.TRAINING,
                    Reason.TRAINER_RUNNING,
                    f"attempt {attempt}: {who} after {waited:.0f}s; trainer created",
                )
                self.actions.append(RequeueAfter(TRAINER_POLL_SECONDS))
                return
            reason, detail = Reason.SERVER_STARTING, f"waiting for a fresh server: {verdict}"
        if waited >= timeout:
            self.attempt_failed(
                Reason.SERVER_NOT_READY,
                f"attempt {attempt}: server not ready within "
                f"serverReadyTimeoutSeconds ({timeout}s): {detail}",
            )
            return
        self.set_phase(Phase.STARTING_SERVER, reason, f"attempt {attempt}: {detail}")
        self.actions.append(RequeueAfter(min(SERVER_POLL_SECONDS, max(timeout - waited, 0.1))))
        self.requeue_for_deadline()

    def fresh_servers(self) -> tuple[list[HealthResponse], str | None]:
        """The fresh, healthy replicas, and None when there are enough of them; otherwise why not (for the
        status message)."""
        checks = self.health_checks()
        if not checks:
            return [], "not checked yet"
        fresh: list[HealthResponse] = []
        problems: list[str] = []
        for check in checks:
            problem = self.fresh_server_verdict(check)
            if problem is None and check.body is not None:
                fresh.append(check.body)
            elif problem is not None:
                problems.append(problem)
        if len(fresh) >= self.replicas:
            return fresh[: self.replicas], None
        if self.replicas == 1:
            return fresh, problems[0] if problems else "not checked yet"
        detail = f"; {problems[0]}" if problems else ""
        return fresh, f"{len(fresh)} of {self.replicas} replicas fresh and healthy{detail}"

    def fresh_server_verdict(self, health: HealthCheck) -> str | None:
        """None when this server (replica) is fresh and healthy; otherwise why not."""
        if not health.healthy or health.body is None:
            return health.describe()
        boot = health.body.boot_id
        if boot in self.known_boot_ids():
            return f"boot id {boot} belongs to an earlier attempt"
        if health.body.adapter is not None:
            return f"server already has adapter v{health.body.adapter.version} loaded"
        return None

    def watch_trainer(self) -> None:
        attempt = self.status.attempt
        if not self.children_intact():
            return
        if self.server_mode:
            self.actions.append(EnsureServer(attempt, self.replicas))
            self.status.server.message = _truncate(self.obs.server_message) or None
            self.record_server()
        self.record_progress()
        trainer = self.obs.trainer
        detail = f": {self.obs.trainer_message}" if self.obs.trainer_message else ""
        if trainer == TrainerState.SUCCEEDED and self.spec.output is not None:
            self.start_export(f"trainer of attempt {attempt} completed{detail}")
        elif trainer == TrainerState.SUCCEEDED:
            self.finish(Phase.SUCCEEDED, Reason.COMPLETED, f"trainer of attempt {attempt} completed{detail}")
        elif trainer == TrainerState.FAILED and self.obs.trainer_failed_permanently:
            self.status.failed_attempts += 1
            self.finish(
                Phase.FAILED,
                Reason.INVALID_SPEC,
                f"trainer of attempt {attempt} failed on a configuration problem that no retry fixes{detail}",
            )
        elif trainer == TrainerState.FAILED and self.obs.trainer_preempted:
            self.attempt_preempted(f"trainer of attempt {attempt} was preempted{detail}")
        elif trainer == TrainerState.FAILED:
            self.attempt_failed(Reason.TRAINER_FAILED, f"trainer of attempt {attempt} failed{detail}")
        elif trainer == TrainerState.ABSENT:
            self.attempt_failed(Reason.TRAINER_FAILED, f"trainer of attempt {attempt} disappeared")
        else:
            self.actions.append(RequeueAfter(TRAINER_POLL_SECONDS))
            self.requeue_for_deadline()

    def record_server(self) -> None:
        """ServerReady follows the server's health for the whole attempt (after a grace period); keep the
        adapter from its health; note a server that restarted under the trainer."""
        checks = self.health_checks()
        if not checks:
            return
        server = self.status.server
        bodies = [c.body for c in checks if c.healthy and c.body is not None]
        server.ready_replicas = len(bodies)
        self.record_restarts(bodies)
        self.record_adapter(bodies)
        if len(bodies) < self.replicas:
            health = next((c for c in checks if not c.healthy or c.body is None), None)
            problem = health.describe() if health is not None else "no answer"
            if self.replicas > 1:
                problem = f"{len(bodies)} of {self.replicas} replicas healthy; {problem}"
            since = server.unhealthy_since or self.now
            server.unhealthy_since = since
            down = (self.now - since).total_seconds()
            if down >= SERVER_HEALTH_GRACE_SECONDS:
                if server.ready:
                    server.ready = False
                    self.actions.append(
                        Emit(
                            "Warning",
                            Reason.SERVER_UNHEALTHY,
                            f"server of attempt {self.status.attempt} has failed its health check for "
                            f"{down:.0f}s: {problem}",
                        )
                    )
                server.message = server.message or _truncate(f"health check: {problem}")
            self.actions.append(RequeueAfter(SERVER_POLL_SECONDS))
            return
        if server.unhealthy_since is not None and not server.ready:
            self.actions.append(
                Emit("Normal", Reason.SERVER_READY,
                     f"server of attempt {self.status.attempt} answers its health check again")
            )
        server.unhealthy_since = None
        server.ready = True

    def record_restarts(self, bodies: list[HealthResponse]) -> None:
        """A replica answering with a boot id not seen in this attempt restarted (or replaced a lost one)."""
        server = self.status.server
        known = self.known_boot_ids()
        for body in bodies:
            if server.boot_id is None or body.boot_id in known:
                continue
            was = server.boot_id if self.replicas == 1 else "a lost or restarted replica"
            self.actions.append(
                Emit(
                    "Warning",
                    "ServerRestarted",
                    f"server of attempt {self.status.attempt} restarted (boot id "
                    f"{was} -> {body.boot_id}); the trainer reloads its adapter",
                )
            )
            if self.replicas == 1:
                server.boot_id = body.boot_id
            server.boot_ids = [*server.boot_ids, body.boot_id][-MAX_KNOWN_BOOT_IDS:]
            known.add(body.boot_id)

    def record_adapter(self, bodies: list[HealthResponse]) -> None:
        """The newest adapter any replica serves."""
        adapters = [b.adapter for b in bodies if b.adapter is not None]
        if adapters:
            newest = max(adapters, key=lambda a: a.version)
            self.status.adapter = AdapterStatus(
                version=newest.version, path=newest.path, loaded_at=newest.loaded_at
            )

    def record_progress(self) -> None:
        progress = self.obs.progress
        if progress is None:
            progress = next((c.body.progress for c in self.health_checks()
                             if c.body is not None and c.body.progress is not None), None)
        if progress is not None:
            self.status.progress = ProgressStatus(
                step=progress.step, max_steps=progress.max_steps, reward_mean=progress.reward_mean,
                lagging_replicas=[LaggingReplicaStatus(url=r.url[:1024], since=r.since, reason=r.reason[:1024])
                                  for r in progress.lagging_replicas[:64]],
            )

    # -- deadlines ---------------------------------------------------------------------------------

    def deadline_passed(self) -> bool:
        limit = self.spec.run_policy.active_deadline_seconds
        start = self.status.start_time
        return limit is not None and start is not None and (self.now - start).total_seconds() >= limit

    def requeue_for_deadline(self) -> None:
        limit = self.spec.run_policy.active_deadline_seconds
        start = self.status.start_time
        if limit is not None and start is not None:
            self.actions.append(RequeueAfter(max((start - self.now).total_seconds() + limit, 0.1)))


# -------------------------------------------------------------------------------------- conditions


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int | None = None,
) -> list[Condition]:
    """Upsert one condition (list keyed by type); lastTransitionTime moves only when status flips."""
    result: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            result.append(cond)
            continue
        found = True
        since = cond.last_transition_time if cond.status == status else now
        result.append(_condition(type_, status, reason, message, since, generation))
    if not found:
        result.append(_condition(type_, status, reason, message, now, generation))
    return result


def get_condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def _condition(
    type_: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    since: dt.datetime,
    generation: int | None,
) -> Condition:
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=_truncate(message),
        last_transition_time=since,
        observed_generation=generation,
    )


def _conditions(
    spec: GRPORunSpec,
    previous: list[Condition],
    status: GRPORunStatus,
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """The conditions that follow from the new status.

    ServerReady (server mode) and TrainerRunning are always present; Suspended, Succeeded and
    Failed appear once they first become true.
    """
    phase, reason, message = status.phase, status.reason or "", status.message or ""
    conds = list(previous)

    def put(type_: ConditionType, value: bool, true_reason: str) -> None:
        nonlocal conds
        conds = set_condition(
            conds,
            type_,
            "True" if value else "False",
            true_reason if value else reason,
            message,
            now,
            generation,
        )

    put(ConditionType.SOURCES_READY, status.sources.ready, Reason.SOURCES_READY)
    if spec.mode == Mode.SERVER:
        if phase == Phase.TRAINING and not status.server.ready:
            # The server went away under a running trainer: say so, not the phase's reason.
            conds = set_condition(conds, ConditionType.SERVER_READY, "False", Reason.SERVER_UNHEALTHY,
                                  status.server.message or "the server fails its health check", now, generation)
        else:
            put(ConditionType.SERVER_READY, status.server.ready, Reason.SERVER_READY)
    put(ConditionType.TRAINER_RUNNING, phase == Phase.TRAINING, Reason.TRAINER_RUNNING)
    for type_, flag in (
        (ConditionType.SUSPENDED, phase == Phase.SUSPENDED),
        (ConditionType.SUCCEEDED, phase == Phase.SUCCEEDED),
        (ConditionType.FAILED, phase == Phase.FAILED),
    ):
        if flag or get_condition(conds, type_) is not None:
            put(type_, flag, reason)
    if reason == Reason.WAITING_FOR_OLD_CHILDREN:
        # Where a reconcile blocked by an earlier run's object (held_by_earlier_run) reports it too.
        conds = set_condition(conds, ConditionType.RECONCILED, "False", reason, message, now, generation)
    elif get_condition(conds, ConditionType.RECONCILED) is not None:
        conds = set_condition(conds, ConditionType.RECONCILED, "True", Reason.RECONCILED,
                              "the last decision was carried out", now, generation)
    return conds


def _enumerate(items: tuple[str, ...]) -> str:
    """The first few items, and how many more there are."""
    shown = ", ".join(items[:MAX_NAMED_OBJECTS])
    rest = len(items) - MAX_NAMED_OBJECTS
    return f"{shown} and {rest} more" if rest > 0 else shown


def _truncate(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"
