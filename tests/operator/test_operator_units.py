"""Pure parts of the operator that need no cluster: child summaries, status patches, RBAC, CLI flags."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from grpo_api.lifecycle import TrainerState
from grpo_operator import children, rbac
from grpo_operator.cli import operator
from grpo_operator.reconcile import FAILED_ATTEMPTS_ANNOTATION, _failed_attempts, merge_patch


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


def test_merge_patch_removes_dropped_keys_and_replaces_lists() -> None:
    old = {"phase": "Training", "server": {"bootId": "a", "url": "u"}, "conditions": [{"type": "X"}], "gone": 1}
    new = {"phase": "Training", "server": {"bootId": "b"}, "conditions": [{"type": "Y"}]}
    assert merge_patch(old, new) == {"gone": None, "server": {"bootId": "b", "url": None},
                                     "conditions": [{"type": "Y"}]}
    assert merge_patch(new, new) == {}


def test_failed_attempts_annotation_is_read_as_a_set() -> None:
    meta = {"annotations": {FAILED_ATTEMPTS_ANNOTATION: "3,1,3, x"}}
    assert _failed_attempts(meta) == (1, 3)
    assert _failed_attempts({}) == ()


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
    assert verbs[("", "secrets")] == {"create"}, "the operator never reads Secrets"


@pytest.mark.parametrize("args", [[], ["-n", "a", "--all-namespaces"]])
def test_operator_command_needs_exactly_one_watch_scope(args: list[str]) -> None:
    result = CliRunner().invoke(operator, args)
    assert result.exit_code == 2 and "--all-namespaces" in result.output
