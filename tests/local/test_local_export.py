"""`grpo run` with spec.output: the export step as a process after the trainer, a pvc:// claim as the folder
<run dir>/claims/<claim>, status.output recorded; a failed export fails the run and keeps the adapters."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.local_runs import grpo_run, run_file

pytestmark = pytest.mark.slow


def with_output(path: Path, output: dict[str, object]) -> Path:
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["output"] = output
    path.write_text(yaml.safe_dump(doc))
    return path


def test_local_run_exports_the_final_adapter_to_a_claim_folder_and_records_it(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    run_dir = tmp_path / "run"
    path = with_output(run_file(tmp_path, tiny_model_dir, tiny_dataset), {"destination": "pvc://results/final"})
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert status["phase"] == "Succeeded", status
    output = status["output"]
    target = run_dir / "claims" / "results" / "final"
    assert output["uri"] == "pvc://results/final" and output["form"] == "adapter"
    assert output["digest"] == "sha256:" + hashlib.sha256((target / "grpo-export.json").read_bytes()).hexdigest()
    assert output["size"] == sum(p.stat().st_size for p in target.iterdir())
    final = Path(output["source"])
    assert final.parent == run_dir / "adapters" / "local-test" and final.is_dir()  # the adapters stay
    assert (target / "adapter_model.safetensors").read_bytes() == (final / "adapter_model.safetensors").read_bytes()
    assert (run_dir / "logs" / "export.log").is_file()
    assert "Exporting" in (run_dir / "events.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["output"]["uri"] == "pvc://results/final" and "pvc://results/final" in out


def test_a_failed_export_fails_the_local_run_and_keeps_the_adapters(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path
) -> None:
    run_dir = tmp_path / "run"
    # Credentials refused is permanent: an OCI registry that is not there is transient, so use a claim folder
    # that holds something else.
    taken = run_dir / "claims" / "results" / "final"
    taken.mkdir(parents=True)
    (taken / "mine.txt").write_text("keep me")
    path = with_output(run_file(tmp_path, tiny_model_dir, tiny_dataset), {"destination": "pvc://results/final"})
    proc = grpo_run(path, run_dir)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())["status"]
    assert status["phase"] == "Failed" and status["reason"] == "ExportFailed", status
    assert "holds something else" in status["message"] and "adapters stay" in status["message"]
    assert "output" not in status
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert any(p.name.startswith("v") for p in (run_dir / "adapters" / "local-test").iterdir())
