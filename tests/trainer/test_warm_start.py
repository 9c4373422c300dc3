"""Warm start (spec.model.adapter): which adapters can start a run of this base model, on real PEFT adapters of the
tiny model. The run end to end (run A, then run B from A's adapter) is tests/local/test_local_warm_start.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpo_api.fingerprint import model_fingerprint
from grpo_api.runconfig import parse_grporun
from grpo_trainer.warm_start import WarmAdapterRefused, check_warm_adapter, max_adapter_rank
from tests.fixtures.run_specs import run_with
from tests.server.adapters import LoraMaker, edit_config, rewrite_tensors


@pytest.fixture(scope="module")
def maker(tiny_model_dir: Path) -> LoraMaker:
    return LoraMaker(tiny_model_dir)


def _check(adapter: Path, model_dir: Path, *, max_rank: int | None = 64) -> Any:
    return check_warm_adapter(adapter, model_dir=model_dir, fingerprint=model_fingerprint(model_dir), max_rank=max_rank)


def _refusal(adapter: Path, model_dir: Path, **kwargs: Any) -> str:
    with pytest.raises(WarmAdapterRefused) as info:
        _check(adapter, model_dir, **kwargs)
    message = str(info.value)
    assert message.startswith(f"spec.model.adapter: {adapter}: "), message
    return message


def test_an_adapter_of_the_model_brings_its_own_rank_alpha_and_targets(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = maker.save(tmp_path / "a", seed=1, r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    checked = _check(adapter, tiny_model_dir)
    assert (checked.rank, checked.alpha, set(checked.target_modules)) == (8, 4.0, {"q_proj", "v_proj"})
    assert checked.manifest_fingerprint is None


def test_a_published_version_of_this_model_passes_and_one_of_another_base_model_is_refused(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ours, _ = maker.publish(tmp_path / "ours", 1, seed=1)
    assert _check(ours, tiny_model_dir).manifest_fingerprint == model_fingerprint(tiny_model_dir)
    # Same shapes, other weights: only the manifest's fingerprint tells them apart.
    theirs, _ = maker.publish(tmp_path / "theirs", 1, seed=1, fingerprint="sha256:" + "0" * 32)
    message = _refusal(theirs, tiny_model_dir)
    assert "trained on another base model" in message and "sha256:" + "0" * 32 in message, message


def test_a_published_version_whose_file_changed_is_refused(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter, _ = maker.publish(tmp_path / "root", 1, seed=1)
    rewrite_tensors(adapter, lambda tensors: [t.mul_(2) for t in tensors.values()])
    assert "do not match its manifest" in _refusal(adapter, tiny_model_dir)


def test_an_adapter_whose_tensors_do_not_fit_the_model_is_refused_naming_the_layer(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch

    adapter = maker.save(tmp_path / "a", seed=1, target_modules=["q_proj"])

    def widen(tensors: dict[str, Any]) -> None:
        key = next(k for k in tensors if k.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)

    rewrite_tensors(adapter, widen)
    message = _refusal(adapter, tiny_model_dir)
    assert "trained on another base model" in message and "model.layers.0.self_attn.q_proj" in message, message


@pytest.mark.parametrize(
    ("change", "text"),
    [({"use_dora": True}, "use_dora is set"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
     ({"bias": "all"}, "bias is 'all'"), ({"peft_type": "IA3"}, "not LORA")],
)
def test_an_adapter_the_server_cannot_serve_as_plain_lora_is_refused(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path, change: dict[str, Any], text: str
) -> None:
    adapter = maker.save(tmp_path / "a", seed=1)
    edit_config(adapter, **change)
    assert text in _refusal(adapter, tiny_model_dir)


def test_a_rank_above_the_servers_max_lora_rank_is_refused_naming_it(
    maker: LoraMaker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = maker.save(tmp_path / "a", seed=1, r=16)
    assert "rank 16 exceeds spec.server.maxLoraRank (8)" in _refusal(adapter, tiny_model_dir, max_rank=8)
    assert _check(adapter, tiny_model_dir, max_rank=None).rank == 16  # weights pushed: no adapter rank limit


def test_a_missing_directory_or_a_directory_without_an_adapter_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert "no such directory" in _refusal(tmp_path / "nowhere", tiny_model_dir)
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in _refusal(tmp_path / "empty", tiny_model_dir)


def test_the_servers_max_lora_rank_bounds_the_adapter_only_when_adapters_reach_it() -> None:
    def spec(**patch: Any) -> Any:
        return parse_grporun(run_with(patch), "run.yaml").spec

    assert max_adapter_rank(spec(server={"maxLoraRank": 32})) == 32
    assert max_adapter_rank(spec()) == 64
    assert max_adapter_rank(spec(trainer={"sync": "merged"})) is None
    assert max_adapter_rank(spec(mode="colocate")) is None
