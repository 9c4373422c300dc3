"""The lifecycle's answers to trouble: one server decision per call, children lost or missing mid-attempt,
a server that stops answering mid-attempt, and decisions an executor could not carry out."""

from __future__ import annotations

import pytest

from grpo_api.lifecycle import (
    SERVER_HEALTH_GRACE_SECONDS,
    Decision,
    DeleteServer,
    DeleteTrainer,
    EnsureServer,
    Observation,
    Provision,
    StopServer,
    TrainerState,
    decide,
    get_condition,
    reject,
    troubled,
)
from grpo_api.models import ConditionType, GRPORunStatus, Phase, Reason
from tests.fixtures.lifecycle_decisions import UNREACHABLE, at, events, healthy, make_spec, non_meta, status


def server_actions(decision: Decision) -> list[object]:
    return [a for a in decision.actions if isinstance(a, EnsureServer | StopServer | DeleteServer)]


@pytest.mark.parametrize(
    ("trainer", "permanent"),
    [(TrainerState.FAILED, False), (TrainerState.FAILED, True), (TrainerState.SUCCEEDED, False),
     (TrainerState.ABSENT, False)],
)
def test_a_decision_carries_at_most_one_action_about_the_server(trainer: TrainerState, permanent: bool) -> None:
    st = status(Phase.TRAINING, attempt=1, boot_id="boot-1", ready=True)
    decision = decide(make_spec(backoffLimit=3), st, Observation(
        now=at(50), health=healthy("boot-1"), trainer=trainer, trainer_failed_permanently=permanent))
    assert len(server_actions(decision)) == 1, decision.actions


def test_a_failed_trainer_asks_only_for_the_next_attempts_server() -> None:
    st = status(Phase.TRAINING, attempt=1, boot_id="boot-1", ready=True)
    decision = decide(make_spec(backoffLimit=3), st, Observation(now=at(50), health=healthy("boot-1"),
                                                                 trainer=TrainerState.FAILED))
    assert server_actions(decision) == [EnsureServer(2, 1)]


# ------------------------------------------------------------------------------------- children


def test_a_lost_child_ends_the_attempt_stops_its_trainer_and_the_next_attempt_provisions_afresh() -> None:
    st = status(Phase.TRAINING, attempt=1, boot_id="boot-1", ready=True)
    decision = decide(make_spec(backoffLimit=3), st, Observation(
        now=at(50), health=healthy("boot-1"), trainer=TrainerState.ACTIVE, lost_children=("token Secret r-token",)))
    assert decision.status.phase == Phase.STARTING_SERVER and decision.status.attempt == 2
    assert decision.status.failed_attempts == 1
    assert non_meta(decision) == [DeleteTrainer(1), Provision(), EnsureServer(2, 1)]
    assert ("Warning", Reason.CHILD_DELETED) in events(decision)
    assert "token Secret r-token" in next(e.message for e in decision.actions
                                          if getattr(e, "reason", None) == Reason.CHILD_DELETED)


def test_a_lost_child_with_no_retries_left_fails_the_run_naming_it() -> None:
    st = status(Phase.STARTING_SERVER, attempt=1)
    decision = decide(make_spec(backoffLimit=0), st, Observation(
        now=at(5), health=UNREACHABLE, lost_children=("run-config ConfigMap r-config",)))
    assert decision.status.phase == Phase.FAILED and decision.status.reason == Reason.CHILD_DELETED
    assert "run-config ConfigMap r-config" in (decision.status.message or "")


def test_a_missing_child_is_provisioned_again_with_a_warning_and_the_attempt_goes_on() -> None:
    st = status(Phase.TRAINING, attempt=1, boot_id="boot-1", ready=True)
    decision = decide(make_spec(), st, Observation(
        now=at(50), health=healthy("boot-1"), trainer=TrainerState.ACTIVE, missing_children=("Service r-server",)))
    assert decision.status.phase == Phase.TRAINING and decision.status.attempt == 1
    assert Provision() in decision.actions and EnsureServer(1, 1) in decision.actions
    assert events(decision) == [("Warning", Reason.CHILD_RESTORED)]


# ------------------------------------------------------------------------------ server health


def training(ready: bool = True, unhealthy_since: float | None = None) -> GRPORunStatus:
    st = status(Phase.TRAINING, attempt=1, boot_id="boot-1", ready=ready)
    st.server.unhealthy_since = at(unhealthy_since) if unhealthy_since is not None else None
    return st


