"""`helm uninstall` removes the operator and leaves the CRD and every GRPORun in place (the chart's
documented default). Its own module, named to run last: it takes the operator away."""

from __future__ import annotations

from tests.e2e.conftest import NAMESPACE, RELEASE, RELEASE_NAMESPACE, Node, example_run, run_status, wait_for

STEPS = 16


def test_helm_uninstall_keeps_the_crd_and_the_runs(node: Node, staged: str) -> None:
    """Last: it removes the operator. The CRD carries helm's keep policy, so no GRPORun is lost."""
    kept = "kept-run"
    run = example_run(node, kept, maxSteps=STEPS)
    run["spec"]["runPolicy"]["suspend"] = True   # nothing to train: only the object matters here
    node.apply(run)
    wait_for(lambda: run_status(node, kept).get("phase") == "Suspended", 120, what="the run to be suspended",
             interval=2)
    node.helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", "--timeout", "120s")

    assert node.get("crd", "grporuns.grpo.dev", None) is not None, "helm uninstall deleted the CRD"
    remaining = node.get("grporun", kept)
    assert remaining is not None and remaining["status"]["phase"] == "Suspended", remaining
    wait_for(lambda: not node.list("pod", "app.kubernetes.io/name=grpo-operator", RELEASE_NAMESPACE), 120,
             what="the operator pod to go", interval=2)

    # As docs/limits.md says for runs left behind by an uninstalled operator: remove the finalizer by hand.
    node.kubectl("patch", "grporun", kept, "-n", NAMESPACE, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
    node.kubectl("delete", "grporun", kept, "-n", NAMESPACE, "--wait=true", timeout=60)
