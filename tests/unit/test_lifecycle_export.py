"""The export step in the lifecycle (spec.output): after the trainer succeeded the run exports, records where
the result went, and fails as ExportFailed (no other attempt, nothing deleted) when the export does."""

from __future__ import annotations

from typing import Any

from grpo_api.export_protocol import ExportResult
from grpo_api.lifecycle import (
    CreateExporter,
    CreateTrainer,
    DeleteExporter,
    EnsureServer,
    Observation,
    StopServer,
    TrainerState,
    decide,
    get_condition,
)
from grpo_api.models import GRPORunSpec, Phase, Reason
from tests.fixtures.lifecycle_decisions import at, events, healthy, make_spec, status

RESULT = ExportResult(uri="oci://registry.example.com/team/model@sha256:" + "a" * 64, form="adapter",
                      digest="sha256:" + "a" * 64, size=1234, files=3, source="/data/adapters/run/v20")


def with_output(**policy: Any) -> GRPORunSpec:
    spec = make_spec(**policy).model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["output"] = {"destination": "oci://registry.example.com/team/model:v1"}
    return GRPORunSpec.model_validate(spec)


def exporting() -> Any:
    trained = decide(with_output(), status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
                     Observation(now=at(30), health=healthy("boot-1", adapter=20), trainer=TrainerState.SUCCEEDED))
    return trained


def test_a_trainer_that_succeeded_hands_over_to_the_export_step_and_stops_the_server() -> None:
    decision = exporting()
    assert decision.status.phase == Phase.EXPORTING and decision.status.reason == Reason.EXPORTING
    assert decision.of_type(CreateExporter) and decision.of_type(StopServer)
    assert not decision.of_type(EnsureServer) and not decision.of_type(CreateTrainer)
    assert "oci://registry.example.com/team/model:v1" in (decision.status.message or "")
    assert decision.status.completion_time is None
    assert ("Normal", Reason.EXPORTING) in events(decision)


def test_without_output_the_run_succeeds_as_before() -> None:
    decision = decide(make_spec(), status(Phase.TRAINING, 1, boot_id="boot-1", ready=True),
                      Observation(now=at(30), health=healthy("boot-1", adapter=20), trainer=TrainerState.SUCCEEDED))
    assert decision.status.phase == Phase.SUCCEEDED and not decision.of_type(CreateExporter)


def test_the_export_step_is_asked_for_again_while_it_runs() -> None:
    running = decide(with_output(), exporting().status,
                     Observation(now=at(40), exporter=TrainerState.ACTIVE, exporter_message="pod p: Pending"))
    assert running.status.phase == Phase.EXPORTING and running.of_type(CreateExporter)
    assert "Pending" in (running.status.message or "") and running.requeue_after is not None
    assert not events(running)


def test_a_successful_export_records_where_the_result_went() -> None:
    done = decide(with_output(), exporting().status,
                  Observation(now=at(50), exporter=TrainerState.SUCCEEDED, export_result=RESULT))
    assert done.status.phase == Phase.SUCCEEDED and done.status.reason == Reason.COMPLETED
    output = done.status.output
    assert output is not None
    assert (output.uri, output.digest, output.size, output.files) == (RESULT.uri, RESULT.digest, 1234, 3)
    assert output.completed_at == at(50) and done.status.completion_time == at(50)
    assert RESULT.uri in (done.status.message or "")
    wire = done.status.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert wire["output"]["uri"] == RESULT.uri and wire["output"]["completedAt"]
    succeeded = get_condition(done.status.conditions, "Succeeded")
    assert succeeded is not None and succeeded.status == "True"


def test_a_failed_export_fails_the_run_without_another_attempt_and_says_the_adapters_stay() -> None:
    failed = decide(with_output(), exporting().status,
                    Observation(now=at(50), exporter=TrainerState.FAILED,
                                exporter_message="export failed: the registry refused the push: Unauthorized"))
    assert failed.status.phase == Phase.FAILED and failed.status.reason == Reason.EXPORT_FAILED
    message = failed.status.message or ""
    assert "Unauthorized" in message and "adapters stay on the run's volume" in message
    assert "/data/adapters" in message or "v20" in message
    assert failed.status.attempt == 1 and failed.status.failed_attempts == 0
    assert not failed.of_type(CreateTrainer) and not failed.of_type(EnsureServer)
    assert ("Warning", Reason.EXPORT_FAILED) in events(failed)
    assert failed.status.output is None
    # Terminal stays terminal: no export step again.
    later = decide(with_output(), failed.status, Observation(now=at(60)))
    assert later.status.phase == Phase.FAILED and not later.of_type(CreateExporter)


def test_an_export_that_succeeded_without_a_result_line_fails_the_run() -> None:
    failed = decide(with_output(), exporting().status, Observation(now=at(50), exporter=TrainerState.SUCCEEDED))
    assert failed.status.reason == Reason.EXPORT_FAILED and "without a result line" in (failed.status.message or "")


def test_suspend_waits_for_the_export_step_to_end() -> None:
    spec = with_output(suspend=True)
    still = decide(spec, exporting().status, Observation(now=at(40), exporter=TrainerState.ACTIVE))
    assert still.status.phase == Phase.EXPORTING and still.of_type(CreateExporter)


def test_the_deadline_ends_an_export_that_takes_too_long() -> None:
    spec = with_output(activeDeadlineSeconds=45)
    current = exporting().status
    current.start_time = at(0)
    ended = decide(spec, current, Observation(now=at(50), exporter=TrainerState.ACTIVE))
    assert ended.status.phase == Phase.FAILED and ended.status.reason == Reason.DEADLINE_EXCEEDED
    assert ended.of_type(DeleteExporter)  # nothing lands after the run ended
