"""Adapter publication on the volume: atomic versions with verifying manifests, pruning one sync late."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_api.adapters import MANIFEST_NAME, ManifestError, list_versions, verify_manifest
from grpo_trainer.errors import TrainingFailed
from grpo_trainer.transport.adapter_store import AdapterStore
from tests.fixtures.adapter_folders import LORA_CONFIG, saver


def test_publish_writes_complete_versions_whose_manifest_verifies(tmp_path: Path):
    store = AdapterStore(tmp_path / "adapters", "sha256:base")
    first = store.publish(saver(), step=2)
    second = store.publish(saver(payload=b"other"), step=4)
    assert (first.version, second.version) == (1, 2)
    manifest = verify_manifest(second.path)
    assert (manifest.version, manifest.step, manifest.base_model_fingerprint) == (2, 4, "sha256:base")
    assert manifest.digest() == second.sha256
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v1", "v2"]  # no temporary left
    assert store.step_of(1) == 2


def test_versions_continue_above_existing_directories_and_the_server_floor(tmp_path: Path):
    root = tmp_path / "adapters"
    AdapterStore(root, "fp").publish(saver(), step=1)
    store = AdapterStore(root, "fp")  # a new attempt
    assert store.next_version() == 2
    store.floor = 7
    assert store.publish(saver(), step=3).version == 8


def test_prune_keeps_the_previous_version(tmp_path: Path):
    store = AdapterStore(tmp_path / "adapters", "fp")
    for step in range(1, 5):
        store.publish(saver(), step=step)
    assert store.prune(keep_from=3) == [1, 2]
    assert list_versions(tmp_path / "adapters") == [3, 4]


@pytest.mark.parametrize(
    "change, reason",
    [({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
     ({"bias": "all"}, "bias"), ({"target_modules": ["lm_head", "q_proj"]}, "lm_head")],
)
def test_adapters_vllm_cannot_serve_are_refused_and_leave_nothing(tmp_path: Path, change: dict, reason: str):
    store = AdapterStore(tmp_path / "adapters", "fp")
    with pytest.raises(TrainingFailed, match=reason):
        store.publish(saver({**LORA_CONFIG, **change}), step=1)
    assert list((tmp_path / "adapters").iterdir()) == []


def test_file_digests_are_blake3_and_a_digest_in_another_notation_is_a_malformed_manifest(tmp_path: Path):
    import blake3

    store = AdapterStore(tmp_path / "adapters", "fp")
    published = store.publish(saver(payload=b"weights"), step=1)
    manifest = verify_manifest(published.path)
    for rel, digest in manifest.files.items():
        assert digest == "blake3:" + blake3.blake3((published.path / rel).read_bytes()).hexdigest()
    for notation in ("sha1:" + "0" * 40, "BLAKE3:" + "0" * 64, "0" * 63, "blake3:" + "g" * 64):
        broken = manifest.model_dump(mode="json")
        broken["files"][next(iter(broken["files"]))] = notation
        (published.path / MANIFEST_NAME).write_text(json.dumps(broken))
        with pytest.raises(ManifestError, match=r"(?s)is malformed.*neither blake3:<64 hex> nor 64 hex"):
            verify_manifest(published.path)
