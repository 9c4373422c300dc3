"""The adapter check that refuses NaN or Inf weights, on the raw bytes of a safetensors file.

The check tests each run of same-dtype tensors with a few numpy calls instead of one torch call per tensor
(which stalled adapter loads beside generation: BENCHMARKS.md, 2026-12-03). It must find exactly what
torch.isfinite finds, in every floating dtype an adapter may carry, and name the tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpo_server.adapter_checks import AdapterRefusal, _check_finite

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]


def _adapter(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    weights = path / "adapter_model.safetensors"
    save_file(tensors, str(weights))
    return weights


def _lora(dtype: torch.dtype, layers: int = 3) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, 16).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(16, 4) * 0.01).to(dtype)
    return tensors


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_finite_weights_of_every_float_dtype_pass(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = _lora(dtype)
    info = torch.finfo(dtype)
    tensors["extremes"] = torch.tensor([info.max, info.min, info.tiny, 0.0, -0.0], dtype=torch.float64).to(dtype)
    _check_finite(_adapter(tmp_path, tensors))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_a_non_finite_value_is_refused_naming_its_tensor(tmp_path: Path, dtype: torch.dtype, bad: float) -> None:
    tensors = _lora(dtype)
    victim = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    poisoned = tensors[victim].float()
    poisoned[3, 2] = bad
    poisoned[7, 0] = bad
    tensors[victim] = poisoned.to(dtype)
    expected_bad = int((~torch.isfinite(tensors[victim].float())).sum())
    assert expected_bad == 2 or (dtype == torch.float8_e4m3fn and expected_bad == 2)  # e4m3fn turns inf into NaN
    with pytest.raises(AdapterRefusal) as refused:
        _check_finite(_adapter(tmp_path, tensors))
    assert refused.value.reason == "adapter_weights_invalid"
    assert victim in str(refused.value) and "2 non-finite value(s)" in str(refused.value)


def test_integer_tensors_beside_float_ones_are_not_read_as_floats(tmp_path: Path) -> None:
    """An int16 tensor whose bits look like a bf16 NaN (0x7FC0) is not a non-finite value."""
    tensors = _lora(torch.bfloat16)
    tensors["counts"] = torch.full((8,), 0x7FC0, dtype=torch.int16)
    tensors["flags"] = torch.ones(5, dtype=torch.bool)
    _check_finite(_adapter(tmp_path, tensors))


def test_tensors_of_mixed_dtypes_are_each_tested_with_their_own_bits(tmp_path: Path) -> None:
    tensors = {**{f"a{k}": v for k, v in _lora(torch.float32).items()},
               **{f"b{k}": v for k, v in _lora(torch.bfloat16).items()}}
    _check_finite(_adapter(tmp_path, tensors))
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last].clone()
    tensors[last].view(-1)[0] = float("nan")
    with pytest.raises(AdapterRefusal, match=last.replace(".", r"\.")):
        _check_finite(_adapter(tmp_path, tensors))


def test_an_e8m0_nan_is_found_where_torch_isfinite_misses_it(tmp_path: Path) -> None:
    """float8_e8m0fnu (exponent bits only) is NaN at 0xFF; torch.isfinite on CPU calls it finite."""
    tensors = _lora(torch.float32)
    tensors["scales"] = torch.tensor([1.0, 2.0, float("nan")]).to(torch.float8_e8m0fnu)
    with pytest.raises(AdapterRefusal, match="tensor scales holds 1 non-finite"):
        _check_finite(_adapter(tmp_path, tensors))


def test_a_dtype_without_a_bit_test_goes_through_torch(tmp_path: Path) -> None:
    """float4 (two values a byte) has no bit test: the per-tensor path refuses it by name, as before."""
    tensors = _lora(torch.float32)
    tensors["packed"] = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(AdapterRefusal, match="packed"):
        _check_finite(_adapter(tmp_path, tensors))


def test_every_chunk_is_tested_where_the_threads_share_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of tensors longer than a chunk is split over the check's threads: a NaN in any chunk (first,
    middle, last value) is found and named, a run without one passes."""
    import grpo_server.adapter_checks as checks

    monkeypatch.setattr(checks, "_FINITE_CHUNK", 64)
    tensors = {f"layer{i}.lora_A.weight": torch.randn(16, 16).to(torch.bfloat16) for i in range(6)}  # 24 chunks
    _check_finite(_adapter(tmp_path, tensors))
    for index, victim in ((0, "layer0.lora_A.weight"), (130, "layer2.lora_A.weight"), (255, "layer5.lora_A.weight")):
        poisoned = {name: tensor.clone() for name, tensor in tensors.items()}
        poisoned[victim].view(-1)[index] = float("nan")
        folder = tmp_path / f"bad{index}"
        folder.mkdir()
        with pytest.raises(AdapterRefusal, match=rf"tensor {victim} holds 1 non-finite value\(s\) .* of 256"):
            _check_finite(_adapter(folder, poisoned))


def test_a_changed_file_is_refused_as_that_though_it_also_holds_a_nan(tmp_path: Path) -> None:
    """The checksum and the finite check read the weights side by side; the checksum's refusal is the answer."""
    from grpo_api.adapters import build_manifest, write_manifest
    from grpo_server.adapter_checks import CheckedAdapter, verify_adapter_files

    weights = _adapter(tmp_path, _lora(torch.bfloat16))
    manifest = build_manifest(tmp_path, version=1, step=1, base_model_fingerprint="f" * 64)
    write_manifest(tmp_path, manifest)
    checked = CheckedAdapter(path=tmp_path, digest=manifest.digest(), manifest_version=1, rank=4, weights=weights,
                             manifest=manifest)
    verify_adapter_files(checked)
    poisoned = _lora(torch.bfloat16)
    poisoned[sorted(poisoned)[0]].view(-1)[0] = float("nan")
    _adapter(tmp_path, poisoned)
    with pytest.raises(AdapterRefusal) as refused:
        verify_adapter_files(checked)
    assert refused.value.reason == "adapter_checksum_mismatch", refused.value
    assert "adapter_model.safetensors" in str(refused.value)
