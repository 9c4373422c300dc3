"""`grpo prepare` fetching s3:// and https:// sources: against the Versity S3 gateway (real SigV4, a real bucket
on disk) and an HTTPS file server, through boto3 and httpx, as the initializer does in a pod (credentials from the
variables the operator fills from the Secret) and as `grpo run` does (boto3's own AWS_* variables)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_api.models import GRPORun
from grpo_api.prepare_protocol import EXIT_PERMANENT, EXIT_TRANSIENT, latest_event
from grpo_api.runconfig import load_run_config
from grpo_api.sources import cluster_layout, s3_credential_env
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.folders import refuse_unsafe_names
from tests.fixtures.hub import repo_files
from tests.fixtures.object_stores import (  # noqa: F401
    S3_ACCESS_KEY,
    S3_SECRET_KEY,
    WebServer,
    s3_put,
    s3_server,
    web_server,
)
from tests.fixtures.prepare_cli import invoke, write_config

REWARD = "def share(completions, **kwargs):\n    return [0.0] * len(completions)\n"


def upload(endpoint: str, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    s3_put(endpoint, bucket, {f"{prefix}/{name}": data for name, data in files.items()})


def s3_access(endpoint: str, secret: str | None = "s3-creds") -> dict[str, Any]:
    return {"endpoint": endpoint, **({"credentialsSecret": secret} if secret else {})}


def cluster_config(tmp_path: Path, spec: dict[str, Any]) -> Path:
    """The run-config the operator renders for spec, its volume a folder of tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "storage": {"size": "1Gi", "mountPath": str(tmp_path / "volume")}}
    run = GRPORun.model_validate({"metadata": {"name": "prep"}, "spec": spec})
    layout = cluster_layout(run.spec, data_claim="prep-data", inline_rewards_configmap="prep-rewards")
    return write_config(tmp_path, spec, layout.sources)


def secret_env(monkeypatch: pytest.MonkeyPatch, *roles: str, access: str = S3_ACCESS_KEY,
               secret: str = S3_SECRET_KEY) -> None:
    """The variables the initializer's pod gets from each role's credentials Secret."""
    for role in roles:
        values = {"accessKeyId": access, "secretAccessKey": secret}
        for env, key, _ in s3_credential_env(role):
            if key in values:
                monkeypatch.setenv(env, values[key])


def s3_spec(endpoint: str, bucket: str, *, secret: str | None = "s3-creds",
            dataset_path: str = "prompts.jsonl") -> dict[str, Any]:
    return {
        "model": {"name": "tiny", "source": f"s3://{bucket}/models/tiny", "s3": s3_access(endpoint, secret)},
        "dataset": {"source": f"s3://{bucket}/data", "path": dataset_path, "s3": s3_access(endpoint, secret)},
        "rewards": [{"function": "target_share:share"}],
        "rewardCode": {"source": f"s3://{bucket}/code", "path": "rewards", "s3": s3_access(endpoint, secret)},
    }


@pytest.fixture
def bucket(s3_server: str, tiny_model_dir: Path, tiny_dataset: Path, request: pytest.FixtureRequest) -> str:  # noqa: F811
    """A bucket of its own for the test: the tiny model under models/tiny, the prompts and another file under
    data/, a reward module under code/rewards."""
    name = f"src-{abs(hash(request.node.name)) % 10**8}"
    upload(s3_server, name, "models/tiny", repo_files(tiny_model_dir))
    upload(s3_server, name, "data", {"prompts.jsonl": tiny_dataset.read_bytes(), "other/big.bin": b"x" * 4096})
    upload(s3_server, name, "code/rewards", {"target_share.py": REWARD.encode()})
    return name


