"""Pure parts of the operator that need no cluster: child summaries, status patches, RBAC, CLI flags,
per-run metric series."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY, generate_latest

from grpo_api.lifecycle import TrainerState
from grpo_operator import builders, children, metrics, rbac
from grpo_operator.cli import operator
from grpo_operator.reconcile import merge_patch, server_trouble


def owned(uid: str = "run-uid") -> list[dict[str, Any]]:
    return [{"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": "r", "uid": uid, "controller": True}]


def job(conditions: list[dict[str, str]], uid: str = "run-uid") -> dict[str, Any]:
    return {
        "metadata": {"name": "r-trainer-2", "labels": {"grpo.dev/attempt": "2"}, "ownerReferences": owned(uid)},
        "status": {"conditions": conditions},
    }


@pytest.mark.parametrize(
    ("conditions", "state"),
    [
        ([], TrainerState.ACTIVE),
        ([{"type": "FailureTarget", "status": "True"}], TrainerState.ACTIVE),
        ([{"type": "SuccessCriteriaMet", "status": "True"}], TrainerState.ACTIVE),
        ([{"type": "Complete", "status": "True"}], TrainerState.SUCCEEDED),
        ([{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "1 failed"}],
         TrainerState.FAILED),
        ([{"type": "Failed", "status": "False"}], TrainerState.ACTIVE),
    ],
)
def test_trainer_counts_as_finished_only_once_the_job_controller_says_so(
    conditions: list[dict[str, str]], state: TrainerState
) -> None:
    info = children.job_info(job(conditions))
    assert info.state == state and info.attempt == 2 and info.owner == "run-uid"


def test_failed_job_message_carries_reason_and_message() -> None:
    info = children.job_info(job([{"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                                   "message": "too slow"}]))
    assert info.message == "DeadlineExceeded: too slow"


def test_pod_summary_reads_attempt_readiness_and_termination() -> None:
    pod = children.pod_info({
        "metadata": {"name": "p", "annotations": {"grpo.dev/attempt": "3"}, "creationTimestamp": "2026-01-01T00:00:00Z",
                     "deletionTimestamp": "2026-01-01T00:01:00Z"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    })
    assert (pod.attempt, pod.ready, pod.terminating) == (3, True, True)
    assert pod.created is not None and pod.created.year == 2026


def test_snapshot_ignores_children_of_an_earlier_run_with_the_same_name() -> None:
    mine = children.job_info(job([], uid="new"))
    stale = children.job_info(job([], uid="old"))
    deployment = children.deployment_info({
        "metadata": {"name": "r-server", "ownerReferences": owned("old")},
        "spec": {"replicas": 1, "template": {"metadata": {"annotations": {"grpo.dev/attempt": "1"}}}},
    })
    old_pod = children.pod_info({"metadata": {"name": "p", "annotations": {"grpo.dev/attempt": "1"},
                                              "labels": {"grpo.dev/component": "server"}}})
    snap = children.snapshot("new", [old_pod], [deployment], [mine, stale])
    assert snap.deployment is None
    assert snap.jobs == (mine,)
    # A leftover server pod still blocks a fresh server, whoever owned it.
    assert snap.older_server_pods(1) == [] and len(snap.older_server_pods(2)) == 1


def test_snapshot_names_what_an_earlier_run_of_the_same_name_left() -> None:
    stale = children.job_info(job([], uid="old"))
    claim = children.object_info("PersistentVolumeClaim", {"metadata": {
        "name": "r-data", "ownerReferences": owned("old"), "deletionTimestamp": "2026-01-01T00:01:00Z"}})
    mine = children.object_info("ConfigMap", {"metadata": {"name": "r-config", "ownerReferences": owned("new")}})
    unowned = children.object_info("ConfigMap", {"metadata": {"name": "r-rewards"}})
    old_pod = children.pod_info({"metadata": {"name": "r-init-x", "labels": {
        "grpo.dev/component": "initializer", "job-name": "r-init"}, "deletionTimestamp": "2026-01-01T00:01:00Z"}})
    snap = children.snapshot("new", [old_pod], [], [stale], [claim, mine, unowned])
    assert snap.left_by_earlier_run == (
        "Job r-trainer-2 (of GRPORun uid old)",
        "PersistentVolumeClaim r-data (of GRPORun uid old, being deleted)",
    ), "an object no GRPORun owns is no earlier run's (creating over it fails the run: ChildConflict)"
    assert snap.stray_pods() == ["Pod r-init-x (being deleted)"]
    assert children.snapshot("new", [old_pod], [], [children.job_info(
        {**job([], uid="new"), "metadata": {"name": "r-init", "ownerReferences": owned("new")}})]).stray_pods() == []


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        ({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                          "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]},
         "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),
        ({"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]},
         "ImagePullBackOff: no such image"),
        ({"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}, ""),
        ({"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                          "message": "CUDA out of\nmemory"}}}]},
         "exit code 1 (Error): CUDA out of memory"),
        ({"containerStatuses": [{"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}, ""),
        ({}, ""),
    ],
)
def test_pod_problem_is_one_short_line_naming_the_trouble(status: dict[str, Any], problem: str) -> None:
    assert children.pod_problem(status) == problem


def test_failed_trainer_pod_explains_its_job() -> None:
    pod = children.pod_info({
        "metadata": {"name": "r-trainer-2-abc", "labels": {"grpo.dev/component": "trainer",
                                                            "batch.kubernetes.io/job-name": "r-trainer-2"}},
        "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]},
    })
    snap = children.snapshot("run-uid", [pod], [], [children.job_info(job([]))])
    assert snap.pods == () and snap.trainer_pods == (pod,)
    assert snap.trainer_problem("r-trainer-2") == "pod r-trainer-2-abc: exit code 137 (OOMKilled)"
    assert snap.trainer_problem("r-trainer-1") == ""


def trainer_pod(code: int, message: str = "") -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": code, "reason": "Error"}
    if message:
        terminated["message"] = message
    return {
        "metadata": {"name": "r-trainer-2-abc", "labels": {"grpo.dev/component": "trainer",
                                                            "batch.kubernetes.io/job-name": "r-trainer-2"}},
        "status": {"containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}]},
    }


SAID = "spec.dataset: /data/prompts.jsonl is empty: no rows to train on"
BY_POLICY = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
             "message": "Container trainer for pod team/r-trainer-2-abc failed with exit code 2 matching FailJob rule"}
BY_BACKOFF = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
              "message": "Job has reached the specified backoff limit"}


@pytest.mark.parametrize(
    ("condition", "pod", "permanent", "message"),
    [
        (BY_POLICY, trainer_pod(2, SAID), True, SAID),
        # a cluster that does not apply the policy: the pod's exit code says the same
        (BY_BACKOFF, trainer_pod(2, SAID), True, SAID),
        (BY_POLICY, None, True, "PodFailurePolicy: Container trainer for pod"),
        (BY_BACKOFF, trainer_pod(1, "CUDA out of memory"), False, "BackoffLimitExceeded: Job has reached"),
        ({"type": "Complete", "status": "True"}, trainer_pod(0), False, ""),
    ],
    ids=["by its policy", "by its exit code", "by its policy, pod gone", "transient", "succeeded"],
)
def test_a_trainer_failed_by_the_invalid_spec_code_is_observed_as_permanent_in_its_own_words(
    condition: dict[str, str], pod: dict[str, Any] | None, permanent: bool, message: str
) -> None:
    from grpo_api.models import GRPORun, GRPORunStatus, Phase
    from grpo_operator.reconcile import trainer_state

    run = GRPORun.model_validate({"metadata": {"name": "r", "namespace": "team", "uid": "run-uid"}, "spec": {
        "model": {"name": "tiny", "path": "/models/tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"function": "token_fraction"}]}})
    pods = [children.pod_info(pod)] if pod is not None else []
    snap = children.snapshot("run-uid", pods, [], [children.job_info(job([condition]))])
    status = GRPORunStatus(phase=Phase.TRAINING, attempt=2)
    state, said, failed_permanently, preempted = trainer_state(None, run, status, snap)  # type: ignore[arg-type]
    assert state == snap.jobs[0].state
    assert failed_permanently is permanent and not preempted
    assert said.startswith(message), said


def test_pod_summary_reads_the_exit_code_once_a_container_terminated() -> None:
    assert children.pod_info(trainer_pod(2)).exit_code == 2
    assert children.pod_info({"metadata": {"name": "p"}, "status": {"containerStatuses": [
        {"name": "trainer", "state": {"running": {}}}]}}).exit_code is None


EVICTION = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting"}
BY_DISRUPTION = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                 "message": "Pod team/r-trainer-2-abc has condition DisruptionTarget matching FailJob rule at index 1"}


def evicted_trainer_pod() -> dict[str, Any]:
    pod = trainer_pod(143)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}, EVICTION]
    return pod


def test_pod_summary_reads_a_disruption_only_from_a_true_disruption_target_condition() -> None:
    assert children.pod_info(evicted_trainer_pod()).disruption == "EvictionByEvictionAPI: Eviction API: evicting"
    assert children.pod_info(trainer_pod(143)).disruption == ""
    assert children.disruption([{**EVICTION, "status": "False"}]) == ""


def test_a_job_failed_by_its_disruption_rule_is_not_failed_by_its_exit_code_rule() -> None:
    disrupted = children.job_info(job([BY_DISRUPTION]))
    assert disrupted.failed_by_disruption and not disrupted.failed_by_policy
    by_code = children.job_info(job([BY_POLICY]))
    assert by_code.failed_by_policy and not by_code.failed_by_disruption
    assert not children.job_info(job([BY_BACKOFF])).failed_by_disruption


@pytest.mark.parametrize(
    ("condition", "pod", "preempted", "message"),
    [
        (BY_DISRUPTION, evicted_trainer_pod(), True,
         "pod r-trainer-2-abc: DisruptionTarget EvictionByEvictionAPI: Eviction API: evicting"),
        # the evicted pod is deleted once the Job controller counted it: the Job's condition still says it
        (BY_DISRUPTION, None, True, "PodFailurePolicy: Pod team/r-trainer-2-abc has condition DisruptionTarget"),
        # a Job made before its policy had the DisruptionTarget rule: the pod, while it is there, says it
        (BY_BACKOFF, evicted_trainer_pod(), True, "pod r-trainer-2-abc: DisruptionTarget EvictionByEvictionAPI"),
        (BY_BACKOFF, trainer_pod(137), False, "BackoffLimitExceeded"),
        (BY_POLICY, trainer_pod(2, SAID), False, SAID),
    ],
    ids=["pod and job", "job alone", "pod alone", "a plain failure", "a configuration problem"],
)
def test_a_trainer_whose_pod_was_preempted_or_evicted_is_observed_as_preempted(
    condition: dict[str, str], pod: dict[str, Any] | None, preempted: bool, message: str
) -> None:
    from grpo_api.models import GRPORun, GRPORunStatus, Phase
    from grpo_operator.reconcile import trainer_state

    run = GRPORun.model_validate({"metadata": {"name": "r", "namespace": "team", "uid": "run-uid"}, "spec": {
        "model": {"name": "tiny", "path": "/models/tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"function": "token_fraction"}]}})
    pods = [children.pod_info(pod)] if pod is not None else []
    snap = children.snapshot("run-uid", pods, [], [children.job_info(job([condition]))])
    seen = trainer_state(None, run, GRPORunStatus(phase=Phase.TRAINING, attempt=2), snap)  # type: ignore[arg-type]
    assert seen.state == TrainerState.FAILED
    assert seen.preempted is preempted and not (seen.preempted and seen.failed_permanently)
    assert seen.message.startswith(message), seen.message


def test_merge_patch_removes_dropped_keys_and_replaces_lists() -> None:
    old = {"phase": "Training", "server": {"bootId": "a", "url": "u"}, "conditions": [{"type": "X"}], "gone": 1}
    new = {"phase": "Training", "server": {"bootId": "b"}, "conditions": [{"type": "Y"}]}
    assert merge_patch(old, new) == {"gone": None, "server": {"bootId": "b", "url": None},
                                     "conditions": [{"type": "Y"}]}
    assert merge_patch(new, new) == {}


def server_pod(attempt: int, status: dict[str, Any]) -> children.PodInfo:
    return children.pod_info({"metadata": {"name": f"r-server-{attempt}", "labels": {"grpo.dev/component": "server"},
                                           "annotations": {"grpo.dev/attempt": str(attempt)}}, "status": status})


def test_server_trouble_names_the_current_attempts_pod_or_its_deployment() -> None:
    unschedulable = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": "0/3 nodes are available"}]}
    pulling = {"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no image"}}}]}
    snap = children.snapshot("", [server_pod(1, pulling), server_pod(2, unschedulable)], [], [])
    assert server_trouble(snap, 2) == "pod r-server-2: Unschedulable: 0/3 nodes are available"
    assert server_trouble(snap, 1) == "pod r-server-1: ImagePullBackOff: no image"
    assert server_trouble(snap, 3) == ""
    quota = children.deployment_info({
        "metadata": {"name": "r-server", "ownerReferences": owned()},
        "spec": {"replicas": 1, "template": {"metadata": {"annotations": {"grpo.dev/attempt": "3"}}}},
        "status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                   "message": 'pods "r-server-x" is forbidden: exceeded quota: gpu'}]},
    })
    snap = children.snapshot("run-uid", [], [quota], [])
    assert server_trouble(snap, 3) == (
        'deployment r-server: FailedCreate: pods "r-server-x" is forbidden: exceeded quota: gpu')


def test_a_crash_looping_server_that_exited_with_the_invalid_spec_code_is_read_from_its_last_state() -> None:
    """A server container restarts (the Deployment's pods restart always): after exit code 2 it waits in
    CrashLoopBackOff and its exit, with its termination message, is in lastState; exit code 1 is no verdict."""
    said = "the server cannot run: EngineUnavailable: spec.server.engine vllm needs a CUDA GPU"
    looping = {"containerStatuses": [{
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": said + "\n"}}}]}
    crashed = {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom"}}}]}
    snap = children.snapshot("", [server_pod(1, crashed), server_pod(2, looping)], [], [])
    assert snap.server_said_invalid_spec(2) == said
    assert snap.server_said_invalid_spec(1) is None
    assert snap.server_said_invalid_spec(3) is None
    assert children.pod_info({"metadata": {"name": "p"}, "status": looping}).exit_code == 2


def series(name: str, **labels: str) -> float | None:
    value: float | None = REGISTRY.get_sample_value(name, labels)
    return value


def test_a_run_has_one_phase_series_and_its_series_go_when_it_is_forgotten() -> None:
    run = {"namespace": "units-ns", "grporun": "units-run"}
    metrics.set_run("units-ns", "units-run", "StartingServer", 1)
    metrics.set_run("units-ns", "units-run", "Training", 2)
    metrics.count_run_failure("units-ns", "units-run", "TrainerFailed")
    assert series("grpo_operator_run_phase", **run, phase="Training") == 1
    assert series("grpo_operator_run_phase", **run, phase="StartingServer") is None
    assert series("grpo_operator_run_attempt", **run) == 2
    assert series("grpo_operator_run_failures_total", **run, reason="TrainerFailed") == 1
    metrics.set_run("units-ns", "other-run", "Training", 1)
    metrics.forget_run("units-ns", "units-run")
    assert "units-run" not in generate_latest(REGISTRY).decode()
    assert series("grpo_operator_run_phase", namespace="units-ns", grporun="other-run", phase="Training") == 1
    metrics.forget_run("units-ns", "other-run")


@pytest.mark.parametrize("reason", ["SourceUnavailable", "ChildConflict", "ChildRejected", "InvalidSpec"])
def test_every_way_a_run_fails_is_counted_under_its_reason(reason: str) -> None:
    """Runs failed as SourceUnavailable, ChildConflict or ChildRejected once went uncounted: the metric's reasons
    were a hand-kept list beside the lifecycle's (issue 32). Both read grpo_api.reasons now."""
    import datetime as dt

    from grpo_api.lifecycle import reject
    from grpo_api.models import GRPORunStatus, Reason
    from grpo_operator.reconcile import _count_failures

    run = {"namespace": "units-ns", "grporun": f"failed-{reason.lower()}"}
    before = series("grpo_operator_failures_total", reason=reason)
    assert before is not None, f"no {reason} series from the start"
    decision = reject(GRPORunStatus(), "what went wrong", dt.datetime.now(dt.UTC), reason=Reason(reason))
    _count_failures(run["namespace"], run["grporun"], decision)
    assert series("grpo_operator_failures_total", reason=reason) == before + 1
    assert series("grpo_operator_run_failures_total", **run, reason=reason) == 1
    metrics.forget_run(run["namespace"], run["grporun"])


def test_the_reason_table_covers_every_reason_and_its_warnings_are_the_lifecycles() -> None:
    from grpo_api import lifecycle, reasons
    from grpo_api.models import Reason

    assert set(reasons.REASONS) == set(Reason)
    assert lifecycle.WARNING_REASONS == reasons.WARNING_REASONS and metrics.FAILURE_REASONS == reasons.FAILURE_REASONS
    assert reasons.FAILURE_REASONS <= reasons.WARNING_REASONS, "a failure is something going wrong"
    assert {Reason.SOURCE_UNAVAILABLE, Reason.CHILD_CONFLICT, Reason.CHILD_REJECTED, Reason.CHILD_DELETED} <= (
        reasons.FAILURE_REASONS)
    assert not {Reason.RETRYING, Reason.CHILD_RESTORED, Reason.RECONCILE_ERROR} & reasons.FAILURE_REASONS


def test_operator_flags_configure_the_run_network_policy() -> None:
    params = operator.make_context("operator", [
        "-n", "a", "--operator-pod-selector", "app.kubernetes.io/name=grpo,app.kubernetes.io/instance=x",
        "--operator-namespace-selector", "kubernetes.io/metadata.name=grpo-system",
        "--scraper-namespace-selector", "", "--scraper-pod-selector", "app.kubernetes.io/name=prometheus",
    ]).params
    assert params["network_policy"] is True
    assert params["operator_pod_selector"] == {"app.kubernetes.io/name": "grpo", "app.kubernetes.io/instance": "x"}
    assert params["operator_namespace_selector"] == {"kubernetes.io/metadata.name": "grpo-system"}
    assert params["scraper_namespace_selector"] == {} and params["scraper_pod_selector"] == {
        "app.kubernetes.io/name": "prometheus"}
    defaults = operator.make_context("operator", ["-n", "a"]).params
    assert defaults["operator_pod_selector"] == builders.DEFAULT_OPERATOR_POD_LABELS
    assert defaults["operator_namespace_selector"] == {} and defaults["scraper_namespace_selector"] is None
    assert operator.make_context("operator", ["-n", "a", "--no-network-policy"]).params["network_policy"] is False


def test_operator_selector_flags_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_OPERATOR_POD_SELECTOR", "team=ml")
    monkeypatch.setenv("GRPO_NETWORK_POLICY", "false")
    params = operator.make_context("operator", ["-n", "a"]).params
    assert params["operator_pod_selector"] == {"team": "ml"} and params["network_policy"] is False


def test_a_bad_selector_flag_is_refused_naming_the_flag() -> None:
    result = CliRunner().invoke(operator, ["-n", "a", "--operator-pod-selector", "app name"])
    assert result.exit_code == 2
    assert "--operator-pod-selector" in result.output and "'app name'" in result.output


def test_rbac_renders_cluster_wide_and_per_namespace_roles_from_one_rule_list() -> None:
    cluster = rbac.render_rbac("grpo", "sa", "system")
    assert [o["kind"] for o in cluster] == ["ClusterRole", "ClusterRoleBinding"]
    assert cluster[0]["rules"] == rbac.RULES
    scoped = rbac.render_rbac("grpo", "sa", "system", namespaces=["a", "b"])
    assert [o["kind"] for o in scoped] == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Role",
                                           "RoleBinding"]
    assert scoped[2]["rules"] == rbac.APPLICATION_RULES and scoped[2]["metadata"]["namespace"] == "a"
    verbs = {(g, r): set(rule["verbs"]) for rule in rbac.RULES for g in rule["apiGroups"] for r in rule["resources"]}
    assert "update" not in verbs[("apps", "deployments")] and "*" not in set().union(*verbs.values())
    # The token Secret is read by name (whose it is, whether it still exists); Secrets are never listed or
    # watched, so the operator cannot enumerate a namespace's Secrets.
    assert verbs[("", "secrets")] == {"create", "get"}, "the operator never lists or watches Secrets"
    # Watched (a deleted one is created again mid-attempt), never changed or deleted: garbage collection does that.
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"create", "get", "list", "watch"}


@pytest.mark.parametrize("args", [[], ["-n", "a", "--all-namespaces"]])
def test_operator_command_needs_exactly_one_watch_scope(args: list[str]) -> None:
    result = CliRunner().invoke(operator, args)
    assert result.exit_code == 2 and "--all-namespaces" in result.output