def test_server_ready_stays_true_through_a_short_outage_and_turns_false_after_the_grace_period() -> None:
    spec = make_spec()
    first = decide(spec, training(), Observation(now=at(100), health=UNREACHABLE, trainer=TrainerState.ACTIVE))
    assert first.status.server.ready is True and first.status.server.unhealthy_since == at(100)
    assert get_condition(first.status.conditions, ConditionType.SERVER_READY).status == "True"  # type: ignore[union-attr]

    later = decide(spec, first.status, Observation(now=at(100 + SERVER_HEALTH_GRACE_SECONDS), health=UNREACHABLE,
                                                   trainer=TrainerState.ACTIVE))
    assert later.status.server.ready is False and later.status.phase == Phase.TRAINING
    cond = get_condition(later.status.conditions, ConditionType.SERVER_READY)
    assert cond is not None and cond.status == "False" and cond.reason == Reason.SERVER_UNHEALTHY
    assert "connection refused" in cond.message
    assert ("Warning", Reason.SERVER_UNHEALTHY) in events(later)

    again = decide(spec, later.status, Observation(now=at(200), health=UNREACHABLE, trainer=TrainerState.ACTIVE))
    assert events(again) == [], "one event per outage"

    back = decide(spec, again.status, Observation(now=at(210), health=healthy("boot-1"), trainer=TrainerState.ACTIVE))
    assert back.status.server.ready is True and back.status.server.unhealthy_since is None
    assert get_condition(back.status.conditions, ConditionType.SERVER_READY).status == "True"  # type: ignore[union-attr]
    assert ("Normal", Reason.SERVER_READY) in events(back)


def test_a_healthy_answer_within_the_grace_period_clears_the_outage() -> None:
    spec = make_spec()
    blip = decide(spec, training(unhealthy_since=90), Observation(now=at(100), health=healthy("boot-1"),
                                                                  trainer=TrainerState.ACTIVE))
    assert blip.status.server.ready is True and blip.status.server.unhealthy_since is None
    assert events(blip) == []


def test_a_new_attempt_starts_without_the_old_servers_outage() -> None:
    st = training(ready=False, unhealthy_since=0)
    decision = decide(make_spec(backoffLimit=2), st, Observation(now=at(100), health=UNREACHABLE,
                                                                 trainer=TrainerState.FAILED))
    assert decision.status.attempt == 2 and decision.status.server.unhealthy_since is None


# ------------------------------------------------------------------------------------ troubled


def test_troubled_keeps_the_status_and_says_why_in_the_reconciled_condition() -> None:
    st = status(Phase.STARTING_SERVER, attempt=1)
    decision = troubled(make_spec(), st, Reason.WAITING_FOR_OLD_CHILDREN, "ConfigMap r-config is going", at(5))
    assert decision.status.phase == Phase.STARTING_SERVER and decision.actions == ()
    cond = get_condition(decision.status.conditions, ConditionType.RECONCILED)
    assert cond is not None and (cond.status, cond.reason) == ("False", Reason.WAITING_FOR_OLD_CHILDREN)
    # The next decision that is carried out turns it back to True.
    after = decide(make_spec(), decision.status, Observation(now=at(6), health=UNREACHABLE))
    cond = get_condition(after.status.conditions, ConditionType.RECONCILED)
    assert cond is not None and cond.status == "True"


def test_troubled_fails_a_run_whose_deadline_passed_whatever_went_wrong() -> None:
    st = status(Phase.TRAINING, attempt=1, start=0)
    decision = troubled(make_spec(activeDeadlineSeconds=10), st, Reason.RECONCILE_ERROR, "boom", at(11))
    assert decision.status.phase == Phase.FAILED and decision.status.reason == Reason.DEADLINE_EXCEEDED
    assert "boom" in (decision.status.message or "")
    assert events(decision) == [("Warning", Reason.DEADLINE_EXCEEDED)]


def test_troubled_without_a_usable_spec_and_a_fresh_run_still_writes_a_phase() -> None:
    decision = troubled(None, status(), Reason.RECONCILE_ERROR, "boom", at(1))
    assert decision.status.phase == Phase.PENDING
    assert decision.status.to_wire()["phase"] == "Pending"


def test_reject_takes_the_reason_it_is_given() -> None:
    decision = reject(status(Phase.INITIALIZING), "quota exceeded", at(1), reason=Reason.CHILD_REJECTED)
    assert (decision.status.phase, decision.status.reason) == (Phase.FAILED, Reason.CHILD_REJECTED)
    assert events(decision) == [("Warning", Reason.CHILD_REJECTED)]
