"""The cluster CLI without a cluster: status rendering, `wait`'s decisions and exit codes, which pod `logs`
reads, `pull` end to end against a fake API whose exec runs the real sender on a local directory (the
claim), the kubectl plugin, and that none of it imports torch."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from grpo_api.adapters import MANIFEST_NAME, AdapterManifest, file_digest
from grpo_cli.cluster import commands, outcome, pull, render
from grpo_cli.cluster import logs as pod_logs
from grpo_cli.cluster.client import ClusterError
from grpo_cli.main import COMMANDS, cli
from grpo_stage import kube as stage_kube
from grpo_stage import manifests as stage_manifests

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 12, 10, 12, 0, 0, tzinfo=dt.UTC)
CLUSTER_COMMANDS = ("get", "status", "logs", "wait", "pull", "suspend", "resume", "cancel")


def ago(seconds: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def a_run(name: str = "tiny", phase: str = "Training", **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": name, "namespace": "team-a", "uid": "u-1", "creationTimestamp": ago(600),
                     "resourceVersion": "7"},
        "spec": {"runPolicy": {"backoffLimit": 2}, "server": {"replicas": 2}, "trainer": {}},
        "status": {"phase": phase, **status},
    }


def training_status() -> dict[str, Any]:
    return {
        "reason": "TrainerRunning",
        "message": "trainer of attempt 2 running",
        "attempt": 2,
        "failedAttempts": 1,
        "progress": {"step": 12, "maxSteps": 30, "rewardMean": 0.4123,
                     "laggingReplicas": [{"url": "http://10.0.0.7:8000", "since": ago(40), "reason": "restarted"}]},
        "adapter": {"version": 12, "path": "/data/adapters/tiny/v12", "loadedAt": ago(3)},
        "server": {"ready": True, "readyReplicas": 2},
        "sources": {"ready": True},
        "startTime": ago(590),
        "conditions": [{"type": "ServerReady", "status": "True", "reason": "HealthCheckPassed",
                        "lastTransitionTime": ago(300), "message": "2 replicas answer"}],
    }


def event(reason: str, seconds: float, type_: str = "Normal", count: int = 1) -> dict[str, Any]:
    return {"reason": reason, "type": type_, "message": f"{reason} happened", "lastTimestamp": ago(seconds),
            "count": count}


# ------------------------------------------------------------------------------------------ render


def test_status_shows_phase_step_reward_adapter_staleness_and_the_latest_events() -> None:
    events = [event(f"E{i}", 1000 - i) for i in range(15)] + [event("ServerRestarted", 30, "Warning", 2)]
    text = render.status_text(a_run(**training_status()), events, NOW, events_shown=4)
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in text.splitlines()
             if ":" in line and not line.startswith(" ")}
    assert lines["Run"] == "tiny in namespace team-a"
    assert lines["Phase"] == "Training (TrainerRunning)"
    assert lines["Attempt"] == "2 (1 failed, backoffLimit 2)"
    assert lines["Step"] == "12/30" and lines["Reward"] == "0.4123"
    assert lines["Adapter"] == "v12, loaded 3s ago (/data/adapters/tiny/v12)"
    assert lines["Staleness"] == "1 replica behind: http://10.0.0.7:8000 lags since 40s (restarted)"
    assert lines["Server"] == "ready, 2/2 replicas"
    assert "ServerReady   True     HealthCheckPassed   5m" in text
    assert "Events (the last 4 of 16):" in text
    event_lines = text.split("Events (the last 4 of 16):")[1].strip().splitlines()
    assert event_lines[0].split() == ["AGE", "TYPE", "REASON", "MESSAGE"] and len(event_lines) == 5
    assert [line.split()[1] for line in event_lines[1:4]] == ["Normal"] * 3  # oldest first: E12, E13, E14
    assert "E12" in event_lines[1] and "E14" in event_lines[3]
    assert "30s (x2)" in event_lines[-1] and "Warning" in event_lines[-1] and "ServerRestarted" in event_lines[-1]


def test_status_of_a_run_the_operator_has_not_seen_yet() -> None:
    run = a_run()
    run["status"] = None
    text = render.status_text(run, [], NOW)
    assert "Phase:" in text and "Pending" in text
    assert "Adapter:    none published yet" in text and "Events: none" in text


def test_status_names_an_asked_suspend_and_the_completion() -> None:
    run = a_run(phase="Training")
    run["spec"]["runPolicy"]["suspend"] = True
    assert "the operator has not suspended it yet" in render.status_text(run, [], NOW)
    done = a_run(phase="Succeeded", startTime=ago(400), completionTime=ago(100))
    assert "Completed:  100s ago, after 5m" in render.status_text(done, [], NOW)


def test_an_unreadable_status_is_named_with_its_field() -> None:
    with pytest.raises(render.StatusUnreadable, match=r"GRPORun tiny: status.progress.step"):
        render.status_text(a_run(progress={"step": "many"}), [], NOW)


def test_get_lists_runs_sorted_with_kubectl_columns() -> None:
    runs = [a_run("b", **training_status()), a_run("a", phase="Pending")]
    lines = render.runs_table(runs, NOW).splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "ADAPTER", "ATTEMPT", "AGE"]
    assert lines[1].split() == ["a", "Pending", "0", "-", "-", "0", "10m"]
    assert lines[2].split() == ["b", "Training", "12/30", "0.4123", "v12", "2", "10m"]
    assert render.runs_table(runs, NOW, all_namespaces=True).splitlines()[1].split()[:2] == ["team-a", "a"]


@pytest.mark.parametrize(("seconds", "text"), [(5, "5s"), (119, "119s"), (120, "2m"), (7199, "119m"),
                                               (7200, "2h"), (3 * 86400, "3d")])
def test_ages_are_kubectls(seconds: int, text: str) -> None:
    assert render.age(NOW - dt.timedelta(seconds=seconds), NOW) == text


# ------------------------------------------------------------------------------------------- wait


@pytest.mark.parametrize(
    ("target", "status", "expected"),
    [
        ("Succeeded", {"phase": "Succeeded"}, outcome.Outcome.MET),
        ("Succeeded", {"phase": "Training"}, outcome.Outcome.WAITING),
        ("Succeeded", {"phase": "Failed", "reason": "BackoffLimitExceeded"}, outcome.Outcome.FAILED),
        ("Failed", {"phase": "Failed"}, outcome.Outcome.MET),
        ("Failed", {"phase": "Succeeded"}, outcome.Outcome.ENDED),
        ("suspended", {"phase": "Suspended"}, outcome.Outcome.MET),
        ("Suspended", {"phase": "Succeeded"}, outcome.Outcome.ENDED),
        ("Training", {}, outcome.Outcome.WAITING),
        ("phase=Pending", {}, outcome.Outcome.MET),
        ("condition=ServerReady", {"phase": "Training", "conditions": [
            {"type": "ServerReady", "status": "True"}]}, outcome.Outcome.MET),
        ("condition=ServerReady", {"phase": "StartingServer", "conditions": [
            {"type": "ServerReady", "status": "False"}]}, outcome.Outcome.WAITING),
        ("condition=serverready=false", {"phase": "StartingServer", "conditions": [
            {"type": "ServerReady", "status": "False"}]}, outcome.Outcome.MET),
        ("condition=Succeeded", {"phase": "Failed", "conditions": [
            {"type": "Failed", "status": "True"}]}, outcome.Outcome.FAILED),
    ],
)
def test_wait_decides_from_the_run_object(target: str, status: dict[str, Any], expected: outcome.Outcome) -> None:
    result, said = outcome.decide(outcome.parse_target(target), {"status": status})
    assert result is expected
    assert said.startswith(status.get("phase", "Pending"))


def test_wait_exit_codes_are_distinct_and_documented() -> None:
    codes = [outcome.EXIT_MET, outcome.EXIT_FAILED, outcome.EXIT_TIMEOUT, outcome.EXIT_ENDED]
    assert len(set(codes) | {1, 2}) == 6 and outcome.EXIT_MET == 0
    text = CliRunner().invoke(cli, ["wait", "--help"]).output
    for code, words in ((3, "Failed"), (4, "--timeout"), (5, "Succeeded without")):
        assert any(line.strip().startswith(f"{code} ") and words in line for line in text.splitlines()), text


@pytest.mark.parametrize("bad", ["Done", "condition=Ready", "condition=ServerReady=yes", "reason=X"])
def test_wait_refuses_an_unknown_target(bad: str) -> None:
    with pytest.raises(ValueError, match=r"unknown|not True|give a phase"):
        outcome.parse_target(bad)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("1h30m", 5400),
                                               ("0", 0), ("1.5h", 5400)])
def test_wait_timeout_takes_kubectl_durations(text: str, seconds: float) -> None:
    assert outcome.parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "soon", "5x", "-1m", "m"])
def test_wait_timeout_refuses_what_is_no_duration(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        outcome.parse_duration(bad)


# ------------------------------------------------------------------------------------------- logs


def a_pod(name: str, attempt: int, started: bool = True, index: int | None = None,
          waiting: str = "ContainerCreating") -> dict[str, Any]:
    state = {"running": {}} if started else {"waiting": {"reason": waiting}}
    meta: dict[str, Any] = {"name": name, "labels": {"grpo.dev/attempt": str(attempt)}, "annotations": {},
                            "creationTimestamp": ago(100 - attempt)}
    if index is not None:
        meta["annotations"][pod_logs.COMPLETION_INDEX] = str(index)
    return {"metadata": meta, "status": {"phase": "Running" if started else "Pending",
                                         "containerStatuses": [{"state": state}]}}


def test_logs_reads_the_latest_attempts_pod_and_rank_0_of_several_nodes() -> None:
    pods = [a_pod("t-1", 1), a_pod("t-2-1", 2, index=1), a_pod("t-2-0", 2, index=0)]
    assert pod_logs.choose(pods, "tiny", "team-a", "trainer") == pod_logs.Choice("t-2-0", None)


def test_logs_says_when_there_is_no_pod_or_it_has_not_started() -> None:
    none = pod_logs.choose([], "tiny", "team-a", "trainer")
    assert none.pod is None and none.waiting == "no trainer pod of GRPORun tiny in namespace team-a yet"
    pending = pod_logs.choose([a_pod("s-1", 1, started=False, waiting="ImagePullBackOff")], "tiny", "team-a",
                              "server")
    assert pending.waiting is not None
    assert "server pod s-1 of GRPORun tiny in namespace team-a has not started yet" in pending.waiting
    assert "ImagePullBackOff" in pending.waiting
    ended = a_pod("t-1", 1, started=False)
    ended["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 1}}
    assert pod_logs.choose([ended], "tiny", "team-a", "trainer").waiting is None


# ------------------------------------------------------------------------------------------- pull


class Sock:
    def settimeout(self, seconds: float) -> None:
        assert seconds > 0


class FakeExec:
    """A WSClient stand-in: the sender ran to its end as a local process; its output comes in frames."""

    FRAME = 1 << 16

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        done = subprocess.run(args, capture_output=True, env=env, check=False, timeout=60)
        status = {"status": "Success"} if done.returncode == 0 else {
            "status": "Failure", "message": f"command terminated with non-zero exit code: {done.returncode}",
            "details": {"causes": [{"reason": "ExitCode", "message": str(done.returncode)}]}}
        self.frames = [(1, done.stdout[i:i + self.FRAME]) for i in range(0, len(done.stdout), self.FRAME)]
        self.frames += [(2, done.stderr), (3, json.dumps(status).encode())]
        self.channels: dict[int, bytes] = {}
        self.sock = Sock()
        self.closed = False

    def is_open(self) -> bool:
        return bool(self.frames) and not self.closed

    def update(self, timeout: float = 0) -> None:
        if self.frames:
            channel, data = self.frames.pop(0)
            self.channels[channel] = self.channels.get(channel, b"") + data

    def read_channel(self, channel: int, timeout: float = 0) -> bytes:
        return self.channels.pop(channel, b"")

    def close(self) -> None:
        self.closed = True


class FakePods:
    def __init__(self, claim_root: Path) -> None:
        self.root = claim_root
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    def create(self, manifest: dict[str, Any]) -> None:
        self.created.append(manifest)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return {"status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}}

    def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append(name)

    def open_exec(self, namespace: str, name: str, command: list[str]) -> FakeExec:
        (pod,) = self.created
        assert pod["metadata"]["name"] == name and command[:2] == ["python3", "-c"]
        assert command[3] == stage_manifests.MOUNT_PATH
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        return FakeExec([sys.executable, "-S", "-c", command[2], str(self.root), *command[4:]], env)


class FakeCluster:
    def __init__(self, run: dict[str, Any] | None) -> None:
        self.run = run
        self.namespace = "team-a"
        self.api_client = object()

    def where(self, name: str) -> str:
        return f"GRPORun {name} in namespace {self.namespace}"

    def get_run(self, name: str) -> dict[str, Any]:
        if self.run is None:
            raise ClusterError(f"{self.where(name)} not found")
        return self.run


def publish(claim: Path, run: str, version: int, files: dict[str, bytes], *,
            sha256: bool = False) -> AdapterManifest:
    """A published version; `sha256`: with the bare sha256 digests manifests carried before BLAKE3."""
    directory = claim / "adapters" / run / f"v{version}"
    directory.mkdir(parents=True)
    for rel, data in files.items():
        (directory / rel).write_bytes(data)
    digests = {rel: hashlib.sha256(data).hexdigest() if sha256 else file_digest(directory / rel)
               for rel, data in files.items()}
    manifest = AdapterManifest(version=version, step=version * 2, base_model_fingerprint="f" * 64,
                               files=digests, created_at=NOW)
    (directory / MANIFEST_NAME).write_text(manifest.model_dump_json())
    return manifest


ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 2048}


@pytest.fixture
def claim(tmp_path: Path) -> Path:
    root = tmp_path / "claim"
    root.mkdir()
    return root


def invoke_pull(monkeypatch: pytest.MonkeyPatch, cluster: FakeCluster, pods: FakePods, *args: str) -> Any:
    monkeypatch.setattr(commands.ClusterApi, "connect", classmethod(lambda cls, k, c, n: cluster))
    monkeypatch.setattr(stage_kube, "StageApi", lambda api_client: pods)
    return CliRunner().invoke(cli, ["pull", *args])


def test_pull_copies_the_newest_adapter_verified_and_deletes_its_pod(
    claim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(claim, "tiny", 29, {"adapter_config.json": b"old"})
    manifest = publish(claim, "tiny", 30, ADAPTER)
    (claim / "adapters" / "tiny" / ".tmp-v31").mkdir()  # an unfinished publish is no version
    pods, dest = FakePods(claim), tmp_path / "out"
    result = invoke_pull(monkeypatch, FakeCluster(a_run()), pods, "tiny", str(dest))
    assert result.exit_code == 0, result.output
    assert "adapter v30 (step 60) of GRPORun tiny in namespace team-a" in result.output
    assert "2 files" in result.output and "each verified" in result.output
    assert {p.name for p in dest.iterdir()} == {*ADAPTER, MANIFEST_NAME}
    assert (dest / "adapter_model.safetensors").read_bytes() == ADAPTER["adapter_model.safetensors"]
    assert AdapterManifest.model_validate_json((dest / MANIFEST_NAME).read_text()) == manifest
    (pod,) = pods.created
    assert pods.deleted == [pod["metadata"]["name"]] and pod["metadata"]["name"].startswith("grpo-pull-")
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "tiny-data", "readOnly": True}
    assert pod["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] is True
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch left


def test_pull_takes_an_existing_claim_and_an_asked_version(
    claim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(claim, "tiny", 4, ADAPTER, sha256=True)  # an earlier manifest's sha256 digests still verify
    publish(claim, "tiny", 5, {"adapter_config.json": b"newer"})
    run = a_run()
    run["spec"]["storage"] = {"existingClaim": "shared"}
    pods = FakePods(claim)
    result = invoke_pull(monkeypatch, FakeCluster(run), pods, "tiny", str(tmp_path / "v4"), "--version", "4")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v4" / "adapter_config.json").read_bytes() == ADAPTER["adapter_config.json"]
    assert pods.created[0]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "shared"
    missing = invoke_pull(monkeypatch, FakeCluster(run), FakePods(claim), "tiny", str(tmp_path / "v9"),
                          "--version", "9")
    assert missing.exit_code == 1 and "has published no adapter v9" in missing.output
    assert "published: v4, v5" in missing.output


def test_pull_refuses_a_file_that_differs_from_the_manifest_and_keeps_dest(
    claim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(claim, "tiny", 3, ADAPTER)
    (claim / "adapters/tiny/v3/adapter_model.safetensors").write_bytes(b"corrupted")
    dest = tmp_path / "out"
    dest.mkdir()
    result = invoke_pull(monkeypatch, FakeCluster(a_run()), FakePods(claim), "tiny", str(dest))
    assert result.exit_code == 1
    assert "adapter v3 does not match its manifest" in result.output
    assert "adapter_model.safetensors: digest blake3:" in result.output and "Traceback" not in result.output
    assert list(dest.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["claim", "out"]


def test_pull_says_when_no_adapter_is_published_yet(claim: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pods = FakePods(claim)
    result = invoke_pull(monkeypatch, FakeCluster(a_run()), pods, "tiny", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert "GRPORun tiny in namespace team-a has published no adapter yet" in result.output
    assert pods.deleted and not (tmp_path / "out").exists()


def test_pull_refuses_a_non_empty_dest_unless_forced(claim: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    publish(claim, "tiny", 3, ADAPTER)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    pods = FakePods(claim)
    refused = invoke_pull(monkeypatch, FakeCluster(a_run()), pods, "tiny", str(dest))
    assert refused.exit_code == 1 and "is not empty (pass --force" in refused.output and not pods.created
    forced = invoke_pull(monkeypatch, FakeCluster(a_run()), pods, "tiny", str(dest), "--force")
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in dest.iterdir()) == sorted([*ADAPTER, MANIFEST_NAME])


def test_pull_refuses_full_tuning_and_a_missing_run(claim: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = a_run()
    run["spec"]["trainer"] = {"tuning": "full"}
    full = invoke_pull(monkeypatch, FakeCluster(run), FakePods(claim), "tiny", str(tmp_path / "out"))
    assert full.exit_code == 1 and "spec.trainer.tuning full" in full.output
    gone = invoke_pull(monkeypatch, FakeCluster(None), FakePods(claim), "tiny", str(tmp_path / "out"))
    assert gone.exit_code == 1 and "GRPORun tiny in namespace team-a not found" in gone.output


def test_the_sender_refuses_a_manifest_entry_outside_the_version(claim: Path, tmp_path: Path) -> None:
    publish(claim, "tiny", 1, ADAPTER)
    manifest = json.loads((claim / "adapters/tiny/v1" / MANIFEST_NAME).read_text())
    manifest["files"]["../../secret"] = "0" * 64
    (claim / "adapters/tiny/v1" / MANIFEST_NAME).write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-S", "-c", pull.sender_source(), str(claim), "adapters/tiny", "latest"],
                          capture_output=True, check=False)
    assert done.returncode == 2 and b"not a plain relative path" in done.stderr and done.stdout == b""


# ------------------------------------------------------------------------ registration, plugin, imports


def test_cluster_commands_are_grpo_subcommands_of_the_cli_extra() -> None:
    for name in CLUSTER_COMMANDS:
        assert COMMANDS[name][1] == "cli", name
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert "--namespace" in result.output and "--context" in result.output and "--kubeconfig" in result.output


def test_the_cli_extra_and_the_kubectl_plugin_are_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kubectl-grpo"] == "grpo_cli.main:kubectl_plugin"
    pins = {extra: {d.split("==")[0]: d for d in project["optional-dependencies"][extra]}
            for extra in ("operator", "server", "trainer")}
    # the operator's Kubernetes client, and the hash the trainer writes manifests with (grpo pull verifies them)
    assert project["optional-dependencies"]["cli"] == [pins["operator"]["kubernetes"], pins["trainer"]["blake3"]]
    assert pins["server"]["blake3"] == pins["trainer"]["blake3"]


def test_kubectl_grpo_names_itself_as_kubectl_plugin(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_cli import main

    monkeypatch.setattr(sys, "argv", ["kubectl-grpo", "wait", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main.kubectl_plugin()
    assert exit_info.value.code == 0
    assert "Usage: kubectl grpo wait [OPTIONS] RUN" in capsys.readouterr().out


def test_the_cluster_commands_import_no_torch_or_transformers() -> None:
    program = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from grpo_cli.main import cli\n"
        "import grpo_cli.cluster.commands, grpo_cli.cluster.pull\n"
        "result = CliRunner().invoke(cli, ['get', '--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'kopf') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, check=False,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_kubeconfig_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for args in (["get"], ["status", "tiny"], ["wait", "tiny"], ["logs", "tiny"], ["suspend", "tiny"]):
        result = CliRunner().invoke(cli, [*args, "--kubeconfig", str(missing)])
        assert result.exit_code == 1, (args, result.output)
        assert "cannot load the kubeconfig" in result.output and str(missing) in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
