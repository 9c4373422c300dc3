"""The checkpoint folder and the adapter root belong to one attempt at a time (`checkpoints.AttemptFence`).

A trainer process that outlived its attempt wrote the checkpoint folder the next attempt resumes from
(issue 33). Each attempt now claims the folders when it starts; a process of an earlier attempt finds the
later claim before it writes a checkpoint, marks one complete, publishes or prunes an adapter, and stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from grpo_api.adapters import list_versions
from grpo_trainer.checkpoints import ATTEMPT_RECORD, AttemptFence, latest_complete, mark_complete
from grpo_trainer.errors import AttemptSuperseded
from grpo_trainer.transport.adapter_store import TMP_PREFIX, AdapterStore
from tests.fixtures.adapter_folders import saver
from tests.fixtures.server import RunningServer
from tests.fixtures.trainer_runs import REPO, cli_env, complete_checkpoints, grpo_train, token_fraction, trainer_config
from tests.fixtures.waiting import wait_for


def fences(tmp_path: Path, uid: str = "run-a") -> tuple[AttemptFence, AttemptFence]:
    folders = (tmp_path / "checkpoints", tmp_path / "adapters")
    return AttemptFence(uid, 1, folders), AttemptFence(uid, 2, folders)


def test_a_later_attempt_s_claim_stops_the_earlier_one_and_an_earlier_one_cannot_claim_back(tmp_path: Path):
    first, second = fences(tmp_path)
    first.claim()
    first.check("write checkpoint-1")
    second.claim()
    second.check("write checkpoint-2")
    with pytest.raises(AttemptSuperseded, match=r"attempt 1 of run uid run-a may not write checkpoint-3: attempt 2 "
                                                r"of run uid run-a has claimed .*checkpoints \(grpo-attempt.json\)"):
        first.check("write checkpoint-3")
    with pytest.raises(AttemptSuperseded, match="attempt 1 started after attempt 2 of run uid run-a had claimed"):
        first.claim()
    second.check("go on")  # the refused claim changed nothing


def test_a_new_run_object_takes_the_folders_over_whatever_its_attempt(tmp_path: Path):
    """A run re-created under the same name, or `grpo run` again in one directory: attempts count from 1."""
    _, old = fences(tmp_path, uid="old")
    old.claim()
    new = AttemptFence("new", 1, old.folders)
    new.claim()
    with pytest.raises(AttemptSuperseded, match="attempt 1 of run uid new has claimed"):
        old.check("publish adapter v9")


def test_an_unreadable_record_stops_writes_and_the_next_claim_replaces_it(tmp_path: Path):
    fence, _ = fences(tmp_path)
    fence.claim()
    (fence.folders[0] / ATTEMPT_RECORD).write_text("{torn")
    with pytest.raises(AttemptSuperseded, match=f"{ATTEMPT_RECORD}: not an attempt record"):
        fence.check("write checkpoint-4")
    fence.claim()
    fence.check("write checkpoint-4")


def test_a_checkpoint_is_not_marked_complete_once_a_later_attempt_claimed_the_folder(tmp_path: Path):
    first, second = fences(tmp_path)
    first.claim()
    root = first.folders[0]
    for step in (2, 4):
        (root / f"checkpoint-{step}").mkdir()
    mark_complete(root / "checkpoint-2", step=2, attempt=1, adapter_version=2)
    second.claim()
    with pytest.raises(AttemptSuperseded, match=r"attempt 1 may not mark .*checkpoint-4 complete: attempt 2"):
        mark_complete(root / "checkpoint-4", step=4, attempt=1, adapter_version=4)
    assert latest_complete(root) == root / "checkpoint-2"


def test_an_earlier_attempt_neither_publishes_nor_prunes_adapter_versions(tmp_path: Path):
    first, second = fences(tmp_path)
    first.claim()
    root = first.folders[1]
    store = AdapterStore(root, "fp", fence=first)
    store.publish(saver(), step=1)
    store.publish(saver(), step=2)
    second.claim()
    with pytest.raises(AttemptSuperseded, match="attempt 1 of run uid run-a may not publish adapter v3"):
        store.publish(saver(), step=3)
    with pytest.raises(AttemptSuperseded, match="may not prune adapter versions below v3"):
        store.prune(keep_from=3)
    assert list_versions(root) == [1, 2]
    assert not [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]


@pytest.mark.slow
def test_a_trainer_of_an_earlier_attempt_stops_before_its_next_checkpoint(
    tiny_server: RunningServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
):
    """A real `grpo train` (attempt 1, a checkpoint every step): once attempt 2 claims its folders it writes
    and marks no checkpoint more and exits, saying why."""
    steps = 5000  # no sync before the last: the shared server keeps no adapter
    cfg, path = trainer_config(tiny_server, tmp_path, dataset=tiny_dataset, rewards=[token_fraction(tiny_model_dir)],
                               trainer={"maxSteps": steps, "syncInterval": steps, "checkpointInterval": 1})
    root = Path(cfg.paths.checkpoint_dir)
    trainer = subprocess.Popen(grpo_train(path), env=cli_env(GRPO_ATTEMPT="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_for(lambda: complete_checkpoints(root), 240, interval=0.1, what="a complete checkpoint", proc=trainer)
        AttemptFence(cfg.run.uid, 2, (root, Path(cfg.paths.adapter_root))).claim()
        claimed = set(complete_checkpoints(root)) | set(int(p.name.split("-")[1]) for p in root.glob("checkpoint-*"))
        out, _ = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
    assert trainer.returncode == 1, out[-3000:]
    assert "attempt 1 may not" in out and "attempt 2 has claimed" in out, out[-3000:]
    # At most the step running at the claim finishes its save; none after it is written or marked complete.
    written = {int(p.name.split("-")[1]) for p in root.glob("checkpoint-*")}
    assert max(written) <= max(claimed) + 1, (sorted(written), sorted(claimed))
    assert max(complete_checkpoints(root)) <= max(claimed), (complete_checkpoints(root), sorted(claimed))
    assert json.loads((root / ATTEMPT_RECORD).read_text())["attempt"] == 2
