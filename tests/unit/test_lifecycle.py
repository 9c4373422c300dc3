"""The shared run lifecycle (grpo_api.lifecycle.decide): table-driven checks of every transition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from grpo_api.lifecycle import (
    CreateInitializer,
    CreateTrainer,
    Decision,
    DeleteRun,
    DeleteServer,
    DeleteTrainer,
    Emit,
    EnsureServer,
    HealthCheck,
    Observation,
    Provision,
    StopServer,
    TrainerState,
    decide,
    get_condition,
    held_by_earlier_run,
    set_condition,
    wants_health,
)
from grpo_api.models import GRPORunSpec, GRPORunStatus, Phase, Reason
from grpo_api.protocol import TrainingProgress
from tests.fixtures.lifecycle_decisions import UNREACHABLE, at, events, healthy, make_spec, non_meta, status


@dataclass
class Case:
    name: str
    status: GRPORunStatus
    obs: Observation
    spec: GRPORunSpec = field(default_factory=make_spec)
    phase: Phase = Phase.PENDING
    reason: str = ""
    actions: list[object] = field(default_factory=list)
    attempt: int | None = None
    failed_after: int | None = None
    events: list[tuple[str, str]] | None = None
    message_has: str = ""


CASES = [
    Case(
        "new run provisions and starts its initializer, no server yet",
        status(),
        Observation(now=at(0)),
        phase=Phase.INITIALIZING,
        reason=Reason.CREATED,
        attempt=0,
        actions=[Provision(), CreateInitializer()],
        events=[("Normal", Reason.CREATED)],
    ),
    Case(
        "new colocate run starts its initializer too",
        status(),
        Observation(now=at(0)),
        spec=make_spec("colocate"),
        phase=Phase.INITIALIZING,
        reason=Reason.CREATED,
        attempt=0,
        actions=[Provision(), CreateInitializer()],
    ),
    Case(
        "the initializer's progress shows in the message while it runs",
        status(Phase.INITIALIZING, 0, reason=Reason.CREATED),
        Observation(now=at(30), initializer=TrainerState.ACTIVE, initializer_progress="model: 3/7 files"),
        phase=Phase.INITIALIZING,
        reason=Reason.FETCHING_SOURCES,
        attempt=0,
        actions=[CreateInitializer()],
        message_has="model: 3/7 files",
    ),
    Case(
        "sources ready starts attempt 1 with a fresh server",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(40), initializer=TrainerState.SUCCEEDED, initializer_progress="sources ready: ..."),
        phase=Phase.STARTING_SERVER,
        reason=Reason.SOURCES_READY,
        attempt=1,
        failed_after=0,
        actions=[EnsureServer(1, 1)],
        events=[("Normal", Reason.SOURCES_READY)],
    ),
    Case(
        "sources ready starts the trainer of attempt 1 in colocate mode",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(40), initializer=TrainerState.SUCCEEDED),
        spec=make_spec("colocate"),
        phase=Phase.TRAINING,
        reason=Reason.SOURCES_READY,
        attempt=1,
        actions=[CreateTrainer(1)],
    ),
    Case(
        "a failed initializer fails the run, no server, no retry of attempts",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(40), initializer=TrainerState.FAILED,
                    initializer_message="spec.rewards[0]: cannot import module 'mine'"),
        spec=make_spec(backoffLimit=5),
        phase=Phase.FAILED,
        reason=Reason.SOURCE_UNAVAILABLE,
        attempt=0,
        failed_after=0,
        actions=[StopServer()],
        events=[("Warning", Reason.SOURCE_UNAVAILABLE)],
        message_has="cannot import module 'mine'",
    ),
    Case(
        "a gone initializer is created again (it resumes)",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(40)),
        phase=Phase.INITIALIZING,
        reason=Reason.FETCHING_SOURCES,
        attempt=0,
        actions=[CreateInitializer()],
    ),
    Case(
        "an initializer that cannot start within startTimeoutSeconds fails the run, naming why",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(601), initializer=TrainerState.ACTIVE,
                    initializer_message='pod r-init-x: Unschedulable: persistentvolumeclaim "models" not found'),
        phase=Phase.FAILED,
        reason=Reason.SOURCE_UNAVAILABLE,
        attempt=0,
        message_has='persistentvolumeclaim "models" not found',
        events=[("Warning", Reason.SOURCE_UNAVAILABLE)],
    ),
    Case(
        "an initializer in trouble waits within startTimeoutSeconds, the trouble in the message",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(599), initializer=TrainerState.ACTIVE,
                    initializer_message="pod r-init-x: ImagePullBackOff: back-off pulling image"),
        phase=Phase.INITIALIZING,
        reason=Reason.FETCHING_SOURCES,
        attempt=0,
        actions=[CreateInitializer()],
        message_has="ImagePullBackOff",
    ),
    Case(
        "an initializer that started is not bound by startTimeoutSeconds",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(5000), initializer=TrainerState.ACTIVE, initializer_progress="model: 3/7 files",
                    initializer_message="retrying after: connection reset"),
        phase=Phase.INITIALIZING,
        reason=Reason.FETCHING_SOURCES,
        attempt=0,
        actions=[CreateInitializer()],
    ),
    Case(
        "the active deadline also bounds the initializer",
        status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES),
        Observation(now=at(100), initializer=TrainerState.ACTIVE),
        spec=make_spec(activeDeadlineSeconds=60),
        phase=Phase.FAILED,
        reason=Reason.DEADLINE_EXCEEDED,
        attempt=0,
    ),
    Case(
        "run created suspended starts nothing",
        status(),
        Observation(now=at(0)),
        spec=make_spec(suspend=True),
        phase=Phase.SUSPENDED,
        reason=Reason.SUSPENDED,
        attempt=0,
        actions=[StopServer()],
    ),
    Case(
        "no trainer while a server of an older attempt is alive, even if health looks fresh",
        status(Phase.STARTING_SERVER, 2, boot_id="boot-1"),
        Observation(now=at(5), older_servers_alive=1, health=healthy("boot-2")),
        phase=Phase.STARTING_SERVER,
        reason=Reason.WAITING_FOR_OLD_SERVER,
        actions=[EnsureServer(2, 1)],
    ),
    Case(
        "no trainer while the server is unreachable",
        status(Phase.STARTING_SERVER, 1),
        Observation(now=at(5), health=UNREACHABLE),
        phase=Phase.STARTING_SERVER,
        reason=Reason.SERVER_STARTING,
        actions=[EnsureServer(1, 1)],
        message_has="connection refused",
    ),
    Case(
        "no trainer while health answers 503",
        status(Phase.STARTING_SERVER, 1),
        Observation(now=at(5), health=healthy(code=503)),
        phase=Phase.STARTING_SERVER,
        reason=Reason.SERVER_STARTING,
        actions=[EnsureServer(1, 1)],
        message_has="HTTP 503",
    ),
    Case(
        "no trainer while health shows the boot id of an earlier attempt",
        status(Phase.STARTING_SERVER, 2, boot_id="boot-1"),
        Observation(now=at(5), health=healthy("boot-1")),
        phase=Phase.STARTING_SERVER,
        reason=Reason.SERVER_STARTING,
        actions=[EnsureServer(2, 1)],
        message_has="boot-1",
    ),
    Case(
        "no trainer while the server already has an adapter loaded",
        status(Phase.STARTING_SERVER, 2, boot_id="boot-1"),
        Observation(now=at(5), health=healthy("boot-2", adapter=3)),
        phase=Phase.STARTING_SERVER,
        reason=Reason.SERVER_STARTING,
        actions=[EnsureServer(2, 1)],
        message_has="adapter v3",
    ),
    Case(
        "fresh healthy server without adapter creates the trainer of the attempt",
        status(Phase.STARTING_SERVER, 2, boot_id="boot-1"),
        Observation(now=at(5), health=healthy("boot-2"), server_url="http://r-server:8000"),
        phase=Phase.TRAINING,
        reason=Reason.TRAINER_RUNNING,
        actions=[EnsureServer(2, 1), CreateTrainer(2)],
        events=[("Normal", Reason.TRAINER_RUNNING)],
    ),
    Case(
        "server not ready by the deadline fails the attempt and retries with a new server",
        status(Phase.STARTING_SERVER, 1, attempt_started=0),
        Observation(now=at(60), health=UNREACHABLE),
        spec=make_spec(serverReadyTimeoutSeconds=60, backoffLimit=1),
        phase=Phase.STARTING_SERVER,
        reason=Reason.RETRYING,
        attempt=2,
        failed_after=1,
        actions=[Provision(), EnsureServer(2, 1)],
        events=[("Warning", Reason.SERVER_NOT_READY), ("Warning", Reason.RETRYING)],
    ),
    Case(
        "server not ready with no retries left fails the run with ServerNotReady",
        status(Phase.STARTING_SERVER, 1, attempt_started=0),
        Observation(now=at(61), health=UNREACHABLE),
        spec=make_spec(serverReadyTimeoutSeconds=60, backoffLimit=0),
        phase=Phase.FAILED,
        reason=Reason.SERVER_NOT_READY,
        failed_after=1,
        actions=[StopServer()],
        events=[("Warning", Reason.SERVER_NOT_READY)],
        message_has="serverReadyTimeoutSeconds (60s)",
    ),
    Case(
        "waiting on an old server still counts toward the server deadline",
        status(Phase.STARTING_SERVER, 2, attempt_started=0, failed=1),
        Observation(now=at(61), older_servers_alive=1),
        spec=make_spec(serverReadyTimeoutSeconds=60, backoffLimit=0),
        phase=Phase.FAILED,
        reason=Reason.SERVER_NOT_READY,
        failed_after=2,
    ),
    Case(
        "failed trainer starts the next attempt with a fresh server first",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=healthy("boot-1"), trainer=TrainerState.FAILED, trainer_message="OOM"),
        spec=make_spec(backoffLimit=2),
        phase=Phase.STARTING_SERVER,
        reason=Reason.RETRYING,
        attempt=2,
        failed_after=1,
        actions=[Provision(), EnsureServer(2, 1)],
        events=[("Warning", Reason.TRAINER_FAILED), ("Warning", Reason.RETRYING)],
    ),
    Case(
        "failed trainer with the backoff limit used up fails the run",
        status(Phase.TRAINING, 3, boot_id="boot-3", ready=True, failed=2),
        Observation(now=at(30), trainer=TrainerState.FAILED, trainer_message="OOM"),
        spec=make_spec(backoffLimit=2),
        phase=Phase.FAILED,
        reason=Reason.BACKOFF_LIMIT_EXCEEDED,
        failed_after=3,
        actions=[StopServer()],
        message_has="OOM",
        events=[("Warning", Reason.TRAINER_FAILED), ("Warning", Reason.BACKOFF_LIMIT_EXCEEDED)],
    ),
    Case(
        "a trainer that failed on a configuration problem fails the run at once, with budget left",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=healthy("boot-1"), trainer=TrainerState.FAILED,
                    trainer_failed_permanently=True,
                    trainer_message="spec.dataset: /data/prompts.jsonl is empty: no rows to train on"),
        spec=make_spec(backoffLimit=5),
        phase=Phase.FAILED,
        reason=Reason.INVALID_SPEC,
        attempt=1,
        failed_after=1,
        actions=[StopServer()],
        events=[("Warning", Reason.INVALID_SPEC)],
        message_has="no retry fixes: spec.dataset: /data/prompts.jsonl is empty",
    ),
    Case(
        "a server that cannot run its engine (exit code 2: no vLLM, no GPU) fails the run at once, with budget left",
        status(Phase.STARTING_SERVER, 1),
        Observation(now=at(30), server_failed_permanently=True,
                    server_message="the server cannot run: EngineUnavailable: spec.server.engine vllm needs a CUDA GPU",
                    health=HealthCheck(reachable=False, error="no ready server pod of attempt 1 yet")),
        spec=make_spec(backoffLimit=5),
        phase=Phase.FAILED,
        reason=Reason.INVALID_SPEC,
        attempt=1,
        failed_after=1,
        actions=[StopServer()],
        events=[("Warning", Reason.INVALID_SPEC)],
        message_has="no retry fixes: the server cannot run: EngineUnavailable: spec.server.engine vllm needs a CUDA",
    ),
    Case(
        "the failure count, not the attempt number, meets the backoff limit (a suspended attempt is no failure)",
        status(Phase.TRAINING, 3, boot_id="boot-3", ready=True, failed=1),
        Observation(now=at(30), trainer=TrainerState.FAILED),
        spec=make_spec(backoffLimit=2),
        phase=Phase.STARTING_SERVER,
        reason=Reason.RETRYING,
        attempt=4,
        failed_after=2,
        message_has="retry 2 of 2",
    ),
    Case(
        "trainer that vanished counts as a failed attempt",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), trainer=TrainerState.ABSENT),
        phase=Phase.STARTING_SERVER,
        reason=Reason.RETRYING,
        attempt=2,
        failed_after=1,
        message_has="attempt 1",
    ),
    Case(
        "succeeded trainer finishes the run and stops the server",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=healthy("boot-1", adapter=5), trainer=TrainerState.SUCCEEDED),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        actions=[StopServer()],
        events=[("Normal", Reason.COMPLETED)],
    ),
    Case(
        "cleanupPolicy DeleteServer deletes the server on success",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), trainer=TrainerState.SUCCEEDED),
        spec=make_spec(cleanupPolicy="DeleteServer"),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        actions=[DeleteServer()],
    ),
    Case(
        "cleanupPolicy KeepServer leaves the server serving",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), trainer=TrainerState.SUCCEEDED),
        spec=make_spec(cleanupPolicy="KeepServer"),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        actions=[EnsureServer(1, 1)],
    ),
    Case(
        "active deadline fails the run and stops its trainer",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True, start=0),
        Observation(now=at(100), trainer=TrainerState.ACTIVE),
        spec=make_spec(activeDeadlineSeconds=100),
        phase=Phase.FAILED,
        reason=Reason.DEADLINE_EXCEEDED,
        actions=[DeleteTrainer(1), StopServer()],
        events=[("Warning", Reason.DEADLINE_EXCEEDED)],
    ),
    Case(
        "active deadline also ends a run still waiting for its server",
        status(Phase.STARTING_SERVER, 1, start=0),
        Observation(now=at(101)),
        spec=make_spec(activeDeadlineSeconds=100),
        phase=Phase.FAILED,
        reason=Reason.DEADLINE_EXCEEDED,
        actions=[StopServer()],
    ),
    Case(
        "suspend deletes the trainer and scales the server to zero",
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), trainer=TrainerState.ACTIVE),
        spec=make_spec(suspend=True),
        phase=Phase.SUSPENDED,
        reason=Reason.SUSPENDED,
        attempt=1,
        actions=[DeleteTrainer(1), StopServer()],
        events=[("Normal", Reason.SUSPENDED)],
    ),
    Case(
        "resume continues with the next attempt and a fresh server, without counting a failure",
        status(Phase.SUSPENDED, 1, boot_id="boot-1", reason=Reason.SUSPENDED),
        Observation(now=at(300)),
        spec=make_spec(backoffLimit=0),
        phase=Phase.STARTING_SERVER,
        reason=Reason.RESUMED,
        attempt=2,
        failed_after=0,
        actions=[Provision(), EnsureServer(2, 1)],
        events=[("Normal", Reason.RESUMED)],
    ),
    Case(
        "resuming a run created suspended starts its initializer",
        status(Phase.SUSPENDED, 0, reason=Reason.SUSPENDED, start=None, sources_ready=False),
        Observation(now=at(10)),
        phase=Phase.INITIALIZING,
        reason=Reason.RESUMED,
        attempt=0,
        actions=[Provision(), CreateInitializer()],
    ),
    Case(
        "succeeded stays succeeded whatever is observed",
        status(Phase.SUCCEEDED, 1, completed=10, reason=Reason.COMPLETED),
        Observation(now=at(20), trainer=TrainerState.FAILED, health=healthy("boot-9")),
        spec=make_spec(suspend=True),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        attempt=1,
        actions=[StopServer()],
        events=[],
    ),
    Case(
        "failed stays failed and never recreates children",
        status(Phase.FAILED, 3, completed=10, reason=Reason.BACKOFF_LIMIT_EXCEEDED),
        Observation(now=at(20), trainer=TrainerState.ABSENT),
        phase=Phase.FAILED,
        reason=Reason.BACKOFF_LIMIT_EXCEEDED,
        actions=[StopServer()],
        events=[],
    ),
    Case(
        "ttl after finishing deletes the run",
        status(Phase.SUCCEEDED, 1, completed=10, reason=Reason.COMPLETED),
        Observation(now=at(15)),
        spec=make_spec(ttlSecondsAfterFinished=5),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        actions=[StopServer(), DeleteRun()],
    ),
    Case(
        "ttl zero deletes the run as soon as it finishes",
        status(Phase.TRAINING, 1, boot_id="b", ready=True),
        Observation(now=at(15), trainer=TrainerState.SUCCEEDED),
        spec=make_spec(ttlSecondsAfterFinished=0, cleanupPolicy="KeepServer"),
        phase=Phase.SUCCEEDED,
        reason=Reason.COMPLETED,
        actions=[EnsureServer(1, 1), DeleteRun()],
    ),
    Case(
        "colocate retry creates the next trainer directly",
        status(Phase.TRAINING, 1),
        Observation(now=at(30), trainer=TrainerState.FAILED),
        spec=make_spec("colocate"),
        phase=Phase.TRAINING,
        reason=Reason.RETRYING,
        attempt=2,
        actions=[Provision(), CreateTrainer(2)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_transition(case: Case) -> None:
    before = case.status.model_dump()
    decision = decide(case.spec, case.status, case.obs, generation=1)
    assert case.status.model_dump() == before, "decide must not mutate its input"
    assert decision.status.phase == case.phase
    assert decision.status.reason == case.reason
    if case.actions:
        assert non_meta(decision) == case.actions
    if case.attempt is not None:
        assert decision.status.attempt == case.attempt
    if case.failed_after is not None:
        assert decision.status.failed_attempts == case.failed_after
    if case.events is not None:
        assert events(decision) == case.events
    if case.message_has:
        assert case.message_has in (decision.status.message or "")
    assert decision.status.observed_generation == 1


def test_fresh_server_is_recorded_with_boot_id_url_and_ready_condition() -> None:
    decision = decide(
        make_spec(),
        status(Phase.STARTING_SERVER, 2, boot_id="boot-1"),
        Observation(now=at(5), health=healthy("boot-2"), server_url="http://r-server.ns.svc:8000"),
    )
    server = decision.status.server
    assert (server.boot_id, server.ready, server.url) == ("boot-2", True, "http://r-server.ns.svc:8000")
    cond = get_condition(decision.status.conditions, "ServerReady")
    assert cond is not None and cond.status == "True" and cond.reason == Reason.SERVER_READY
    running = get_condition(decision.status.conditions, "TrainerRunning")
    assert running is not None and running.status == "True"


def test_next_attempt_keeps_the_old_boot_id_so_the_old_server_cannot_pass() -> None:
    failed = decide(
        make_spec(),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), trainer=TrainerState.FAILED),
    )
    assert failed.status.server.boot_id == "boot-1" and failed.status.server.ready is False
    again = decide(
        make_spec(),
        failed.status,
        Observation(now=at(31), health=healthy("boot-1")),
    )
    assert again.status.phase == Phase.STARTING_SERVER and not again.of_type(CreateTrainer)


def test_server_pod_trouble_is_recorded_on_the_server_and_cleared_once_gone() -> None:
    trouble = "r-server-abc: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    waiting = decide(
        make_spec(),
        status(Phase.STARTING_SERVER, 1),
        Observation(now=at(5), health=UNREACHABLE, server_message=trouble),
    )
    assert waiting.status.server.message == trouble
    assert waiting.status.phase == Phase.STARTING_SERVER, "trouble alone does not fail the attempt"
    assert waiting.status.message, "the phase message stays"
    cleared = decide(make_spec(), waiting.status, Observation(now=at(7), health=UNREACHABLE))
    assert cleared.status.server.message is None


def test_server_trouble_seen_during_training_is_recorded_and_a_new_attempt_starts_without_it() -> None:
    training = decide(
        make_spec(backoffLimit=1),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=UNREACHABLE, trainer=TrainerState.ACTIVE,
                    server_message="r-server-abc: CrashLoopBackOff: back-off 5m0s"),
    )
    assert training.status.server.message == "r-server-abc: CrashLoopBackOff: back-off 5m0s"
    retry = decide(make_spec(backoffLimit=1), training.status,
                   Observation(now=at(40), trainer=TrainerState.FAILED, server_message="still crashing"))
    assert retry.status.attempt == 2 and retry.status.server.message is None


def test_failed_attempt_count_is_written_on_the_status_in_camel_case() -> None:
    failed = decide(make_spec(backoffLimit=3), status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
                    Observation(now=at(30), trainer=TrainerState.FAILED))
    assert failed.status.to_wire()["failedAttempts"] == 1
    assert GRPORunStatus.model_validate({"failedAttempts": 2}).failed_attempts == 2


def test_training_records_adapter_and_progress_from_health() -> None:
    progress = TrainingProgress(step=7, max_steps=20, reward_mean=0.5, updated_at=at(29))
    decision = decide(
        make_spec(),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(
            now=at(30), health=healthy("boot-1", adapter=7, progress=progress), trainer=TrainerState.ACTIVE
        ),
    )
    assert decision.status.phase == Phase.TRAINING
    assert (decision.status.adapter.version, decision.status.adapter.path) == (7, "/data/adapters/r/v7")
    assert (decision.status.progress.step, decision.status.progress.max_steps) == (7, 20)
    assert decision.status.progress.reward_mean == 0.5
    assert decision.requeue_after is not None


def test_success_records_the_final_adapter() -> None:
    decision = decide(
        make_spec(),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=healthy("boot-1", adapter=20), trainer=TrainerState.SUCCEEDED),
    )
    assert decision.status.phase == Phase.SUCCEEDED
    assert decision.status.adapter.version == 20
    assert decision.status.completion_time == at(30)
    assert decision.status.server.ready is False
    succeeded = get_condition(decision.status.conditions, "Succeeded")
    assert succeeded is not None and succeeded.status == "True"


def test_progress_read_directly_wins_over_the_health_relay() -> None:
    direct = TrainingProgress(step=3, max_steps=9, updated_at=at(1))
    relayed = TrainingProgress(step=1, max_steps=9, updated_at=at(0))
    decision = decide(
        make_spec(),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(
            now=at(30),
            health=healthy("boot-1", progress=relayed),
            trainer=TrainerState.ACTIVE,
            progress=direct,
        ),
    )
    assert decision.status.progress.step == 3


def test_server_restart_during_training_is_reported_and_recorded() -> None:
    decision = decide(
        make_spec(),
        status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
        Observation(now=at(30), health=healthy("boot-9"), trainer=TrainerState.ACTIVE),
    )
    assert ("Warning", "ServerRestarted") in events(decision)
    assert decision.status.server.boot_id == "boot-9"
    assert decision.status.phase == Phase.TRAINING


def test_waiting_twice_changes_nothing_and_emits_nothing() -> None:
    spec = make_spec()
    first = decide(
        spec, status(Phase.STARTING_SERVER, 1), Observation(now=at(5), health=UNREACHABLE), generation=1
    )
    second = decide(spec, first.status, Observation(now=at(7), health=UNREACHABLE), generation=1)
    assert second.status == first.status
    assert events(second) == []
    assert second.requeue_after is not None and second.requeue_after <= 2.0


def test_condition_time_moves_only_when_its_status_flips() -> None:
    spec = make_spec()
    ready = decide(spec, status(Phase.STARTING_SERVER, 1), Observation(now=at(5), health=healthy("boot-1")))
    training = decide(
        spec, ready.status, Observation(now=at(50), health=healthy("boot-1"), trainer=TrainerState.ACTIVE)
    )
    cond = get_condition(training.status.conditions, "ServerReady")
    assert cond is not None and cond.last_transition_time == at(5)
    failed = decide(spec, training.status, Observation(now=at(80), trainer=TrainerState.FAILED))
    cond = get_condition(failed.status.conditions, "ServerReady")
    assert cond is not None and cond.status == "False" and cond.last_transition_time == at(80)


def test_set_condition_updates_reason_in_place_and_keeps_one_entry_per_type() -> None:
    conds = set_condition([], "ServerReady", "False", "ServerStarting", "a", at(0))
    conds = set_condition(conds, "ServerReady", "False", "WaitingForOldServer", "b", at(9))
    assert len(conds) == 1
    assert (conds[0].reason, conds[0].message, conds[0].last_transition_time) == (
        "WaitingForOldServer",
        "b",
        at(0),
    )


def test_conditions_serialise_in_metav1_shape() -> None:
    decision = decide(make_spec(), status(), Observation(now=at(0)), generation=4)
    wire = decision.status.to_wire()["conditions"]
    assert {c["type"] for c in wire} == {"SourcesReady", "ServerReady", "TrainerRunning"}
    for cond in wire:
        assert set(cond) == {
            "type",
            "status",
            "reason",
            "message",
            "lastTransitionTime",
            "observedGeneration",
        }
        assert cond["observedGeneration"] == 4


def test_suspend_then_resume_flips_the_suspended_condition() -> None:
    spec = make_spec(suspend=True)
    suspended = decide(
        spec,
        status(Phase.TRAINING, 1, boot_id="b1", ready=True),
        Observation(now=at(10), trainer=TrainerState.ACTIVE),
    )
    cond = get_condition(suspended.status.conditions, "Suspended")
    assert cond is not None and cond.status == "True"
    still = decide(spec, suspended.status, Observation(now=at(20), trainer=TrainerState.ABSENT))
    assert non_meta(still) == [StopServer()] and events(still) == []
    resumed = decide(make_spec(), still.status, Observation(now=at(30)))
    cond = get_condition(resumed.status.conditions, "Suspended")
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.RESUMED)
    assert resumed.status.start_time == at(30)


def test_ttl_not_yet_due_requeues_for_the_remaining_time() -> None:
    decision = decide(
        make_spec(ttlSecondsAfterFinished=60),
        status(Phase.FAILED, 1, completed=10, reason=Reason.DEADLINE_EXCEEDED),
        Observation(now=at(20)),
    )
    assert not decision.of_type(DeleteRun)
    assert decision.requeue_after == pytest.approx(50.0)


def test_terminal_run_stops_a_trainer_that_still_runs() -> None:
    decision = decide(
        make_spec(),
        status(Phase.FAILED, 2, completed=10, reason=Reason.DEADLINE_EXCEEDED),
        Observation(now=at(20), trainer=TrainerState.ACTIVE),
    )
    assert DeleteTrainer(2) in decision.actions


@pytest.mark.parametrize(
    ("phase", "suspend", "mode", "expected"),
    [
        (Phase.STARTING_SERVER, False, "server", True),
        (Phase.TRAINING, False, "server", True),
        (Phase.PENDING, False, "server", False),
        (Phase.TRAINING, True, "server", False),
        (Phase.TRAINING, False, "colocate", False),
        (Phase.SUCCEEDED, False, "server", False),
    ],
)
def test_health_is_wanted_only_while_a_server_should_be_serving(
    phase: Phase, suspend: bool, mode: str, expected: bool
) -> None:
    assert wants_health(make_spec(mode, suspend=suspend), status(phase, 1)) is expected


def test_whole_run_one_failure_then_success() -> None:
    """Walk a run the way an executor would: act, observe, decide again."""
    spec = make_spec(backoffLimit=1)
    st, phases = GRPORunStatus(), []

    def step(now: float, **obs: Any) -> Decision:
        nonlocal st
        d = decide(spec, st, Observation(now=at(now), **obs))
        st = d.status
        phases.append((d.status.phase, d.status.attempt))
        return d

    assert CreateInitializer() in step(0).actions
    step(1, initializer=TrainerState.ACTIVE)
    # The initializer's success starts attempt 1; it is not looked at again.
    assert EnsureServer(1, 1) in step(2, initializer=TrainerState.SUCCEEDED).actions
    assert st.sources.ready
    step(3, health=UNREACHABLE)
    assert CreateTrainer(1) in step(4, health=healthy("boot-1")).actions
    step(20, health=healthy("boot-1", adapter=2), trainer=TrainerState.ACTIVE)
    assert EnsureServer(2, 1) in step(30, trainer=TrainerState.FAILED).actions
    step(31, older_servers_alive=1, health=healthy("boot-1", adapter=2))
    assert not step(32, health=healthy("boot-1", adapter=2)).of_type(CreateTrainer)
    assert CreateTrainer(2) in step(35, health=healthy("boot-2")).actions
    done = step(60, health=healthy("boot-2", adapter=9), trainer=TrainerState.SUCCEEDED)
    assert done.status.phase == Phase.SUCCEEDED and done.status.attempt == 2
    assert done.status.failed_attempts == 1
    assert [p for p, _ in phases] == [
        Phase.INITIALIZING,
        Phase.INITIALIZING,
        Phase.STARTING_SERVER,
        Phase.STARTING_SERVER,
        Phase.TRAINING,
        Phase.TRAINING,
        Phase.STARTING_SERVER,
        Phase.STARTING_SERVER,
        Phase.STARTING_SERVER,
        Phase.TRAINING,
        Phase.SUCCEEDED,
    ]


def test_invalid_spec_fails_the_run_once_with_a_warning() -> None:
    from grpo_api.lifecycle import reject

    decision = reject(status(Phase.STARTING_SERVER, 1), "spec.trainer.maxSteps: bad", at(3), generation=2)
    assert (decision.status.phase, decision.status.reason) == (Phase.FAILED, Reason.INVALID_SPEC)
    assert events(decision) == [("Warning", Reason.INVALID_SPEC)]
    failed = get_condition(decision.status.conditions, "Failed")
    assert failed is not None and failed.status == "True"
    again = reject(decision.status, "spec.trainer.maxSteps: bad", at(9), generation=2)
    assert again.status == decision.status and again.actions == ()
    done = reject(status(Phase.SUCCEEDED, 1, completed=1, reason=Reason.COMPLETED), "late", at(9))
    assert done.status.phase == Phase.SUCCEEDED and done.actions == ()


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_a_permanent_trainer_failure_starts_no_other_attempt_now_or_later(mode: str) -> None:
    spec = make_spec(mode, backoffLimit=5)
    failed = Observation(now=at(30), trainer=TrainerState.FAILED, trainer_failed_permanently=True,
                         trainer_message="spec.rewards[0].function 'mine:score': cannot import module 'mine'")
    decision = decide(spec, status(Phase.TRAINING, 1, boot_id="boot-1", ready=mode == "server"), failed)
    assert (decision.status.phase, decision.status.reason) == (Phase.FAILED, Reason.INVALID_SPEC)
    assert "cannot import module 'mine'" in (decision.status.message or "")
    failed_condition = get_condition(decision.status.conditions, "Failed")
    assert failed_condition is not None and failed_condition.reason == Reason.INVALID_SPEC
    later = decide(spec, decision.status, Observation(now=at(60), trainer=TrainerState.FAILED))
    for step in (decision, later):
        assert not [a for a in step.actions if isinstance(a, CreateTrainer | Provision | CreateInitializer)]
        assert all(a.attempt == 1 for a in step.of_type(EnsureServer))
    assert later.status.attempt == 1 and later.status.failed_attempts == 1


# -------------------------------------------------------------- re-created under a dying run's name

OLD_CLAIM = "PersistentVolumeClaim r-data (of GRPORun uid old-uid, being deleted)"


def test_a_run_recreated_under_a_dying_runs_name_waits_in_pending_naming_what_it_waits_for() -> None:
    spec = make_spec()
    waiting = decide(spec, status(), Observation(now=at(1), earlier_run_children=(OLD_CLAIM,)), generation=1)
    st = waiting.status
    assert (st.phase, st.reason) == (Phase.PENDING, Reason.WAITING_FOR_OLD_CHILDREN)
    assert st.message is not None and OLD_CLAIM in st.message
    assert non_meta(waiting) == [], "nothing is created (nor adopted) while the earlier run's objects exist"
    assert [(e.type, e.reason, e.message) for e in waiting.of_type(Emit)] == [
        ("Warning", Reason.WAITING_FOR_OLD_CHILDREN, st.message)]
    cond = get_condition(st.conditions, "Reconciled")
    assert cond is not None and (cond.status, cond.reason, cond.message) == ("False", "WaitingForOldChildren",
                                                                              st.message)
    assert waiting.requeue_after is not None and waiting.requeue_after <= 2.0, "it looks again by itself"
    assert st.start_time is None, "the run has not started: its active deadline has not either"

    again = decide(spec, st, Observation(now=at(3), earlier_run_children=(OLD_CLAIM,)), generation=1)
    assert again.status == st and events(again) == [], "one event per wait, not one per look"

    gone = decide(spec, st, Observation(now=at(5)), generation=1)
    assert (gone.status.phase, gone.status.reason) == (Phase.INITIALIZING, Reason.CREATED)
    assert Provision() in gone.actions and CreateInitializer() in gone.actions
    cond = get_condition(gone.status.conditions, "Reconciled")
    assert cond is not None and cond.status == "True"


def test_a_long_list_of_leftovers_names_the_first_few_and_counts_the_rest() -> None:
    left = tuple(f"Pod r-server-{i} (being deleted)" for i in range(8))
    waiting = decide(make_spec(), status(), Observation(now=at(1), earlier_run_children=left))
    message = waiting.status.message or ""
    assert "r-server-4" in message and "r-server-5" not in message and message.endswith("and 3 more")


def test_an_earlier_runs_object_found_on_create_waits_as_if_it_had_been_seen() -> None:
    spec = make_spec()
    found = held_by_earlier_run(spec, status(), Observation(now=at(1)), OLD_CLAIM, generation=1)
    seen = decide(spec, status(), Observation(now=at(1), earlier_run_children=(OLD_CLAIM,)), generation=1)
    assert found == seen


def test_an_earlier_runs_object_found_mid_run_keeps_the_phase_and_says_so_once() -> None:
    spec = make_spec()
    job = "Job r-trainer-2 (of GRPORun uid old-uid, being deleted)"
    before = status(Phase.STARTING_SERVER, 2, reason=Reason.SERVER_STARTING)
    held = held_by_earlier_run(spec, before, Observation(now=at(5)), job, generation=1)
    assert (held.status.phase, held.status.reason, held.status.attempt) == (
        Phase.STARTING_SERVER, Reason.SERVER_STARTING, 2)
    assert [e.reason for e in held.of_type(Emit)] == [Reason.WAITING_FOR_OLD_CHILDREN]
    assert job in held.of_type(Emit)[0].message
    cond = get_condition(held.status.conditions, "Reconciled")
    assert cond is not None and (cond.status, cond.reason) == ("False", "WaitingForOldChildren") and job in cond.message
    assert held.requeue_after is not None and held.requeue_after <= 2.0
    again = held_by_earlier_run(spec, held.status, Observation(now=at(7)), job, generation=1)
    assert events(again) == [] and again.status == held.status


def test_an_earlier_runs_object_does_not_hold_a_run_past_its_active_deadline() -> None:
    spec = make_spec(activeDeadlineSeconds=10)
    held = held_by_earlier_run(spec, status(Phase.STARTING_SERVER, 2), Observation(now=at(30)), OLD_CLAIM)
    assert (held.status.phase, held.status.reason) == (Phase.FAILED, Reason.DEADLINE_EXCEEDED)
    assert events(held) == [("Warning", Reason.DEADLINE_EXCEEDED)]
