"""Preemption in the shared lifecycle: an attempt whose trainer was preempted or evicted (a pod's
DisruptionTarget) starts the next one, with a fresh server, without counting against backoffLimit;
the status counts it, an event says it, and runPolicy.preemptionLimit and activeDeadlineSeconds bound a
loop of them."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_api.lifecycle import (
    CreateTrainer,
    Decision,
    EnsureServer,
    Observation,
    Provision,
    TrainerState,
    decide,
    get_condition,
)
from grpo_api.models import ConditionType, GRPORunSpec, GRPORunStatus, Phase, Reason
from tests.fixtures.lifecycle_decisions import at, events, healthy, make_spec, non_meta, status

EVICTED = "pod r-trainer-1-abcde: DisruptionTarget EvictionByEvictionAPI: Eviction API: evicting"


def training(attempt: int = 1, failed: int = 0, preemptions: int = 0, mode: str = "server") -> GRPORunStatus:
    st = status(Phase.TRAINING, attempt, boot_id=f"boot-{attempt}", ready=mode == "server",
                reason=Reason.TRAINER_RUNNING, failed=failed)
    st.preemptions = preemptions
    return st


def preempted(now: float = 50, message: str = EVICTED, **obs: Any) -> Observation:
    return Observation(now=at(now), trainer=TrainerState.FAILED, trainer_preempted=True, trainer_message=message, **obs)


@pytest.mark.parametrize("backoff_limit", [0, 2])
def test_a_preempted_trainer_starts_the_next_attempt_with_a_fresh_server_without_counting_it(
    backoff_limit: int,
) -> None:
    decision = decide(make_spec(backoffLimit=backoff_limit), training(failed=0), preempted(health=healthy("boot-1")))
    st = decision.status
    assert (st.phase, st.reason, st.attempt) == (Phase.STARTING_SERVER, Reason.PREEMPTED, 2)
    assert st.failed_attempts == 0 and st.preemptions == 1, "backoffLimit 0 would have failed a counted attempt"
    assert non_meta(decision) == [Provision(), EnsureServer(2, 1)], "a fresh server first; no trainer yet"
    assert events(decision) == [("Warning", Reason.PREEMPTED)]
    assert EVICTED in (st.message or "") and "not counted against backoffLimit (preemptions: 1)" in (st.message or "")
    trainer_running = get_condition(st.conditions, ConditionType.TRAINER_RUNNING)
    assert trainer_running is not None and (trainer_running.status, trainer_running.reason) == ("False", "Preempted")
    assert st.server.boot_id == "boot-1", "the old boot id stays recorded: the next server must be another"


def test_a_plain_failure_still_counts_against_backoff_limit() -> None:
    decision = decide(make_spec(backoffLimit=0), training(),
                      Observation(now=at(50), trainer=TrainerState.FAILED, trainer_message="exit code 1 (Error)"))
    st = decision.status
    assert (st.phase, st.reason) == (Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED)
    assert st.failed_attempts == 1 and st.preemptions == 0


def test_a_preempted_colocate_trainer_starts_the_next_attempts_trainer() -> None:
    decision = decide(make_spec("colocate", backoffLimit=0), training(mode="colocate"), preempted())
    st = decision.status
    assert (st.phase, st.reason, st.attempt, st.failed_attempts, st.preemptions) == (
        Phase.TRAINING, Reason.PREEMPTED, 2, 0, 1)
    assert CreateTrainer(2) in decision.actions


def test_a_configuration_problem_wins_over_a_preemption() -> None:
    decision = decide(make_spec(backoffLimit=3), training(),
                      preempted(trainer_failed_permanently=True, message="spec.dataset: empty"))
    st = decision.status
    assert (st.phase, st.reason, st.failed_attempts, st.preemptions) == (Phase.FAILED, Reason.INVALID_SPEC, 1, 0)


def test_preemptions_past_the_limit_count_as_failed_attempts_so_a_loop_of_them_ends() -> None:
    spec = make_spec(backoffLimit=1, preemptionLimit=1)
    first = decide(spec, training(), preempted())
    assert (first.status.attempt, first.status.failed_attempts, first.status.preemptions) == (2, 0, 1)
    assert "preemptions: 1 of 1" in (first.status.message or "")

    second = decide(spec, training(2, preemptions=1), preempted(60))
    st = second.status
    assert (st.phase, st.reason, st.attempt) == (Phase.STARTING_SERVER, Reason.RETRYING, 3)
    assert st.failed_attempts == 1 and st.preemptions == 2
    assert ("Warning", Reason.TRAINER_FAILED) in events(second)
    assert ("Warning", Reason.PREEMPTED) not in events(second)

    third = decide(spec, training(3, failed=1, preemptions=2), preempted(70))
    st = third.status
    assert (st.phase, st.reason, st.failed_attempts, st.preemptions) == (
        Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED, 2, 3)
    assert "past runPolicy.preemptionLimit 1" in (st.message or ""), st.message


def test_a_preemption_limit_of_zero_counts_every_preemption() -> None:
    decision = decide(make_spec(backoffLimit=0, preemptionLimit=0), training(), preempted())
    assert (decision.status.phase, decision.status.failed_attempts, decision.status.preemptions) == (
        Phase.FAILED, 1, 1)


def test_the_active_deadline_ends_an_endless_preemption_loop() -> None:
    spec = make_spec(backoffLimit=0, activeDeadlineSeconds=100)
    decision = decide(spec, training(7, preemptions=6), preempted(150))
    st = decision.status
    assert (st.phase, st.reason, st.preemptions) == (Phase.FAILED, Reason.DEADLINE_EXCEEDED, 6)


def test_a_run_preempted_twice_resumes_each_time_and_succeeds_with_no_failed_attempt() -> None:
    """Walk a run the way an executor would: every attempt after a preemption waits for a server with a new boot
    id and no adapter, then its trainer resumes; the run ends with its preemptions counted and none failed."""
    spec: GRPORunSpec = make_spec(backoffLimit=0)
    st = status(Phase.STARTING_SERVER, 1)
    seen: list[Decision] = []

    def step(now: float, **obs: Any) -> Decision:
        nonlocal st
        d = decide(spec, st, Observation(now=at(now), **obs))
        st = d.status
        seen.append(d)
        return d

    assert CreateTrainer(1) in step(1, health=healthy("boot-1")).actions
    step(10, health=healthy("boot-1", adapter=3), trainer=TrainerState.ACTIVE)
    assert EnsureServer(2, 1) in step(20, trainer=TrainerState.FAILED, trainer_preempted=True,
                                      trainer_message=EVICTED).actions
    assert not step(21, health=healthy("boot-1", adapter=3)).of_type(CreateTrainer), "the old server cannot pass"
    assert CreateTrainer(2) in step(25, health=healthy("boot-2")).actions
    step(30, trainer=TrainerState.FAILED, trainer_preempted=True, trainer_message="pod r-trainer-2-x: "
         "DisruptionTarget PreemptionByScheduler: default-scheduler: preempting to accommodate a higher priority pod")
    assert CreateTrainer(3) in step(35, health=healthy("boot-3")).actions
    done = step(60, health=healthy("boot-3", adapter=9), trainer=TrainerState.SUCCEEDED)
    assert (done.status.phase, done.status.attempt) == (Phase.SUCCEEDED, 3)
    assert done.status.failed_attempts == 0 and done.status.preemptions == 2
    assert [e for d in seen for e in events(d) if e[1] == Reason.PREEMPTED] == [("Warning", Reason.PREEMPTED)] * 2
    assert done.status.to_wire()["preemptions"] == 2 and done.status.to_wire()["failedAttempts"] == 0
