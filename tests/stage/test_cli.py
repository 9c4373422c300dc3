"""`grpo stage` end to end against a fake API whose exec runs the real receiver as a local process
(a temporary directory stands for the claim), and its argument checks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from grpo_cli.main import COMMANDS, cli
from grpo_stage import cli as stage_cli
from grpo_stage import kube
from grpo_stage import manifests as m

RUNNING = {"status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}}


class FakeSock:
    def settimeout(self, seconds: float) -> None:
        assert seconds > 0


class FakeExec:
    """A WSClient stand-in: stdin to the receiver process, its stdout/stderr/exit status back."""

    def __init__(self, args: list[str], env: dict[str, str], tamper: Any = None) -> None:
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.sock = FakeSock()
        self.tamper = tamper
        self.channels: dict[int, bytes] | None = None
        self.closed = False

    def is_open(self) -> bool:
        return self.channels is None and not self.closed

    def write_stdin(self, data: bytes) -> None:
        assert type(data) is bytes  # WSClient sends anything else as text
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def update(self, timeout: float = 0) -> None:
        if self.proc.poll() is None and timeout:
            time.sleep(min(timeout, 0.02))
        if self.proc.poll() is None or self.channels is not None:
            return
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out, err = self.proc.stdout.read(), self.proc.stderr.read()
        if self.tamper is not None:
            out = self.tamper(out)
        code = self.proc.returncode
        status = (
            {"status": "Success"}
            if code == 0
            else {
                "status": "Failure",
                "message": f"command terminated with non-zero exit code: exit status {code}",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
            }
        )
        self.channels = {1: out, 2: err, 3: json.dumps(status).encode()}

    def close_channel(self, channel: int) -> None:
        assert channel == 0
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def read_channel(self, channel: int, timeout: float = 0) -> bytes:
        return (self.channels or {}).pop(channel, b"")

    def close(self) -> None:
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class FakeApi:
    def __init__(self, root: Path, claim: bool = True, pod_states: list[dict[str, Any]] | None = None) -> None:
        self.root = root
        self.claim = claim
        self.pod_states = pod_states or [RUNNING]
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.execs: list[FakeExec] = []
        self.tamper: Any = None

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"metadata": {"name": name}, "status": {"phase": "Bound"}} if self.claim else None

    def create(self, manifest: dict[str, Any]) -> None:
        self.created.append(manifest)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.pod_states.pop(0) if len(self.pod_states) > 1 else self.pod_states[0]

    def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append((namespace, name))

    def open_exec(self, namespace: str, name: str, command: list[str]) -> FakeExec:
        pod = next(p for p in self.created if p["kind"] == "Pod")
        assert pod["metadata"]["name"] == name
        (container,) = pod["spec"]["containers"]
        assert command[:2] == ["python3", "-c"] and command[3] == m.MOUNT_PATH
        env = {e["name"]: e["value"] for e in container["env"]}
        ws = FakeExec([sys.executable, "-S", "-c", command[2], str(self.root), *command[4:]], env, self.tamper)
        self.execs.append(ws)
        return ws

    def pod_names(self) -> list[str]:
        return [p["metadata"]["name"] for p in self.created if p["kind"] == "Pod"]


@pytest.fixture
def claim_root(tmp_path: Path) -> Path:
    root = tmp_path / "claim"
    root.mkdir()
    return root


def run(api: FakeApi, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(kube, "load_client", lambda kubeconfig, context: (object(), "team-a"))
    monkeypatch.setattr(kube, "StageApi", lambda api_client: api)
    return CliRunner().invoke(stage_cli.stage, ["--claim", "grpo-data", *args])


def test_stage_copies_verifies_and_deletes_its_pod(
    model_dir: Path, dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeApi(claim_root, pod_states=[{"status": {"phase": "Pending"}}, RUNNING])
    result = run(api, monkeypatch, f"{model_dir}:models/my-model", f"{dataset_file}:datasets/prompts.jsonl")

    assert result.exit_code == 0, result.output
    assert (claim_root / "models/my-model/model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()
    assert (claim_root / "datasets/prompts.jsonl").read_bytes() == dataset_file.read_bytes()
    assert "staged 5 files" in result.output and "grpo-data" in result.output and "team-a" in result.output
    assert "100%" in result.output  # progress (CliRunner mixes stderr in)
    (pod,) = [p for p in api.created if p["kind"] == "Pod"]
    assert pod["metadata"]["namespace"] == "team-a"
    assert pod["metadata"]["name"].startswith("grpo-stage-")
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "grpo-data"
    assert pod["spec"]["containers"][0]["image"] == stage_cli.DEFAULT_IMAGE
    assert api.deleted == [("team-a", pod["metadata"]["name"])]
    assert all(ws.closed for ws in api.execs)


def test_stage_quiet_prints_only_the_summary(
    dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeApi(claim_root)
    result = run(api, monkeypatch, "--quiet", f"{dataset_file}:p.jsonl")
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1 and "staged 1 file " in result.output


def test_stage_creates_a_missing_claim_with_create(
    dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeApi(claim_root, claim=False)
    result = run(
        api,
        monkeypatch,
        "--create",
        "10Gi",
        "--storage-class",
        "nfs",
        "--access-mode",
        "ReadWriteMany",
        f"{dataset_file}:datasets/prompts.jsonl",
    )
    assert result.exit_code == 0, result.output
    (claim,) = [p for p in api.created if p["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"] == {
        "name": "grpo-data",
        "namespace": "team-a",
        "labels": {"app.kubernetes.io/managed-by": "grpo-stage"},
    }
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "10Gi"}},
        "storageClassName": "nfs",
    }
    assert "created PersistentVolumeClaim grpo-data in namespace team-a" in result.output


def test_stage_without_create_names_the_missing_claim(
    dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeApi(claim_root, claim=False)
    result = run(api, monkeypatch, "-n", "team-b", f"{dataset_file}:p.jsonl")
    assert result.exit_code == 1
    assert "PersistentVolumeClaim grpo-data not found in namespace team-b (pass --create SIZE" in result.output
    assert api.created == []


def test_stage_reports_why_the_pod_cannot_run_and_deletes_it(
    dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = {"reason": "ErrImageNeverPull", "message": 'image "x" is not present with pull policy of Never'}
    api = FakeApi(
        claim_root,
        pod_states=[{"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": waiting}}]}}],
    )
    result = run(api, monkeypatch, "--image", "x", "--image-pull-policy", "Never", f"{dataset_file}:p.jsonl")
    assert result.exit_code == 1
    (name,) = api.pod_names()
    assert f"staging pod {name} in namespace team-a cannot run: Pending: ErrImageNeverPull" in result.output
    assert api.deleted == [("team-a", name)]


def test_stage_start_timeout_names_the_waiting_reason(
    dataset_file: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}
    api = FakeApi(
        claim_root,
        pod_states=[{"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": waiting}}]}}],
    )
    result = run(api, monkeypatch, "--start-timeout", "1", f"{dataset_file}:p.jsonl")
    assert result.exit_code == 1
    assert "did not start within 1s: Pending: ImagePullBackOff: Back-off pulling image" in result.output
    assert len(api.deleted) == 1


def test_wait_running_polls_until_the_deadline(claim_root: Path) -> None:
    unschedulable = {
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
            ],
        }
    }
    api = FakeApi(claim_root, pod_states=[unschedulable])
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    with pytest.raises(
        kube.StageError, match=r"pod p in namespace ns did not start within 300s: Pending: Unschedulable: 0/3"
    ):
        kube.wait_running(api, "ns", "p", 300, sleep=sleep, clock=lambda: now[0])  # type: ignore[arg-type]
    assert len(sleeps) == 300
    api = FakeApi(claim_root, pod_states=[unschedulable, unschedulable, RUNNING])
    kube.wait_running(api, "ns", "p", 300, sleep=sleep, clock=lambda: now[0])  # type: ignore[arg-type]


def test_stage_reports_the_receivers_refusal(
    model_dir: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The receiver is told another destination: it refuses the first member and ends while the
    # stream is still being written (a broken pipe here, a closed websocket on a cluster).
    monkeypatch.setattr(
        stage_cli, "receiver_command", lambda stage_id, dests: m.receiver_command(stage_id, ["elsewhere"])
    )
    api = FakeApi(claim_root)
    result = run(api, monkeypatch, f"{model_dir}:models/my-model")
    assert result.exit_code == 1
    (name,) = api.pod_names()
    assert f"the receiver in pod {name} in namespace team-a failed (exit code 2)" in result.output
    assert "member 'models/my-model' is not under a destination" in result.output
    assert list(claim_root.iterdir()) == []
    assert api.deleted == [("team-a", name)]


def test_stage_compares_the_receivers_manifest(
    model_dir: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tamper(out: bytes) -> bytes:
        manifest = json.loads(out)
        manifest["models/my-model/config.json"]["sha256"] = "0" * 64
        del manifest["models/my-model/run.sh"]
        return json.dumps(manifest).encode()

    api = FakeApi(claim_root)
    api.tamper = tamper
    result = run(api, monkeypatch, f"{model_dir}:models/my-model")
    assert result.exit_code == 1
    assert "claim grpo-data does not hold what was sent" in result.output
    assert "models/my-model/config.json: sha256 on the claim 000" in result.output
    assert "models/my-model/run.sh: missing on the claim" in result.output
    assert len(api.deleted) == 1


def test_stage_deletes_its_pod_on_ctrl_c(model_dir: Path, claim_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(self: Any, name: str, n: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(stage_cli.Progress, "advance", interrupt)
    api = FakeApi(claim_root)
    result = run(api, monkeypatch, f"{model_dir}:models/my-model")
    assert result.exit_code == 1 and "Aborted" in result.output
    assert len(api.deleted) == 1
    (ws,) = api.execs
    assert ws.closed and ws.proc.returncode is not None
    assert list(claim_root.iterdir()) == []  # the receiver saw the stream end early and cleaned up


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["./m:/abs"], "DEST '/abs' is absolute"),
        (["./m:models/../x"], "contains '..'"),
        (["./m:models//x"], "empty or '.' part"),
        (["./m"], "is not SRC:DEST"),
        (["./a:models", "./b:models/b"], "lies inside DEST"),
        (["--storage-class", "nfs", "./m:m"], "only apply with --create"),
        (["--create", "ten", "./m:m"], "'ten' is not a storage size"),
        (["--access-mode", "ReadOnlyMany", "--create", "1Gi", "./m:m"], "ReadOnlyMany"),
    ],
)
def test_stage_argument_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(stage_cli.stage, ["--claim", "c", *args])
    assert result.exit_code == 2
    assert message in result.output
    if "DEST" in message or "SRC" in message:
        assert "SRC:DEST" in result.output  # names the argument


def test_stage_names_a_missing_source(tmp_path: Path) -> None:
    result = CliRunner().invoke(stage_cli.stage, ["--claim", "c", f"{tmp_path}/nope:models/x"])
    assert result.exit_code == 1
    assert f"SRC {tmp_path}/nope does not exist (argument {tmp_path}/nope:models/x)" in result.output


def test_stage_is_a_grpo_subcommand() -> None:
    assert COMMANDS["stage"][:2] == ("grpo_stage.cli:stage", "cli")
    result = CliRunner().invoke(cli, ["stage", "--help"])
    assert result.exit_code == 0
    assert "--claim" in result.output and "SRC:DEST" in result.output


def test_load_client_takes_the_namespace_of_the_kubeconfig_context(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "a", "context": {"cluster": "c", "user": "u", "namespace": "team-a"}},
                    {"name": "b", "context": {"cluster": "c", "user": "u"}},
                ],
                "current-context": "a",
            }
        )
    )
    api_client, namespace = kube.load_client(str(kubeconfig), None)
    assert namespace == "team-a"
    assert api_client.configuration.host == "https://10.0.0.1:6443"
    assert kube.load_client(str(kubeconfig), "b")[1] == "default"
    with pytest.raises(kube.StageError, match="cannot load the kubeconfig"):
        kube.load_client(str(tmp_path / "missing"), None)


def test_api_message_names_the_rbac_it_needs() -> None:
    exc = kube.ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"message": 'pods "grpo-stage-1" is forbidden: User "me" cannot create resource "pods"'})
    message = kube.api_message(exc)
    assert message.startswith('403 pods "grpo-stage-1" is forbidden')
    assert "create pods/exec" in message
