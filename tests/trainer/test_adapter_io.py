"""The trainer's adapter writer: PEFT's tensors and config, in the serving dtype, hashed while written."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from grpo_api.adapters import MANIFEST_NAME, verify_manifest
from grpo_trainer.transport.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, publish_dtype, save_peft_adapter
from grpo_trainer.transport.adapter_store import AdapterStore


def blake3_of(path: Path) -> str:
    """The file's digest as manifests write it, computed by the blake3 library itself."""
    import blake3

    return "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=["CAUSAL_LM", None], ids=["causal-lm", "no-task-type"])
def peft_model(tiny_model_dir: Path, request):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=request.param))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_written_adapter_matches_peft_save_pretrained_and_loads_in_peft(peft_model, tiny_model_dir, tmp_path, dtype):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    digests = save_peft_adapter(peft_model, ours, dtype=dtype)
    peft_model.save_pretrained(str(theirs))

    assert digests == {name: blake3_of(ours / name) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    our_config, their_config = (json.loads((d / ADAPTER_CONFIG).read_text()) for d in (ours, theirs))
    assert set(our_config.pop("target_modules")) == set(their_config.pop("target_modules"))  # a set in PEFT
    assert our_config == their_config
    our_weights, their_weights = load_file(ours / ADAPTER_WEIGHTS), load_file(theirs / ADAPTER_WEIGHTS)
    assert our_weights.keys() == their_weights.keys() and our_weights
    for name, tensor in our_weights.items():
        assert tensor.dtype == getattr(torch, dtype)
        torch.testing.assert_close(tensor.float(), their_weights[name].to(tensor.dtype).float(), rtol=0, atol=0)

    # the real loading code (what the transformers engine does) reproduces the adapter's outputs
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, str(ours)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = peft_model.eval()(ids).logits
        got = loaded(ids).logits
    tolerance = 0 if dtype == "float32" else 5e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    if dtype == "bfloat16":
        assert (ours / ADAPTER_WEIGHTS).stat().st_size < 0.6 * (theirs / ADAPTER_WEIGHTS).stat().st_size


def test_store_publishes_the_writer_output_without_rehashing_and_the_manifest_verifies(peft_model, tmp_path,
                                                                                        monkeypatch):
    import grpo_api.adapters as adapters

    store = AdapterStore(tmp_path / "adapters", "sha256:base")
    reads: list[str] = []
    real = adapters.file_digest
    monkeypatch.setattr(adapters, "file_digest", lambda p, *a, **k: reads.append(Path(p).name) or real(p, *a, **k))
    published = store.publish(lambda d: save_peft_adapter(peft_model, d, dtype="bfloat16"), step=3)
    assert reads == []  # both files were hashed from memory while being written
    monkeypatch.undo()
    manifest = verify_manifest(published.path)
    assert set(manifest.files) == {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    assert not (published.path / "README.md").exists() and (published.path / MANIFEST_NAME).is_file()


def test_publish_dtype_follows_the_servers_16_bit_dtype(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert publish_dtype("bfloat16", model) == "bfloat16"
    assert publish_dtype("float16", model) == "float16"
    assert publish_dtype("float32", model) == "float32"
    assert publish_dtype("auto", model) == "bfloat16"
    (model / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert publish_dtype("auto", model) == "float32"
    (model / "config.json").unlink()
    assert publish_dtype("auto", model) == "float32"


def test_the_writer_refuses_to_overwrite_an_existing_file(peft_model, tmp_path):
    target = tmp_path / "v"
    save_peft_adapter(peft_model, target, dtype="float32")
    with pytest.raises(FileExistsError):
        save_peft_adapter(copy.deepcopy(peft_model), target, dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_safetensors_layout_reads_back_with_the_library(tmp_path, dtype):
    import torch
    from safetensors import safe_open

    from grpo_trainer.transport.adapter_files import write_adapter

    torch.manual_seed(1)
    tensors = {"b.lora_B.weight": torch.randn(5, 3), "a.lora_A.weight": torch.randn(3, 7), "c.scalar": torch.randn(1)}
    digests = write_adapter(tmp_path / "v", tensors, {"peft_type": "LORA"}, dtype=dtype)
    assert digests[ADAPTER_WEIGHTS] == blake3_of(tmp_path / "v" / ADAPTER_WEIGHTS)
    with safe_open(str(tmp_path / "v" / ADAPTER_WEIGHTS), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"} and sorted(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor.to(getattr(torch, dtype)))


def test_non_float_tensors_and_other_dtypes_are_refused(tmp_path):
    import torch

    from grpo_trainer.transport.adapter_files import write_adapter

    with pytest.raises(ValueError, match="not floating point"):
        write_adapter(tmp_path / "a", {"x": torch.ones(2, dtype=torch.int64)}, {}, dtype="float32")
    with pytest.raises(ValueError, match="not float64"):
        write_adapter(tmp_path / "b", {"x": torch.ones(2)}, {}, dtype="float64")


def test_a_snapshot_keeps_the_bytes_of_its_moment_while_the_model_trains_on(peft_model, tmp_path):
    from grpo_trainer.transport.adapter_files import peft_adapter, snapshot_peft_adapter

    before = {name: t.detach().clone() for name, t in peft_adapter(peft_model)[0].items()}
    snapshot = snapshot_peft_adapter(peft_model, dtype="float32")
    _shift_lora(peft_model, 1.0)  # an optimizer step between the snapshot and the background write
    try:
        digests = _assert_writes(snapshot, tmp_path / "v1", before)
        assert snapshot.size_bytes == sum((tmp_path / "v1" / n).stat().st_size for n in digests)
    finally:
        _shift_lora(peft_model, -1.0)


def _shift_lora(model, delta: float) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(delta)


def _assert_writes(snapshot, directory: Path, expected) -> dict[str, str]:
    """The snapshot writes exactly `expected` ({name: tensor}) and returns the file's true digest."""
    import torch
    from safetensors.torch import load_file

    digests = snapshot.write(directory)
    written = load_file(directory / ADAPTER_WEIGHTS)
    assert written.keys() == expected.keys()
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert digests[ADAPTER_WEIGHTS] == blake3_of(directory / ADAPTER_WEIGHTS)
    return digests


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (run on the device: BENCHMARKS.md)")
def test_a_gpu_snapshot_does_not_wait_for_queued_work_and_writes_the_bytes_of_its_moment(peft_model, tmp_path):
    import torch

    from grpo_trainer.transport.adapter_files import peft_adapter, snapshot_peft_adapter

    model = copy.deepcopy(peft_model).cuda()
    before = {name: t.detach().to(torch.bfloat16).cpu() for name, t in peft_adapter(model)[0].items()}
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    # The first pinned allocation and cuBLAS start synchronise the device; a trainer's later snapshots
    # reuse the cached pinned block, as this one does.
    snapshot_peft_adapter(model, dtype="bfloat16").write(tmp_path / "warm")
    big = big @ big
    torch.cuda.synchronize()
    for _ in range(100):  # ~0.1 s of queued kernels standing in for the step's optimizer
        big = (big @ big).clamp_(-1, 1)
    snapshot = snapshot_peft_adapter(model, dtype="bfloat16")
    assert snapshot.copied is not None and not snapshot.copied.query(), "the snapshot waited for the GPU"
    _shift_lora(model, 1.0)  # the next step's update, queued behind the copy
    _assert_writes(snapshot, tmp_path / "v1", before)


def test_adapter_under_activation_checkpointing_and_fsdp2_shards_of_two_ranks_is_whole(tiny_model_dir, tmp_path):
    """Wrappers lengthen module names (PEFT then finds no tensor: an empty adapter was published under
    strategy fsdp) and FSDP2 leaves each rank a shard: the adapter is still every tensor, whole."""
    import subprocess
    import sys

    import torch

    from grpo_trainer.transport.adapter_files import peft_adapter
    from tests.trainer.fsdp_adapter_ranks import peft_model

    done = subprocess.run([sys.executable, "-m", "tests.trainer.fsdp_adapter_ranks", str(tiny_model_dir),
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    expected, _ = peft_adapter(peft_model(str(tiny_model_dir)))
    assert sharded.keys() == expected.keys() and len(expected) == 7 * 2 * 2  # 7 linear layers × 2 halves × 2 layers
    for name, tensor in expected.items():
        assert type(sharded[name]) is torch.Tensor
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=0)


def test_the_adapters_layout_is_found_once_and_read_where_its_parameters_now_are(peft_model, monkeypatch):
    """PEFT's search runs at the first publish only; later ones read the live parameters by name, also one
    that was replaced since, and a model with other parameters is searched again."""
    import torch

    import grpo_trainer.transport.adapter_files as files

    model = copy.deepcopy(peft_model)
    searches = []
    search = files._peft_state_dict
    monkeypatch.setattr(files, "_peft_state_dict", lambda *a: searches.append(1) or search(*a))
    first, config = files.peft_adapter(model)
    assert len(searches) == 1 and first
    _shift_lora(model, 0.5)
    name = next(n for n, _ in model.named_parameters() if "lora_B" in n)
    module = model.get_submodule(name.rsplit(".", 1)[0])
    module.weight = torch.nn.Parameter(torch.full_like(module.weight, 7.0))  # a parameter replaced in place of one
    tensors, again = files.peft_adapter(model)
    assert len(searches) == 1, "PEFT searched the model again although nothing moved"
    assert again == config and again is not config
    assert tensors.keys() == first.keys()
    replaced = name.replace(".default", "")
    assert torch.equal(tensors[replaced], module.weight) and tensors[replaced] is module.weight
    for key, tensor in tensors.items():
        if key != replaced:
            torch.testing.assert_close(tensor, first[key], rtol=0, atol=0)  # the same live parameters, shifted
    assert all(t is p for t, p in zip(tensors.values(), _lora_parameters(model, tensors), strict=True))

    other = copy.deepcopy(peft_model)  # another model: its own search
    files.peft_adapter(other)
    assert len(searches) == 2
    model.base_model.model.lm_head.extra = torch.nn.Parameter(torch.zeros(1))  # the model changed: searched again
    files.peft_adapter(model)
    assert len(searches) == 3


def _lora_parameters(model, tensors) -> list:
    parameters = dict(model.named_parameters())
    by_key = {name.replace(".default", ""): p for name, p in parameters.items() if "lora_" in name}
    return [by_key[key] for key in tensors]


def test_a_snapshot_casts_once_after_packing_and_matches_a_cast_per_tensor(peft_model):
    """Mixed float32 and bfloat16 tensors packed then cast give the bytes a cast per tensor gives."""
    import torch

    from grpo_trainer.transport.adapter_files import peft_adapter, safetensors_parts

    tensors = dict(peft_adapter(peft_model)[0])
    first = next(iter(tensors))
    tensors[first] = tensors[first].detach().to(torch.bfloat16)
    for dtype in ("bfloat16", "float16", "float32"):
        _, data, _ = safetensors_parts(tensors, dtype)
        target = getattr(torch, dtype)
        expected = torch.cat([tensors[n].detach().to(target).reshape(-1) for n in sorted(tensors)])
        assert bytes(data) == expected.view(torch.uint8).numpy().tobytes()
