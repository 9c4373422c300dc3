"""Checkpoints are resumable only once marked complete."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_trainer.checkpoints import COMPLETE_MARKER, latest_complete, mark_complete, remove_incomplete


def test_latest_complete_ignores_interrupted_checkpoints_and_they_are_removed(tmp_path: Path):
    for step in (4, 8, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"x")
    mark_complete(tmp_path / "checkpoint-4", step=4, attempt=1, adapter_version=2)
    mark_complete(tmp_path / "checkpoint-8", step=8, attempt=1, adapter_version=4)
    assert latest_complete(tmp_path) == tmp_path / "checkpoint-8"
    assert json.loads((tmp_path / "checkpoint-8" / COMPLETE_MARKER).read_text())["adapter_version"] == 4
    assert remove_incomplete(tmp_path) == [tmp_path / "checkpoint-12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-8"]


def test_no_checkpoint_means_no_resume(tmp_path: Path):
    assert latest_complete(tmp_path / "absent") is None
    (tmp_path / "checkpoint-3").mkdir()
    assert latest_complete(tmp_path) is None