def test_model_dataset_and_reward_code_come_from_s3_with_the_secrets_credentials(
    s3_server: str, bucket: str, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret_env(monkeypatch, "model", "dataset", "rewards")
    config = cluster_config(tmp_path, s3_spec(s3_server, bucket))

    result = invoke(config)

    assert result.exit_code == 0, result.output
    cfg = load_run_config(config)
    model_dir, dataset = cfg.model_dir(), cfg.dataset_path()
    assert {k: v for k, v in repo_files(model_dir).items() if not k.startswith(".cache/")} == repo_files(tiny_model_dir)
    assert dataset.read_bytes() == tiny_dataset.read_bytes()
    assert (cfg.reward_search_paths()[0] / "target_share.py").read_text() == REWARD
    # only the dataset's path was fetched of data/, and each source landed in a version folder of its own
    assert not (dataset.parent / "other").exists()
    assert len({model_dir.parent, dataset.parent, cfg.reward_search_paths()[0].parent.parent}) == 3
    assert model_dir.parent.name == "snapshots" and model_dir.parent.parent.parent.name == "objects"
    event = latest_event(result.stdout)
    assert event is not None and event.kind == "done", result.stdout
    assert S3_SECRET_KEY not in result.output


def test_a_second_prepare_keeps_the_files_and_a_changed_object_gets_a_version_folder_of_its_own(
    s3_server: str, bucket: str, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    secret_env(monkeypatch, "model", "dataset", "rewards")
    config = cluster_config(tmp_path, s3_spec(s3_server, bucket))
    assert invoke(config).exit_code == 0
    first = load_run_config(config).dataset_path()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.parent.parent.rglob("*") if p.is_file()}

    assert invoke(config).exit_code == 0
    assert load_run_config(config).dataset_path() == first
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.parent.parent.rglob("*")
            if p.is_file() and ".cache" not in p.parts} == {p: v for p, v in before.items() if ".cache" not in p.parts}

    changed = b'{"prompt": "a new prompt", "answer": "x"}\n'
    upload(s3_server, bucket, "data", {"prompts.jsonl": changed})
    result = invoke(config)

    assert result.exit_code == 0, result.output
    second = load_run_config(config).dataset_path()
    assert second != first and second.read_bytes() == changed
    assert first.read_bytes() == tiny_dataset.read_bytes()  # what an earlier run read is as it was


def test_a_wrong_secret_key_fails_for_good_naming_the_uri(
    s3_server: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    secret_env(monkeypatch, "model", "dataset", "rewards", secret="not-the-secret-0123456789")
    config = cluster_config(tmp_path, s3_spec(s3_server, bucket))

    result = invoke(config)

    assert result.exit_code == EXIT_PERMANENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.permanent is True
    assert event.message.startswith(f"spec.model.source s3://{bucket}/models/tiny: access denied ("), event.message
    assert f"at {s3_server} (HTTP 403)" in event.message
    assert "not-the-secret" not in result.output
    assert not list((tmp_path / "volume" / "objects").rglob("*.safetensors"))


def test_a_missing_key_fails_for_good_naming_the_uri(
    s3_server: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    secret_env(monkeypatch, "model", "dataset", "rewards")
    config = cluster_config(tmp_path, s3_spec(s3_server, bucket, dataset_path="missing.jsonl"))

    result = invoke(config)

    assert result.exit_code == EXIT_PERMANENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.permanent is True
    assert event.message == (f"spec.dataset.source s3://{bucket}/data: no such key: no object at or under "
                             f"s3://{bucket}/data/missing.jsonl at {s3_server}")


def test_a_missing_bucket_and_a_secret_without_its_keys_fail_for_good_naming_the_field(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    secret_env(monkeypatch, "model", "dataset", "rewards")
    result = invoke(cluster_config(tmp_path / "a", s3_spec(s3_server, "no-such-bucket")))
    assert result.exit_code == EXIT_PERMANENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.message.startswith(
        "spec.model.source s3://no-such-bucket/models/tiny: no such bucket at"), event.message

    for env, _, _ in s3_credential_env("model"):
        monkeypatch.delenv(env, raising=False)
    result = invoke(cluster_config(tmp_path / "b", s3_spec(s3_server, "no-such-bucket")))
    assert result.exit_code == EXIT_PERMANENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.message.startswith(
        "spec.model.s3.credentialsSecret: the Secret, or its key accessKeyId or secretAccessKey, does not exist"), \
        event.message


def test_an_unreachable_endpoint_fails_within_bounded_time_naming_the_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.fixtures.object_stores import free_port

    secret_env(monkeypatch, "model", "dataset", "rewards")
    endpoint = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()

    result = invoke(cluster_config(tmp_path, s3_spec(endpoint, "some-bucket")))

    assert time.monotonic() - started < 60
    assert result.exit_code == EXIT_TRANSIENT, result.output
    event = latest_event(result.stdout)
    assert event is not None and event.permanent is False
    assert event.message.startswith("spec.model.source s3://some-bucket/models/tiny: cannot connect ("), event.message


def test_grpo_run_fetches_from_s3_with_its_own_aws_variables(
    s3_server: str, bucket: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
                                        "metadata": {"name": "prep"}, "spec": s3_spec(s3_server, bucket, secret=None)}))

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    model_dir = load_run_config(run_file).model_dir()
    assert model_dir.is_relative_to(tmp_path / ".grpo" / "prep" / "objects")
    assert (model_dir / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------- https://


def web_spec(url: str, model: Path, dataset: str, module: str) -> dict[str, Any]:
    return {
        "model": {"name": "tiny", "path": str(model)},
        "dataset": {"source": f"{url}/{dataset}"},
        "rewards": [{"function": "target_share:share"}],
        "rewardCode": {"source": f"{url}/{module}"},
    }


def web_run(tmp_path: Path, spec: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
                                        "metadata": {"name": "prep"}, "spec": spec}))
    return run_file


