"""kopf's list and watch requests for the runs' children carry a server-side label selector.

kopf (pinned) filters by labels in-process; `handlers.select_children_server_side` wraps the one
function kopf builds its URLs with. These check the URLs kopf's own Resource objects build, so a
kopf upgrade that changes how it builds them fails here; `bench/operator_watch_traffic.py` measures
what reaches the operator.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest
from kopf._cogs.structs import references

from grpo_operator import builders, handlers


def query(url: str) -> dict[str, list[str]]:
    return parse_qs(urlparse(url).query)


@pytest.mark.parametrize(("group", "version", "plural"), [
    ("", "v1", "pods"), ("apps", "v1", "deployments"), ("batch", "v1", "jobs"), ("", "v1", "configmaps"),
    ("", "v1", "services"), ("", "v1", "persistentvolumeclaims"), ("networking.k8s.io", "v1", "networkpolicies"),
])
def test_list_and_watch_urls_of_the_children_carry_the_run_label_selector(group: str, version: str,
                                                                          plural: str) -> None:
    resource = references.Resource(group=group, version=version, plural=plural, namespaced=True)
    for namespace in ("team-a", None):
        watch = resource.get_url(namespace=namespace, params={"watch": "true", "resourceVersion": "5"})
        assert query(watch) == {"watch": ["true"], "resourceVersion": ["5"], "labelSelector": [builders.RUN_LABEL]}
        assert query(resource.get_url(namespace=namespace)) == {"labelSelector": [builders.RUN_LABEL]}


def test_requests_for_one_object_and_for_the_runs_themselves_are_left_alone() -> None:
    pods = references.Resource(group="", version="v1", plural="pods", namespaced=True)
    assert "labelSelector" not in pods.get_url(namespace="a", name="p")
    assert "labelSelector" not in pods.get_url(namespace="a", name="p", subresource="log")
    runs = references.Resource(group="grpo.dev", version="v1alpha1", plural="grporuns", namespaced=True)
    assert "labelSelector" not in runs.get_url(namespace="a", params={"watch": "true"})
    secrets = references.Resource(group="", version="v1", plural="secrets", namespaced=True)
    assert "labelSelector" not in secrets.get_url(namespace="a"), "Secrets are not watched at all"


def test_installing_twice_wraps_once() -> None:
    handlers.select_children_server_side()
    pods = references.Resource(group="", version="v1", plural="pods", namespaced=True)
    assert query(pods.get_url(namespace="a"))["labelSelector"] == [builders.RUN_LABEL]
