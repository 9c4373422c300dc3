"""`grpo run -f FILE` end to end on the tiny model: the operator's lifecycle with local processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.local_runs import children, grpo_run, run_file
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow


def progress_step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "progress" / "local-test.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_local_run_succeeds_publishes_adapters_and_writes_summary_and_png(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = grpo_run(run_file(tmp_path, tiny_model_dir, tiny_dataset), run_dir)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps"] == 4 and summary["attempts"] == 1, summary
    versions = sorted(p.name for p in (run_dir / "adapters" / "local-test").iterdir() if p.name.startswith("v"))
    assert versions and len(versions) <= 2, versions  # pruned one sync late
    assert summary["adapterVersion"] == max(int(v[1:]) for v in versions), summary  # the last step's sync
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert (run_dir / "logs" / "server-attempt-1.log").is_file()
    assert (run_dir / "logs" / "trainer-attempt-1.log").is_file()
    assert all(not group_alive(c["pid"]) for c in children(run_dir))


def test_killing_the_server_mid_run_starts_a_new_attempt_with_a_fresh_server(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    run_dir = tmp_path / "run"
    # The trainer gives up on a dead server after generationTimeoutSeconds; the attempt then fails.
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset, maxSteps=6, generationTimeoutSeconds=15)
    proc = grpo_run(path, run_dir)
    try:
        wait_for(lambda: progress_step(run_dir) >= 2, 300, what="two trained steps")
        server = next(c for c in children(run_dir) if c["role"] == "server" and c["attempt"] == 1)
        os.killpg(server["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["attempts"] == 2 and summary["steps"] == 6, summary
    events = (run_dir / "events.log").read_text()
    assert "TrainerFailed" in events and "Retrying" in events, events
    assert (run_dir / "logs" / "server-attempt-2.log").is_file()


def test_two_server_replicas_and_two_trainer_processes_learn_and_survive_losing_a_replica(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    """The learning check's workload (4 prompts × 8 completions of 12 tokens a step, lr 3e-2) on two
    server replicas and two trainer processes (torchrun, gloo): one replica is killed at step 6."""
    run_dir = tmp_path / "run"
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset, server={"replicas": 2}, numProcPerNode=2,
                    numGenerations=8, perDeviceBatchSize=16, maxCompletionLength=12, lrScheduler="constant",
                    maxSteps=20, checkpointInterval=10)
    proc = grpo_run(path, run_dir)
    try:
        wait_for(lambda: progress_step(run_dir) >= 6, 600, what="step 6")
        servers = [c for c in children(run_dir) if c["role"] == "server"]
        assert len(servers) == 2, servers
        ports = json.loads((run_dir / "processes.json").read_text())["ports"]
        assert len(set(ports)) == 2, ports
        second = next(c for c in servers if c["log"].endswith("-replica-1.log"))
        assert "POST /v1/completions" in Path(second["log"]).read_text(), "the second replica got no work"
        os.killpg(second["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps"] == 20 and summary["attempts"] == 1, summary
    trainer_log = (run_dir / "logs" / "trainer-attempt-1.log").read_text()
    assert "grpo train: 2 processes (1 node(s) × 2)" in trainer_log, trainer_log[:3000]
    assert "2 replica(s)" in trainer_log, trainer_log[-3000:]
    # its group went to the other replica, or a sync found it gone first and it got no more work
    assert "re-issued generation group" in trainer_log or "missed adapter v" in trainer_log, trainer_log[-3000:]
    lines = (run_dir / "progress" / "local-test.history.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines]
    rewards = [h["reward_mean"] for h in sorted(history, key=lambda h: h["step"])]
    first5, last5 = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\ntwo replicas, two trainer processes: first5 {first5:.4f} last5 {last5:.4f}; "
          f"rewards {[round(r, 3) for r in rewards]}")
    assert last5 / first5 >= 1.5 and last5 - first5 >= 0.1, rewards


def test_sigint_mid_run_leaves_no_child_and_no_bound_port(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = grpo_run(run_file(tmp_path, tiny_model_dir, tiny_dataset, maxSteps=50), run_dir)
    try:
        wait_for(lambda: any(c["role"] == "trainer" for c in children(run_dir)), 300, what="the trainer to start")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out
    port = json.loads((run_dir / "processes.json").read_text())["port"]
    for child in children(run_dir):
        assert not group_alive(child["pid"]), child
    assert port_free(port)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"spec": {"trainer": {"numGenerationz": 4}}}, "numGenerationz"),
        ({"spec": {"trainer": {"numGenerations": 1}}}, "numGenerations"),
        ({"spec": {"trainer": {"lora": {"r": 7}}}}, "lora"),
        ({"spec": {"runPolicy": {"backoffLimit": -1}}}, "backoffLimit"),
    ],
)
def test_a_bad_file_is_refused_before_anything_starts_naming_the_field(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path, patch: dict[str, Any], field: str
) -> None:
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())

    def merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                merge(base[k], v)
            else:
                base[k] = v

    merge(doc, patch)
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert field in out and str(path) in out, out
    assert not run_dir.exists(), "nothing may start for a bad file"


def test_a_missing_reward_function_fails_the_run_before_any_server(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """The initializer process (`grpo prepare`) checks the reward functions first: a missing one ends the
    run as SourceUnavailable in its own words, and no server process is ever started."""
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["rewards"] = [{"function": "mine:no_such_function"}]
    doc["spec"]["rewardCode"] = {"inline": {"mine.py": "def share(completions, **kwargs):\n    return []\n"}}
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "SourceUnavailable"), status
    assert "no_such_function" in status["message"] and "exit code" not in status["message"], status["message"]
    assert [c["role"] for c in children(run_dir)] == ["initializer"], children(run_dir)


def test_a_run_the_trainer_image_cannot_execute_fails_before_any_server(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """Full fine-tuning that sends weights over nccl needs vLLM beside the trainer (its NCCL weight transfer),
    which this environment lacks, as a CPU trainer image does: the initializer refuses the run, naming
    spec.trainer.image and what the spec asks for, and no server process is ever started (issue 29)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: this environment can run the spec")
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["trainer"]["tuning"] = "full"
    doc["spec"]["server"] = {**doc["spec"].get("server", {}), "engine": "vllm", "weightTransfer": "nccl"}
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert status["phase"] == "Failed", status
    assert "spec.trainer.image: spec.trainer.tuning full sends the weights to the vllm server over nccl" in (
        status["message"]), status["message"]
    assert "has no vLLM" in status["message"] and "ENGINE=vllm" in status["message"], status["message"]
    assert [c["role"] for c in children(run_dir)] == ["initializer"], children(run_dir)