def test_a_dataset_file_and_a_reward_module_come_from_https(
    web_server: WebServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(web_server.ca))
    (web_server.root / "data").mkdir()
    (web_server.root / "data" / "prompts.jsonl").write_bytes(tiny_dataset.read_bytes())
    (web_server.root / "target_share.py").write_text(REWARD)
    run_file = web_run(tmp_path, web_spec(web_server.url, tiny_model_dir, "data/prompts.jsonl", "target_share.py"))

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    cfg = load_run_config(run_file)
    assert cfg.dataset_path().name == "prompts.jsonl"
    assert cfg.dataset_path().read_bytes() == tiny_dataset.read_bytes()
    assert (cfg.reward_search_paths()[0] / "target_share.py").read_text() == REWARD


def test_https_files_missing_too_large_or_redirected_to_plain_http_fail_naming_the_uri(
    web_server: WebServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(web_server.ca))
    (web_server.root / "prompts.jsonl").write_bytes(tiny_dataset.read_bytes())
    (web_server.root / "big.py").write_bytes(b"#" * ((1 << 20) + 1))
    web_server.redirects["/moved.jsonl"] = "http://127.0.0.1:1/prompts.jsonl"

    cases = {
        "missing.jsonl": (f"spec.dataset.source {web_server.url}/missing.jsonl: no such file (HTTP 404)", "x.py"),
        "moved.jsonl": (f"spec.dataset.source {web_server.url}/moved.jsonl: the server redirects to http://", "x.py"),
        "prompts.jsonl": (f"spec.rewardCode.source {web_server.url}/big.py: the file has 1048577 bytes, more than",
                          "big.py"),
    }
    for i, (dataset, (message, module)) in enumerate(cases.items()):
        result = invoke(web_run(tmp_path / str(i), web_spec(web_server.url, tiny_model_dir, dataset, module)))
        assert result.exit_code == EXIT_PERMANENT, result.output
        event = latest_event(result.stdout)
        assert event is not None and event.message.startswith(message), event.message


def test_listed_names_that_climb_or_collide_are_refused() -> None:
    for name in ("../x", "/etc/passwd", "a/../../x", "a\\b", "a//b", "./a", ".cache/grpo-source.json", "a\0b"):
        with pytest.raises(PrepareFailed) as refused:
            refuse_unsafe_names("spec.model.source s3://b/p", "http://s3", [name], "prefix")
        assert refused.value.permanent and "spec.model.source s3://b/p" in str(refused.value)
    with pytest.raises(PrepareFailed, match="a file and a folder cannot have one name"):
        refuse_unsafe_names("l", "e", ["a", "a/b"], "prefix")
