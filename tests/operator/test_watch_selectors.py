"""kopf's list and watch requests for the runs' children carry a server-side label selector.

kopf filters by labels in-process; `handlers.select_children_server_side` sets kopf's public
`settings.watching.label_selectors` at start-up, which kopf joins into the `labelSelector` of every list and
watch request of a matching resource. These check what kopf collects for each resource it would watch, with
kopf's own Resource objects; `bench/operator_watch_traffic.py` measures what reaches the operator.
"""

from __future__ import annotations

import kopf
import pytest
from kopf._cogs.structs import references

from grpo_operator import builders, handlers


def settings() -> kopf.OperatorSettings:
    configured = kopf.OperatorSettings()
    handlers.select_children_server_side(configured)
    return configured


@pytest.mark.parametrize(("group", "version", "plural"), [
    ("", "v1", "pods"), ("apps", "v1", "deployments"), ("batch", "v1", "jobs"), ("", "v1", "configmaps"),
    ("", "v1", "services"), ("", "v1", "persistentvolumeclaims"), ("networking.k8s.io", "v1", "networkpolicies"),
])
def test_list_and_watch_requests_of_the_children_carry_the_run_label_selector(group: str, version: str,
                                                                              plural: str) -> None:
    resource = references.Resource(group=group, version=version, plural=plural, namespaced=True)
    assert settings().watching.label_selectors.collect(resource) == [builders.RUN_LABEL]


@pytest.mark.parametrize(("group", "version", "plural"), [
    ("grpo.dev", "v1alpha1", "grporuns"),  # the runs themselves: every one is the operator's
    ("", "v1", "secrets"),  # not watched at all
    ("metrics.k8s.io", "v1beta1", "pods"),  # another group's `pods`
])
def test_the_runs_and_other_kinds_are_left_alone(group: str, version: str, plural: str) -> None:
    resource = references.Resource(group=group, version=version, plural=plural, namespaced=True)
    assert settings().watching.label_selectors.collect(resource) == []


def test_the_start_up_handler_sets_them_and_no_private_kopf_function_is_patched(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_operator.reconcile import OperatorConfig

    kubeconfig = tmp_path / "kubeconfig"  # the handler builds its API client (it sends nothing at start-up)
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {token: t}}]\n")
    # the client library reads $KUBECONFIG once, when it is imported
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    configured = kopf.OperatorSettings()
    memo = kopf.Memo(config=OperatorConfig(metrics_port=0))
    handlers.configure(settings=configured, memo=memo)
    try:
        pods = references.Resource(group="", version="v1", plural="pods", namespaced=True)
        assert configured.watching.label_selectors.collect(pods) == [builders.RUN_LABEL]
        assert not hasattr(references.Resource.get_url, "grpo_selector")
    finally:
        handlers.shutdown(memo=memo)
