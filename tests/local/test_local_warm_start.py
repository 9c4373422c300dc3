"""Warm start with `grpo run`: run B starts from run A's final adapter (spec.model.adapter), which the server serves
from step 0; an adapter of another base model fails the run before any server starts, naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from grpo_api.adapters import read_manifest
from tests.fixtures.local_runs import children, grpo_run, run_file

pytestmark = pytest.mark.slow


def _with_adapter(path: Path, adapter_dir: Path, **trainer: object) -> Path:
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["model"]["adapter"] = {"path": str(adapter_dir)}
    doc["spec"]["trainer"].update(trainer)
    path.write_text(yaml.safe_dump(doc))
    return path


def _final_adapter(run_dir: Path) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir / "adapters" / "local-test" / f"v{summary['adapterVersion']}"


def test_run_b_starts_from_run_a_final_adapter_and_a_foreign_adapter_fails_naming_the_field(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    (tmp_path / "a").mkdir()
    run_a = tmp_path / "a" / "run"
    proc = grpo_run(run_file(tmp_path / "a", tiny_model_dir, tiny_dataset, maxSteps=2), run_a)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out
    a_final = _final_adapter(run_a)
    a_weights = read_manifest(a_final).files["adapter_model.safetensors"]

    # B: the same base model, starting from A's last version.
    (tmp_path / "b").mkdir()
    run_b = tmp_path / "b" / "run"
    proc = grpo_run(_with_adapter(run_file(tmp_path / "b", tiny_model_dir, tiny_dataset, maxSteps=1), a_final),
                    run_b)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out
    trainer_log = (run_b / "logs" / "trainer-attempt-1.log").read_text()
    assert f"warm start from {a_final}" in trainer_log, trainer_log
    # The first version B publishes, at step 0 and before its first step, holds exactly A's final weights, and the
    # server serves it: a fresh server starts without an adapter, the trainer waits for the version to be active.
    warm = re.search(r"published adapter v1 \(step 0, warm start from spec\.model\.adapter\).*weights (\S+)",
                     trainer_log)
    assert warm is not None, trainer_log
    assert warm.group(1) == a_weights, (warm.group(1), a_weights)
    assert trainer_log.index(warm.group(0)) < trainer_log.index("step 1/1"), trainer_log
    summary = json.loads((run_b / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["adapterVersion"] == 2, summary  # v1 warm, v2 after step 1
    # B's adapter has A's shape (the adapter's config decides it, as PeftModel.from_pretrained does).
    b_config = json.loads((_final_adapter(run_b) / "adapter_config.json").read_text())
    a_config = json.loads((a_final / "adapter_config.json").read_text())
    assert (b_config["r"], b_config["lora_alpha"]) == (a_config["r"], a_config["lora_alpha"])

    # C: another base model of the same shapes (other weights): A's manifest names A's base model.
    from grpo_testmodels import make_model

    other_model = make_model(tmp_path / "other-model", preset="tiny", seed=1)
    (tmp_path / "c").mkdir()
    run_c = tmp_path / "c" / "run"
    proc = grpo_run(_with_adapter(run_file(tmp_path / "c", other_model, tiny_dataset, maxSteps=1), a_final), run_c)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    status = json.loads((run_c / "status.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "SourceUnavailable"), status
    assert "spec.model.adapter" in status["message"] and "another base model" in status["message"], status
    assert [c["role"] for c in children(run_c)] == ["initializer"], children(run_c)