def test_a_server_that_cannot_run_its_engine_fails_the_run_at_once_without_a_retry(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """`server.engine: vllm` where vLLM is not installed: the server exits with code 2 in its own words, and the
    run fails as InvalidSpec at once, not after serverReadyTimeoutSeconds, with no other attempt and no trainer
    (a missing capability is permanent; issue 29)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the engine may start")
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["server"] = {**doc["spec"].get("server", {}), "engine": "vllm"}
    doc["spec"]["runPolicy"] = {**doc["spec"].get("runPolicy", {}), "backoffLimit": 3, "serverReadyTimeoutSeconds": 600}
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert time.monotonic() - started < 240, "the run waited for serverReadyTimeoutSeconds"
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"], status["attempt"]) == ("Failed", "InvalidSpec", 1), status
    assert "spec.server.engine vllm: this image has no vLLM" in status["message"], status["message"]
    assert [c["role"] for c in children(run_dir)] == ["initializer", "server"], children(run_dir)


def test_a_hung_reward_function_ends_the_attempt_at_its_deadline_naming_it(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """A reward function that never returns (a judge that does not answer) costs rewardTimeoutSeconds per
    attempt, not the run: the trainer ends with its function named, and with backoffLimit 0 the run fails."""
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["rewards"] = [{"function": "judge:never_answers"}]
    doc["spec"]["rewardCode"] = {"inline": {"judge.py": "import time\n\n"
                                            "def never_answers(completions, **kwargs):\n    time.sleep(3600)\n"}}
    doc["spec"]["trainer"]["rewardTimeoutSeconds"] = 5
    doc["spec"]["runPolicy"] = {**doc["spec"].get("runPolicy", {}), "backoffLimit": 0}
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "BackoffLimitExceeded"), status
    assert ("reward function 'judge:never_answers' did not return within spec.trainer.rewardTimeoutSeconds (5s)"
            in status["message"]), status["message"]


def test_an_empty_dataset_fails_the_run_before_any_server_saying_it_is_empty(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    path = run_file(tmp_path, tiny_model_dir, empty)
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "SourceUnavailable"), status
    assert f"spec.dataset: {empty} is empty: no rows to train on" in status["message"], status["message"]
    assert [c["role"] for c in children(run_dir)] == ["initializer"], children(run_dir)


def test_a_trainer_exiting_with_the_invalid_spec_code_ends_the_run_after_one_attempt(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """QLoRA needs a CUDA GPU, which only the trainer can tell (the initializer has none to look at): the
    trainer refuses it with exit code 2, and the run fails as InvalidSpec in its words, with backoffLimit
    unspent: one server, one trainer."""
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset, lora={"r": 8, "alpha": 16, "quantizeBase": True})
    run_dir = tmp_path / "run"
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec"), status
    assert (status["attempt"], status["failedAttempts"]) == (1, 1), status
    assert "spec.trainer.lora.quantizeBase (QLoRA) needs a CUDA GPU" in status["message"], status["message"]
    assert "exit code" not in status["message"], "the trainer's own words, not its exit code"
    roles = sorted((c["role"], c["attempt"], c["exitCode"]) for c in children(run_dir) if c["role"] != "server")
    assert roles == [("initializer", 0, 0), ("trainer", 1, 2)], children(run_dir)
    assert [c["attempt"] for c in children(run_dir) if c["role"] == "server"] == [1]
    assert not any(group_alive(c["pid"]) for c in children(run_dir)), "every child ends with the run"
