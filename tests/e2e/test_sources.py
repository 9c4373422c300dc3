"""A run whose sources cannot be used fails before any server, on a real node: the initializer (the
trainer image's `grpo prepare`) names the problem, the Job's podFailurePolicy stops it at once, and the
run is Failed/SourceUnavailable with the initializer's words."""

from __future__ import annotations

from tests.e2e.conftest import NAMESPACE, Node, describe, example_run, wait_for


def test_a_missing_reward_function_fails_the_run_before_any_server(node: Node, staged: str) -> None:
    run = "bad-reward"
    spec = example_run(node, run, maxSteps=4)
    spec["spec"]["rewards"] = [{"function": "target_tokens:no_such_function"}]
    node.apply(spec)

    def failed() -> dict | None:
        status = (node.get("grporun", run) or {}).get("status") or {}
        if status.get("phase") not in (None, "Pending", "Initializing", "Failed"):
            raise AssertionError(f"the run went past its sources: {status}\n{describe(node, run)}")
        return status if status.get("phase") == "Failed" else None

    status = wait_for(failed, 300, what=f"{run} to fail on its sources", interval=2.0)
    assert status["reason"] == "SourceUnavailable", status
    assert "no_such_function" in status["message"] and "target_tokens" in status["message"], status["message"]
    assert node.get("deployment", f"{run}-server") is None, "a server was started for a run with bad sources"
    assert not node.list("job", f"grpo.dev/run={run},grpo.dev/component=trainer")
    pods = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=initializer")
    assert len(pods) == 1, "a configuration error is not retried"
    (terminated,) = [c["state"]["terminated"] for c in pods[0]["status"]["containerStatuses"]]
    assert terminated["exitCode"] == 2, terminated
    events = [e["reason"] for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    assert "SourceUnavailable" in events, events
