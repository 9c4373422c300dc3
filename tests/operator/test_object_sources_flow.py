"""s3:// sources through the real operator, a real API server and a real S3 service (the Versity S3 gateway): the
initializer Job the operator builds gets the credentials Secret's keys as its environment, and `grpo prepare` run
with exactly that environment and the run-config the operator rendered (in the initializer pod's stead) fetches the
model and the dataset; a wrong secret key fails the run as SourceUnavailable naming the URI, before any server."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from grpo_api.prepare_protocol import ENV_TERMINATION_LOG
from grpo_api.protocol import ENV_RUN_CONFIG
from grpo_testmodels import target_token_ids
from tests.fixtures.hub import repo_files
from tests.fixtures.object_stores import S3_ACCESS_KEY, S3_SECRET_KEY, s3_put, s3_server  # noqa: F401

from .conftest import InitializerKubelet, Kube, OperatorProcess, run_spec

REPO = Path(__file__).resolve().parents[2]


def pod_environment(kube: Kube, pod: Any) -> dict[str, str]:
    """The initializer container's variables as the kubelet would set them: literal values, and Secret keys read
    from the API server (an optional key that is missing leaves its variable unset)."""
    env: dict[str, str] = {}
    for var in pod.spec.containers[0].env or []:
        if var.value is not None:
            env[var.name] = var.value
        elif var.value_from is not None and var.value_from.secret_key_ref is not None:
            ref = var.value_from.secret_key_ref
            try:
                data = kube.core.read_namespaced_secret(ref.name, kube.namespace).data or {}
            except kube.client.ApiException as exc:
                if exc.status == 404 and ref.optional:
                    continue
                raise
            if ref.key in data:
                env[var.name] = base64.b64decode(data[ref.key]).decode()
    return env


def real_initializer(kube: Kube, work: Path) -> Any:
    """Runs `grpo prepare` in an initializer pod's stead, with the pod's environment and the run-config the
    operator put in the run's ConfigMap; returns its exit code and termination message."""

    def container(pod: Any) -> tuple[int, str]:
        env = pod_environment(kube, pod)
        volume = next(v for v in pod.spec.volumes if v.name == "run-config")
        config = kube.config_map(volume.config_map.name).data["run-config.yaml"]
        config_file, termination = work / f"{pod.metadata.name}.yaml", work / f"{pod.metadata.name}.termination"
        config_file.write_text(config)
        env.pop(ENV_RUN_CONFIG, None)
        proc = subprocess.run([sys.executable, "-m", "grpo_cli.main", "prepare", "--config", str(config_file)],
                              env={**os.environ, **env, ENV_TERMINATION_LOG: str(termination)}, cwd=REPO,
                              capture_output=True, text=True, timeout=300, check=False)
        (work / f"{pod.metadata.name}.log").write_text(proc.stdout + proc.stderr)
        return proc.returncode, termination.read_text() if termination.is_file() else proc.stderr[-1000:]

    return container


@pytest.fixture
def bucket(s3_server: str, tiny_model_dir: Path, tiny_dataset: Path) -> str:  # noqa: F811
    name = "cluster-sources"
    s3_put(s3_server, name, {**{f"models/tiny/{file}": data for file, data in repo_files(tiny_model_dir).items()},
                             "data/prompts.jsonl": tiny_dataset.read_bytes()})
    return name


def s3_run(s3_server: str, bucket: str, volume: Path, model_dir: Path) -> dict[str, Any]:  # noqa: F811
    access = {"credentialsSecret": "s3-keys", "endpoint": s3_server}
    low, high = target_token_ids(model_dir)
    spec = run_spec(rewards=[{"function": "token_fraction", "args": {"low": low, "high": high}}])
    spec["model"] = {"name": "tiny", "source": f"s3://{bucket}/models/tiny", "dtype": "float32", "s3": access}
    spec["dataset"] = {"source": f"s3://{bucket}/data", "path": "prompts.jsonl", "s3": access}
    spec["storage"] = {"size": "1Gi", "mountPath": str(volume)}
    return spec


def make_secret(kube: Kube, secret_key: str) -> None:
    kube.core.create_namespaced_secret(kube.namespace, {
        "metadata": {"name": "s3-keys"}, "stringData": {"accessKeyId": S3_ACCESS_KEY, "secretAccessKey": secret_key}})


def test_the_initializer_fetches_model_and_dataset_from_s3_with_the_secret_it_is_given(
    kube: Kube, operator: OperatorProcess, initializers: InitializerKubelet, s3_server: str, bucket: str,  # noqa: F811
    tiny_model_dir: Path, tmp_path: Path,
) -> None:
    make_secret(kube, S3_SECRET_KEY)
    initializers.containers["s3"] = real_initializer(kube, tmp_path)
    kube.create_run("s3", spec=s3_run(s3_server, bucket, tmp_path / "volume", tiny_model_dir))

    status = kube.wait_phase("s3", "StartingServer", timeout=240)

    assert status["reason"] == "SourcesReady" and status["sources"]["ready"], status
    init = kube.job("s3-init").spec.template.spec.containers[0]
    refs = {e.name: (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key)
            for e in init.env if e.name.startswith("GRPO_S3_")}
    assert refs == {f"GRPO_S3_{role}_{name}": ("s3-keys", key) for role in ("MODEL", "DATASET")
                    for name, key in (("ACCESS_KEY_ID", "accessKeyId"), ("SECRET_ACCESS_KEY", "secretAccessKey"),
                                      ("SESSION_TOKEN", "sessionToken"))}
    (weights,) = (tmp_path / "volume" / "objects").rglob("model.safetensors")
    assert weights.read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert f"s3://{bucket}/models/tiny" in "".join(p.read_text() for p in tmp_path.glob("*.log"))
    server = kube.deployment("s3-server").spec.template.spec.containers[0]
    assert not [e.name for e in server.env or [] if e.name.startswith("GRPO_S3_")], "only the initializer has them"


def test_a_wrong_secret_key_fails_the_run_as_source_unavailable_naming_the_uri(
    kube: Kube, operator: OperatorProcess, initializers: InitializerKubelet, s3_server: str, bucket: str,  # noqa: F811
    tiny_model_dir: Path, tmp_path: Path,
) -> None:
    make_secret(kube, "not-the-secret-key-0123456789")
    initializers.containers["s3-denied"] = real_initializer(kube, tmp_path)
    kube.create_run("s3-denied", spec=s3_run(s3_server, bucket, tmp_path / "volume", tiny_model_dir))

    status = kube.wait_phase("s3-denied", "Failed", reason="SourceUnavailable", timeout=240)

    assert f"spec.model.source s3://{bucket}/models/tiny: access denied" in status["message"], status
    assert "not-the-secret-key" not in status["message"]
    assert kube.deployment("s3-denied-server") is None, "no server for a run whose sources fail"
    assert len(kube.initializer_pods("s3-denied")) == 1, "a refused credential is not retried"
