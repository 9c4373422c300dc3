"""A queue's admission in the shared lifecycle (Kueue, for a run labelled kueue.x-k8s.io/queue-name): the run waits
suspended and asks for nothing until admitted; an admission taken back mid-run suspends it (its pods deleted, its
checkpoint kept), counts as a preemption and not against backoffLimit, and it resumes with a new attempt once
admitted again; a run no queue admits decides as before."""

from __future__ import annotations

from grpo_api.lifecycle import (
    AdmissionState,
    CreateExporter,
    CreateInitializer,
    DeleteServer,
    DeleteTrainer,
    EnsureServer,
    Observation,
    Provision,
    QueueAdmission,
    StopServer,
    TrainerState,
    decide,
    get_condition,
)
from grpo_api.models import ConditionType, Phase, Reason
from tests.fixtures.lifecycle_decisions import at, events, healthy, make_spec, non_meta, status
from tests.unit.test_lifecycle_export import with_output

WAITING = QueueAdmission(AdmissionState.WAITING, "couldn't assign flavors to pod set trainer: insufficient quota")
ADMITTED = QueueAdmission(AdmissionState.ADMITTED, "ClusterQueue gpus")
PREEMPTED = QueueAdmission(AdmissionState.EVICTED, "Preempted: Preempted to accommodate a higher priority workload")


def queued(admission: QueueAdmission, now: float = 10, **obs: object) -> Observation:
    return Observation(now=at(now), admission=admission, **obs)  # type: ignore[arg-type]


def test_a_queued_run_waits_suspended_and_asks_for_nothing_until_admitted() -> None:
    decision = decide(make_spec(), status(), queued(WAITING))
    st = decision.status
    assert (st.phase, st.reason) == (Phase.SUSPENDED, Reason.QUEUED)
    assert "waiting for Kueue to admit it: couldn't assign flavors" in (st.message or "")
    assert non_meta(decision) == [DeleteServer()], "no run-config, claim, initializer, server or trainer"
    assert decision.requeue_after == 2.0, "the queue's answer is looked at again soon"
    suspended = get_condition(st.conditions, ConditionType.SUSPENDED)
    assert suspended is not None and (suspended.status, suspended.reason) == ("True", Reason.QUEUED)
    assert st.start_time is None, "activeDeadlineSeconds counts from the admission, as a Job's from its resume"


def test_a_label_naming_a_missing_queue_says_so_in_its_reason() -> None:
    missing = QueueAdmission(AdmissionState.WAITING, "LocalQueue team-a (label kueue.x-k8s.io/queue-name) does "
                             "not exist in namespace ns", Reason.QUEUE_NOT_FOUND)
    decision = decide(make_spec(), status(), queued(missing))
    assert (decision.status.phase, decision.status.reason) == (Phase.SUSPENDED, Reason.QUEUE_NOT_FOUND)
    assert "kueue.x-k8s.io/queue-name" in (decision.status.message or "")
    assert events(decision) == [("Warning", Reason.QUEUE_NOT_FOUND)]


def test_an_admitted_run_starts_as_a_new_one_does() -> None:
    held = decide(make_spec(), status(), queued(WAITING)).status
    decision = decide(make_spec(activeDeadlineSeconds=60), held, queued(ADMITTED, now=500))
    st = decision.status
    assert (st.phase, st.reason) == (Phase.INITIALIZING, Reason.ADMITTED)
    assert "admitted by Kueue (ClusterQueue gpus)" in (st.message or "")
    assert non_meta(decision) == [Provision(), CreateInitializer()]
    assert st.start_time == at(500)


