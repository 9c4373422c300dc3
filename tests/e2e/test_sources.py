"""Sources on a real node: a run whose sources cannot be used fails before any server (the
initializer, the trainer image's `grpo prepare`, names the problem, the Job's podFailurePolicy stops
it at once, the run is Failed/SourceUnavailable with its words); an hf:// model is fetched once from
a mirror by the initializer and trained on. The ConfigMap and claim sources are the example's own
(tests/e2e/test_example_run.py); s3:// sources and an oci:// model (an image volume) are test_platform_run.py's."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    NAMESPACE,
    Node,
    describe,
    example_run,
    node_ip,
    pod_spec,
    wait_for,
    wait_phase,
)
from tests.fixtures.hub import repo_files, running_hub


def fails_before_any_server(node: Node, run: str) -> dict:
    """The status of `run` once Failed, checking on the way that it never went past its sources; then that no
    server or trainer was made and the initializer ran once and said exit code 2 (not retried)."""

    def failed() -> dict | None:
        status = (node.get("grporun", run) or {}).get("status") or {}
        if status.get("phase") not in (None, "Pending", "Initializing", "Failed"):
            raise AssertionError(f"the run went past its sources: {status}\n{describe(node, run)}")
        return status if status.get("phase") == "Failed" else None

    status = wait_for(failed, 300, what=f"{run} to fail on its sources", interval=2.0)
    assert node.get("deployment", f"{run}-server") is None, "a server was started for a run that cannot run"
    assert not node.list("job", f"grpo.dev/run={run},grpo.dev/component=trainer")
    pods = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=initializer")
    assert len(pods) == 1, "a configuration error is not retried"
    (terminated,) = [c["state"]["terminated"] for c in pods[0]["status"]["containerStatuses"]]
    assert terminated["exitCode"] == 2, terminated
    return status


def test_a_missing_reward_function_fails_the_run_before_any_server(node: Node, staged: str) -> None:
    run = "bad-reward"
    spec = example_run(node, run, maxSteps=4)
    spec["spec"]["rewards"] = [{"function": "target_tokens:no_such_function"}]
    node.apply(spec)
    status = fails_before_any_server(node, run)
    assert status["reason"] == "SourceUnavailable", status
    assert "no_such_function" in status["message"] and "target_tokens" in status["message"], status["message"]
    events = [e["reason"] for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    assert "SourceUnavailable" in events, events


def test_a_run_the_trainer_image_cannot_execute_fails_before_any_server(node: Node, staged: str) -> None:
    """The trainer image here is the CPU variant (ENGINE=cpu, no vLLM). LoRA merged into the weights of a vllm
    server goes over nccl between pods, whose trainer side is vLLM's: the initializer, in that image, refuses
    the run naming spec.trainer.image, before any (GPU) server pod exists, and it is not retried (issue 29)."""
    run = "needs-vllm"
    spec = example_run(node, run, maxSteps=4)
    spec["spec"]["server"]["engine"] = "vllm"
    spec["spec"]["trainer"]["sync"] = "merged"
    node.apply(spec)
    status = fails_before_any_server(node, run)
    message = status["message"]
    assert message.startswith("the initializer failed: spec.trainer.image: spec.trainer.sync merged sends the "
                              "weights to the vllm server over nccl"), message
    assert "has no vLLM" in message and "ENGINE=vllm" in message, message


def test_a_server_image_that_cannot_run_its_engine_fails_the_run_at_once(node: Node, staged: str) -> None:
    """The server image here is the CPU variant (no vLLM); `server.engine: vllm` makes its container exit with
    code 2 in its own words (its termination message). The operator reads that from the crash-looping pod and
    fails the run as InvalidSpec at once: no serverReadyTimeoutSeconds wait, no other attempt, no trainer."""
    run = "server-no-vllm"
    spec = example_run(node, run, maxSteps=4)
    spec["spec"]["server"]["engine"] = "vllm"
    spec["spec"]["runPolicy"] = {**spec["spec"].get("runPolicy", {}), "backoffLimit": 2,
                                 "serverReadyTimeoutSeconds": 900}
    node.apply(spec)

    def failed() -> dict | None:
        status = (node.get("grporun", run) or {}).get("status") or {}
        if status.get("phase") in ("Training", "Succeeded"):
            raise AssertionError(f"the run went past its server: {status}\n{describe(node, run)}")
        return status if status.get("phase") == "Failed" else None

    status = wait_for(failed, 300, what=f"{run} to fail on its server", interval=2.0)
    assert (status["reason"], status["attempt"]) == ("InvalidSpec", 1), status
    assert "spec.server.engine vllm: this image has no vLLM" in status["message"], status["message"]
    assert not node.list("job", f"grpo.dev/run={run},grpo.dev/component=trainer")


def test_a_missing_configmap_or_claim_fails_the_run_naming_it(node: Node, staged: str) -> None:
    """Sources named before they exist (a typo, not staged yet), as a stranger would: a missing ConfigMap
    is an empty optional mount, so `grpo prepare` names the missing file at once; a missing claim keeps
    the initializer's pod unschedulable, and initializer.startTimeoutSeconds ends the wait with the
    scheduler's words. Neither starts a server."""
    no_prompts = example_run(node, "no-prompts", maxSteps=4)
    no_prompts["spec"]["dataset"]["source"] = "configmap://not-staged-yet"
    no_claim = example_run(node, "no-claim", maxSteps=4)
    no_claim["spec"]["model"]["source"] = "pvc://not-staged-yet/tiny"
    no_claim["spec"]["initializer"] = {"startTimeoutSeconds": 30}
    node.apply(no_prompts)
    node.apply(no_claim)

    def ended(run: str) -> dict | None:
        status = (node.get("grporun", run) or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    status = wait_for(lambda: ended("no-prompts"), 300, what="no-prompts to fail", interval=2.0)
    assert status["reason"] == "SourceUnavailable", status
    assert "spec.dataset" in status["message"] and "prompts.jsonl" in status["message"], status["message"]
    status = wait_for(lambda: ended("no-claim"), 300, what="no-claim to fail", interval=2.0)
    assert status["reason"] == "SourceUnavailable", status
    assert "startTimeoutSeconds" in status["message"] and "not-staged-yet" in status["message"], status
    for run in ("no-prompts", "no-claim"):
        assert node.get("deployment", f"{run}-server") is None, f"{run}: a server was started"


def test_an_hf_model_is_fetched_once_from_a_mirror_by_the_initializer_and_the_run_trains_on_it(
        node: Node, staged: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The hub path on the node: a hub-compatible server on the host plays the mirror (no hub is
    reachable from CI); the initializer pod fetches through huggingface_hub with the token from a
    Secret, the server and trainer load what it fetched, and nothing else ever sees the token."""
    from grpo_testmodels import make_model

    run, token = "from-hub", "hf_e2e_secret_token"
    model = make_model(tmp_path_factory.mktemp("hub") / "tiny", preset="tiny", seed=0)
    node.kubectl("create", "secret", "generic", "hub-token", "-n", NAMESPACE, f"--from-literal=token={token}")
    with running_hub("0.0.0.0", node_ip(node)) as hub:
        files = repo_files(model)
        hub.add("org/tiny", files)
        spec = example_run(node, run, maxSteps=4)
        spec["spec"]["model"] = {"name": "tiny-qwen2", "source": "hf://org/tiny@main", "dtype": "float32",
                                 "hub": {"endpoint": hub.url, "tokenSecretRef": {"name": "hub-token", "key": "token"}}}
        node.apply(spec)
        status = wait_phase(node, run, "Succeeded", 15 * 60)

    assert status["sources"]["ready"] and status["attempt"] == 1, status
    assert sorted(hub.file_gets()) == sorted(files), "every file fetched exactly once"
    assert {r.authorization for r in hub.requests} == {f"Bearer {token}"}, "the token reached the mirror"
    init = node.get("job", f"{run}-init")
    assert init is not None and init["status"].get("succeeded") == 1
    for component in ("server", "trainer"):
        env = pod_spec(node, run, component)["containers"][0].get("env", [])
        assert not [e for e in env if "secretKeyRef" in (e.get("valueFrom") or {})], env
