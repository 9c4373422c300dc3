"""The chart and the images reach the node from an OCI registry, as a release delivers them.

The node's registry is the CNCF distribution registry (hack/cluster.sh, built from the Go module proxy).
The suite pushed the project's images to it (`hack/cluster.sh images`) and the chart as an OCI artifact
(`helm push`), and installed the operator with `helm install oci://…` (conftest). Nothing imports
those images into containerd: the kubelet pulls them.
"""

from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import (
    IMAGE_REPOSITORY,
    REGISTRY,
    RELEASE_NAMESPACE,
    Node,
    chart_version,
    node_images,
    wait_for,
)

HELM_CONFIG_MEDIA_TYPE = "application/vnd.cncf.helm.config.v1+json"


def test_the_operator_is_installed_from_the_registry_and_the_node_pulls_its_images(
        node: Node, operator_release: str, staged: str, chart_ref: str) -> None:
    # the release was installed from the chart in the registry, which holds it as a Helm OCI artifact
    releases = json.loads(node.helm("list", "-n", RELEASE_NAMESPACE, "-o", "json").stdout)
    (release,) = [r for r in releases if r["name"] == operator_release]
    assert release["chart"] == f"grpo-operator-{chart_version()}" and release["status"] == "deployed", release
    manifest = httpx.get(
        f"http://{REGISTRY}/v2/{chart_ref.removeprefix(f'oci://{REGISTRY}/')}/manifests/{chart_version()}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30).json()
    assert manifest["config"]["mediaType"] == HELM_CONFIG_MEDIA_TYPE, manifest

    # the operator runs the image it pulled from the registry (the digest the registry gave)
    (pod,) = node.list("pod", "app.kubernetes.io/name=grpo-operator", RELEASE_NAMESPACE)
    image_id = pod["status"]["containerStatuses"][0]["imageID"]
    assert image_id.startswith(f"{IMAGE_REPOSITORY}/grpo-operator@sha256:"), image_id

    # the node holds the operator's and the trainer's images (`grpo stage` ran the trainer's) by their
    # registry names, and none of the project's images under the local names an import would give
    wanted = {node.images["grpo-operator"], node.images["grpo-trainer"]}
    wait_for(lambda: wanted <= node_images(node), 60, what=f"{sorted(wanted)} among the node's images", interval=2)
    local_names = tuple(f"localhost/{name}:" for name in ("grpo-operator", "grpo-server", "grpo-trainer"))
    imported = sorted(n for n in node_images(node) if n.startswith(local_names))
    assert not imported, f"images imported, not pulled: {imported}"