def test_an_eviction_mid_training_suspends_the_run_as_a_preemption_not_a_failure() -> None:
    training = status(Phase.TRAINING, 1, boot_id="boot-1", ready=True, reason=Reason.TRAINER_RUNNING)
    decision = decide(make_spec(backoffLimit=0), training, queued(PREEMPTED, trainer=TrainerState.ACTIVE))
    st = decision.status
    assert (st.phase, st.reason, st.attempt, st.failed_attempts, st.preemptions) == (
        Phase.SUSPENDED, Reason.EVICTED, 1, 0, 1)
    assert non_meta(decision) == [DeleteTrainer(1), DeleteServer()], "its pods go; the volume stays"
    assert events(decision) == [("Warning", Reason.EVICTED)]
    message = st.message or ""
    assert "attempt 1 evicted by Kueue: Preempted" in message and "checkpoint kept" in message
    assert "not counted against backoffLimit (preemptions: 1)" in message

    again = decide(make_spec(backoffLimit=0), st, queued(PREEMPTED, now=20))
    assert (again.status.phase, again.status.reason, again.status.preemptions) == (Phase.SUSPENDED, Reason.EVICTED, 1)
    assert events(again) == [], "one eviction, one event and one count"

    resumed = decide(make_spec(backoffLimit=0), again.status, queued(ADMITTED, now=30))
    rs = resumed.status
    assert (rs.phase, rs.reason, rs.attempt, rs.failed_attempts) == (Phase.STARTING_SERVER, Reason.ADMITTED, 2, 0)
    assert non_meta(resumed) == [Provision(), EnsureServer(2, 1)], "a fresh server; the trainer resumes later"


def test_an_eviction_while_the_server_starts_counts_once_too() -> None:
    starting = status(Phase.STARTING_SERVER, 3, reason=Reason.SERVER_STARTING)
    decision = decide(make_spec(), starting, queued(PREEMPTED, health=healthy("boot-3")))
    assert (decision.status.phase, decision.status.reason, decision.status.preemptions) == (
        Phase.SUSPENDED, Reason.EVICTED, 1)


def test_evictions_past_the_preemption_limit_count_against_backoff_limit() -> None:
    training = status(Phase.TRAINING, 1, boot_id="boot-1", ready=True, reason=Reason.TRAINER_RUNNING)
    decision = decide(make_spec(backoffLimit=0, preemptionLimit=0), training,
                      queued(PREEMPTED, trainer=TrainerState.ACTIVE))
    st = decision.status
    assert (st.phase, st.reason, st.failed_attempts, st.preemptions) == (
        Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED, 1, 1)
    assert "past runPolicy.preemptionLimit 0" in (st.message or "")
    assert DeleteTrainer(1) in decision.actions

    within = decide(make_spec(backoffLimit=1, preemptionLimit=0), training, queued(PREEMPTED))
    assert (within.status.phase, within.status.reason, within.status.failed_attempts) == (
        Phase.SUSPENDED, Reason.EVICTED, 1)
    assert "counted as failed attempt 1 of backoffLimit 1" in (within.status.message or "")


def test_an_eviction_before_the_first_attempt_is_not_counted() -> None:
    initializing = status(Phase.INITIALIZING, 0, reason=Reason.FETCHING_SOURCES)
    decision = decide(make_spec(), initializing, queued(PREEMPTED))
    assert (decision.status.phase, decision.status.reason, decision.status.preemptions) == (
        Phase.SUSPENDED, Reason.EVICTED, 0)


def test_the_users_suspend_wins_over_the_queue() -> None:
    held = decide(make_spec(), status(), queued(WAITING)).status
    decision = decide(make_spec(suspend=True), held, queued(ADMITTED))
    assert (decision.status.phase, decision.status.reason) == (Phase.SUSPENDED, Reason.SUSPENDED)
    assert non_meta(decision) == [DeleteServer()]


def test_the_export_step_runs_to_its_end_whatever_the_queue_says() -> None:
    decision = decide(with_output(), status(Phase.EXPORTING, 1, reason=Reason.EXPORTING), queued(PREEMPTED))
    assert decision.status.phase == Phase.EXPORTING
    assert CreateExporter() in decision.actions


def test_a_run_no_queue_admits_suspends_as_before() -> None:
    training = status(Phase.TRAINING, 1, boot_id="boot-1", ready=True, reason=Reason.TRAINER_RUNNING)
    decision = decide(make_spec(suspend=True), training, Observation(now=at(10), trainer=TrainerState.ACTIVE))
    assert non_meta(decision) == [DeleteTrainer(1), StopServer()], "without a queue the server only stops"
