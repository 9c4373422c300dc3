"""The Kubernetes permissions the operator needs, and no more: one list, rendered for the chart.

`APPLICATION_RULES` are what the reconciler does to runs and their children; `FRAMEWORK_RULES`
are what kopf needs to watch (CRD discovery, namespaces for cluster-wide or glob watching);
`KUEUE_RULES` and `KUEUE_CLUSTER_RULES` are added with Kueue (`grpo operator --kueue`, the chart's
kueue.enabled). The control-plane tests run the operator under exactly these rules.
"""

from __future__ import annotations

from typing import Any

from grpo_api.models import GROUP, PLURAL

PolicyRule = dict[str, list[str]]

APPLICATION_RULES: list[PolicyRule] = [
    # Watch runs (kopf), add/remove its finalizer and progress annotations, delete after the TTL.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch", "delete"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # ownerReferences with blockOwnerDeletion need update on the owner's finalizers subresource.
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # Children: created once per attempt ("already exists" is success only when the run owns the object,
    # so conflicts are read back); watched through kopf indexes with a server-side label selector, so a
    # reconcile sees a deleted child without an API call and re-creates it. They are deleted by GC.
    {
        "apiGroups": [""],
        "resources": ["configmaps", "persistentvolumeclaims", "services"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["delete"]},
    # The token Secret: read by name only (whose it is, whether it still exists), never listed or watched,
    # so the operator cannot enumerate a namespace's Secrets.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    # The run's server NetworkPolicy: created with the Service, removed with the run by GC.
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    # The initializer's latest progress line, shown in the run's status while it fetches.
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

FRAMEWORK_RULES: list[PolicyRule] = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]

#: With Kueue: the Workload of each run Kueue admits (read every reconcile of such a run, created once, patched for
#: runPolicy.suspend and, in its status, when an eviction is acknowledged and when the run ended; deleted with the run
#: by GC), and the LocalQueue its label names (read while it waits). Neither is listed nor watched.
KUEUE_RULES: list[PolicyRule] = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
]
#: With Kueue, cluster-scoped: the WorkloadPriorityClass a run's label names (its value is the Workload's priority)
#: and the ResourceFlavors Kueue assigns (their node labels and tolerations go to the run's pods), read by name.
KUEUE_CLUSTER_RULES: list[PolicyRule] = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloadpriorityclasses", "resourceflavors"], "verbs": ["get"]},
]

RULES: list[PolicyRule] = APPLICATION_RULES + FRAMEWORK_RULES


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "grpo-operator", "app.kubernetes.io/part-of": "grpo-operator"}


def render_rbac(
    name: str, service_account: str, service_account_namespace: str, namespaces: list[str] | None = None,
    *, kueue: bool = False,
) -> list[dict[str, Any]]:
    """ClusterRole + ClusterRoleBinding (cluster-wide), or per-namespace Roles + RoleBindings for the
    application rules plus a ClusterRole + binding for the cluster-scoped framework rules; with `kueue`, Kueue's
    rules beside them."""
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": service_account_namespace}
    namespaced = APPLICATION_RULES + (KUEUE_RULES if kueue else [])
    cluster = FRAMEWORK_RULES + (KUEUE_CLUSTER_RULES if kueue else [])
    if not namespaces:
        return [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": name, "labels": _labels()},
                "rules": namespaced + cluster,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name, "labels": _labels()},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [subject],
            },
        ]
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": _labels()},
            "rules": cluster,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": _labels()},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [subject],
        },
    ]
    for namespace in namespaces:
        objects.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": name, "namespace": namespace, "labels": _labels()},
                "rules": namespaced,
            }
        )
        objects.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": name, "namespace": namespace, "labels": _labels()},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [subject],
            }
        )
    return objects
