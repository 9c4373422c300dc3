"""`grpo run` with its model, dataset and reward code in an S3 bucket (the Versity S3 gateway, real SigV4): the
initializer fetches them into the run directory with `grpo run`'s own AWS_* variables, and the server and trainer
read what it fetched; a missing key fails the run as SourceUnavailable naming the URI, before any server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.hub import repo_files
from tests.fixtures.local_runs import grpo_run, run_file
from tests.fixtures.object_stores import S3_ACCESS_KEY, S3_SECRET_KEY, s3_put, s3_server  # noqa: F401

pytestmark = pytest.mark.slow

REWARD = "def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n"


def s3_run_file(tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path, endpoint: str, bucket: str,
                dataset_key: str = "prompts.jsonl") -> Path:
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset)
    doc = yaml.safe_load(path.read_text())
    spec = doc["spec"]
    access = {"endpoint": endpoint, "region": "us-east-1"}
    spec["model"] = {"name": "tiny", "source": f"s3://{bucket}/models/tiny", "s3": access}
    spec["dataset"] = {"source": f"s3://{bucket}/data", "path": dataset_key, "s3": access}
    spec["rewards"].append({"function": "s3_rewards:zero", "weight": 0.5})
    spec["rewardCode"] = {"source": f"s3://{bucket}/code", "s3": access}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """`grpo run`'s own environment holds the credentials (there are no Secrets); its children inherit it."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)


@pytest.fixture
def bucket(s3_server: str, tiny_model_dir: Path, tiny_dataset: Path) -> str:  # noqa: F811
    name = "local-sources"
    s3_put(s3_server, name, {**{f"models/tiny/{file}": data for file, data in repo_files(tiny_model_dir).items()},
                             "data/prompts.jsonl": tiny_dataset.read_bytes(), "code/s3_rewards.py": REWARD.encode()})
    return name


def test_a_local_run_trains_on_a_model_dataset_and_reward_code_fetched_from_s3(
    s3_server: str, bucket: str, s3_credentials: None, tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
    tiny_dataset: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = grpo_run(s3_run_file(tmp_path, tiny_model_dir, tiny_dataset, s3_server, bucket), run_dir)
    out, _ = proc.communicate(timeout=480)

    assert proc.returncode == 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert status["phase"] == "Succeeded", status
    fetched = {p.relative_to(run_dir / "objects").parts[0] for p in (run_dir / "objects").rglob("model.safetensors")}
    assert len(fetched) == 1 and next(iter(fetched)).startswith(f"{bucket}--models--tiny-")
    assert list((run_dir / "objects").rglob("s3_rewards.py"))
    assert S3_SECRET_KEY not in out + (run_dir / "logs" / "initializer.log").read_text()


def test_a_missing_key_fails_the_local_run_as_source_unavailable_naming_the_uri_before_any_server(
    s3_server: str, bucket: str, s3_credentials: None, tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
    tiny_dataset: Path,
) -> None:
    run_dir = tmp_path / "run"
    path = s3_run_file(tmp_path, tiny_model_dir, tiny_dataset, s3_server, bucket, dataset_key="missing.jsonl")
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=240)

    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert status["phase"] == "Failed" and status["reason"] == "SourceUnavailable", status
    assert f"spec.dataset.source s3://{bucket}/data: no such key" in status["message"], status
    assert not list((run_dir / "logs").glob("server*"))
