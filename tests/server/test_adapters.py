"""The adapter load trigger over HTTP: our payload and Axolotl's, every refusal, eviction, selection."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.adapters import AdapterManifest, write_manifest
from grpo_api.protocol import ADAPTER_VERSION_HEADER, SetAdapterResponse
from tests.fixtures.server import ENV_ENGINE, RunningServer, start_server
from tests.fixtures.server_requests import (
    Versions,
    active_version,
    complete,
    first_token_distribution,
    ours,
    same_distribution,
    token_ids,
    trigger,
)
from tests.server.adapters import LoraMaker, add_manifest_entry, edit_config, publish_dir, rewrite_tensors

MAX_RANK = 8
MAX_LORAS = 2
SERVED_ENGINE = os.environ.get(ENV_ENGINE, "transformers")


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("adapter-server"), served_model_dir,
                           server_overrides={"maxLoraRank": MAX_RANK, "maxLoras": MAX_LORAS})
    yield running
    running.stop(timeout=10)


@pytest.fixture(scope="module")
def maker(served_model_dir: Path) -> LoraMaker:
    return LoraMaker(served_model_dir)


@pytest.fixture(scope="module")
def next_version() -> Versions:
    return Versions()


@pytest.fixture
def loaded(server: RunningServer, maker: LoraMaker, next_version: Versions) -> int:
    """A freshly published and activated version (the 'previous adapter' refusals must keep)."""
    version = next_version()
    path, digest = maker.publish(server.adapter_root, version, seed=version)
    assert trigger(server, ours(path, version, digest)).status_code == 200
    return version


# ------------------------------------------------------------------------------------------ success


def test_our_payload_loads_before_answering_and_tags_generations(server, maker, next_version):
    version = next_version()
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    response = trigger(server, ours(path, version, digest))
    assert response.status_code == 200, response.text
    answer = SetAdapterResponse.model_validate(response.json())
    assert answer.adapter.name == f"policy-v{version}" and answer.adapter.version == version
    assert answer.adapter.sha256 == digest and answer.adapter.path == str(path.resolve())
    assert answer.load_seconds > 0 and answer.boot_id == server.health()["boot_id"]
    assert server.health()["adapter"]["version"] == version
    generated = complete(server)
    assert generated.headers[ADAPTER_VERSION_HEADER] == str(version)
    assert generated.json()["adapter_version"] == version
    ids = [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]]
    assert f"policy-v{version}" in ids


def test_a_manifest_with_sha256_digests_loads_and_a_tampered_file_under_it_is_refused(server, maker, next_version):
    """Manifests written before BLAKE3 carry bare sha256 digests: the server verifies them the same way."""
    good, bad = next_version(), next_version()
    for version in (good, bad):
        staging = server.adapter_root / f".tmp-sha256-v{version}"
        maker.save(staging, seed=version)
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in staging.iterdir()}
        if version == bad:
            (staging / "adapter_config.json").write_text((staging / "adapter_config.json").read_text() + " ")
        manifest = AdapterManifest(version=version, step=version, base_model_fingerprint=maker.fingerprint,
                                   files=files, created_at=dt.datetime.now(dt.UTC))
        write_manifest(staging, manifest)
        staging.rename(server.adapter_root / f"v{version}")
        response = trigger(server, ours(server.adapter_root / f"v{version}", version, manifest.digest()))
        if version == good:
            assert response.status_code == 200, response.text
            assert server.health()["adapter"]["version"] == good
        else:
            assert response.status_code == 409 and "adapter_checksum_mismatch" in response.text, response.text
            assert "adapter_config.json: digest " in response.text, response.text
            assert server.health()["adapter"]["version"] == good  # the good one stays


def test_generations_really_run_on_the_selected_adapter(server, loaded):
    active, _ = first_token_distribution(server)
    by_name = complete(server, f"policy-v{loaded}")
    base = complete(server, "tiny:base")
    assert by_name.json()["adapter_version"] == loaded
    assert base.headers[ADAPTER_VERSION_HEADER] == "none" and base.json()["adapter_version"] is None
    assert same_distribution(first_token_distribution(server, f"policy-v{loaded}")[0], active)
    assert not same_distribution(first_token_distribution(server, "tiny:base")[0], active)


def test_relative_paths_resolve_inside_the_adapter_root(server, maker, next_version):
    version = next_version()
    _, digest = maker.publish(server.adapter_root, version, seed=2)
    response = trigger(server, ours(f"v{version}", version, digest))
    assert response.status_code == 200, response.text


def test_axolotl_payload_loads_with_a_version_from_the_counter(server, maker, next_version):
    before = active_version(server) or 0
    path = maker.save(server.adapter_root / "axolotl-sync" / "v1", seed=3)
    response = trigger(server, {"lora_name": "active_lora", "lora_int_id": 1, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    adapter = response.json()["adapter"]
    assert adapter["version"] > before and adapter["name"] == f"policy-v{adapter['version']}"
    assert adapter["sha256"] is None
    assert complete(server).json()["adapter_version"] == adapter["version"]
    next_version.last = max(next_version.last, adapter["version"])  # that version number is now taken


def test_retrigger_of_the_same_version_is_idempotent_and_other_contents_are_refused(server, maker, loaded):
    path = server.adapter_root / f"v{loaded}"
    digest = json.loads(trigger(server, ours(path, loaded, None)).text)  # no sha256: refused
    assert digest["error"] == "adapter_checksum_mismatch"
    from grpo_api.adapters import read_manifest

    same = trigger(server, ours(path, loaded, read_manifest(path).digest()))
    assert same.status_code == 200 and same.json()["adapter"]["version"] == loaded
    shutil.rmtree(path)
    _, other_digest = maker.publish(server.adapter_root, loaded, seed=999)
    clash = trigger(server, ours(path, loaded, other_digest))
    assert clash.status_code == 409 and clash.json()["error"] == "adapter_version_conflict"
    assert "publish a new version" in clash.json()["message"]


def test_clear_returns_to_the_base_model(server, loaded):
    base = token_ids(complete(server, "tiny:base"))
    cleared = httpx.post(server.url + "/clear_lora_adapter/", headers=server.auth, timeout=30)
    assert cleared.status_code == 200 and cleared.json()["adapter"] is None
    assert server.health()["adapter"] is None
    response = complete(server)
    assert response.json()["adapter_version"] is None and token_ids(response) == base
    assert complete(server, f"policy-v{loaded}").status_code == 200  # still loaded, selectable by name


def test_at_most_max_loras_versions_stay_loaded_oldest_evicted(server, maker, next_version):
    versions = [next_version() for _ in range(MAX_LORAS + 2)]
    for version in versions:
        path, digest = maker.publish(server.adapter_root, version, seed=version)
        assert trigger(server, ours(path, version, digest)).status_code == 200
    ids = [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]]
    policy_ids = [i for i in ids if i.startswith("policy-v")]
    assert policy_ids == [f"policy-v{v}" for v in versions[-MAX_LORAS:]]
    evicted = complete(server, f"policy-v{versions[0]}")
    assert evicted.status_code == 404 and evicted.json()["error"] == "model_not_found"
    assert "grpo_server_loaded_adapters 2.0" in httpx.get(server.url + "/metrics").text


# ------------------------------------------------------------------------------------------ refusals


def prepare_outside_root(server, maker, version, tmp):
    outside = maker.save(tmp / "elsewhere", seed=1)
    return ours(outside, version, None)


def prepare_dotdot(server, maker, version, tmp):
    maker.save(server.adapter_root.parent / f"sibling-{version}", seed=1)
    return ours(server.adapter_root / ".." / f"sibling-{version}", version, None)


def prepare_symlink(server, maker, version, tmp):
    outside = maker.save(tmp / "target", seed=1)
    link = server.adapter_root / f"link-{version}"
    link.symlink_to(outside, target_is_directory=True)
    return ours(link, version, None)


def prepare_missing_dir(server, maker, version, tmp):
    return ours(server.adapter_root / f"v{version}", version, "0" * 64)


def prepare_missing_config(server, maker, version, tmp):
    staging = maker.save(server.adapter_root / f".tmp-{version}", seed=1)
    (staging / "adapter_config.json").unlink()
    path, digest = publish_dir(staging, server.adapter_root, version, maker.fingerprint)
    return ours(path, version, digest)


def prepare_malformed_config(server, maker, version, tmp):
    staging = maker.save(server.adapter_root / f".tmp-{version}", seed=1)
    (staging / "adapter_config.json").write_text("{not json")
    path, digest = publish_dir(staging, server.adapter_root, version, maker.fingerprint)
    return ours(path, version, digest)


def prepare_other_base_manifest(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, fingerprint="sha256:" + "0" * 32)
    return ours(path, version, digest)


def prepare_other_base_axolotl(server, maker, version, tmp):
    other = tmp / "other-model"
    other.mkdir()
    config = json.loads((maker.model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 7
    (other / "config.json").write_text(json.dumps(config))
    path = maker.save(server.adapter_root / f"axo-{version}", seed=1)
    edit_config(path, base_model_name_or_path=str(other))
    return {"lora_name": "x", "lora_int_id": 5, "lora_path": str(path)}


def prepare_rank_too_large(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, r=2 * MAX_RANK)
    return ours(path, version, digest)


def rewritten(server, maker, version, change):
    staging = maker.save(server.adapter_root / f".tmp-{version}", seed=1)
    rewrite_tensors(staging, change)
    path, digest = publish_dir(staging, server.adapter_root, version, maker.fingerprint)
    return ours(path, version, digest)


def first_key(tensors, half):
    return sorted(k for k in tensors if f".lora_{half}." in k and "q_proj" in k)[0]


def prepare_shapes_of_another_model(server, maker, version, tmp):
    """Right names, wrong width: vLLM would only find out when a request activates it, inside a step."""
    import torch

    def widen(tensors):
        key = first_key(tensors, "A")
        tensors[key] = torch.cat([tensors[key], tensors[key][:, :1]], dim=1)

    return rewritten(server, maker, version, widen)


def prepare_tensor_rank_above_the_config(server, maker, version, tmp):
    """adapter_config.json says r=8, the tensors hold rank 16: the slots vLLM allocates hold maxLoraRank."""
    import torch

    def deepen(tensors):
        a, b = first_key(tensors, "A"), first_key(tensors, "B")
        tensors[a] = torch.cat([tensors[a], tensors[a]], dim=0)
        tensors[b] = torch.cat([tensors[b], tensors[b]], dim=1)

    return rewritten(server, maker, version, deepen)


def prepare_no_tensors(server, maker, version, tmp):
    """What PEFT's state dict gives under FSDP activation checkpointing (module names with a wrapper's
    segment match no key): an engine would serve it as the base model under the adapter's name."""
    return rewritten(server, maker, version, lambda tensors: tensors.clear())


def prepare_lora_a_without_b(server, maker, version, tmp):
    return rewritten(server, maker, version, lambda tensors: tensors.pop(first_key(tensors, "B")))


def prepare_halves_of_other_ranks(server, maker, version, tmp):
    def narrow(tensors):
        key = first_key(tensors, "B")
        tensors[key] = tensors[key][:, :-1].contiguous()

    return rewritten(server, maker, version, narrow)


def prepare_foreign_tensor(server, maker, version, tmp):
    import torch

    return rewritten(server, maker, version, lambda tensors: tensors.update(
        {"base_model.model.model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}))


def prepare_modules_to_save(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, modules_to_save=["lm_head"])
    return ours(path, version, digest)


def prepare_dora(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, use_dora=True)
    return ours(path, version, digest)


def prepare_bias(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, bias="all")
    return ours(path, version, digest)


def prepare_lm_head_target(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, target_modules=["q_proj", "lm_head"])
    return ours(path, version, digest)


def prepare_embedding_target(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1, target_modules=["embed_tokens", "v_proj"])
    return ours(path, version, digest)


def prepare_tampered_file(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    with (path / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\0")
    return ours(path, version, digest)


def prepare_tampered_tensor_bytes(server, maker, version, tmp):
    """Still a valid safetensors file (the header is intact): only the checksum, verified while the
    engine loads it, can catch this; the engine must never serve it."""
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40
    weights.write_bytes(bytes(data))
    return ours(path, version, digest)


def prepare_extra_file(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    (path / "injected.py").write_text("print('hi')")
    return ours(path, version, digest)


def prepare_wrong_sha(server, maker, version, tmp):
    path, _ = maker.publish(server.adapter_root, version, seed=1)
    return ours(path, version, "f" * 64)


def prepare_no_manifest(server, maker, version, tmp):
    path = maker.save(server.adapter_root / f"v{version}", seed=1)
    return ours(path, version, "f" * 64)


def prepare_manifest_of_another_version(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    moved = server.adapter_root / f"v{version + 1000}"
    os.rename(path, moved)
    return ours(moved, version + 1000, digest)


def prepare_engine_cannot_load(server, maker, version, tmp):
    staging = maker.save(server.adapter_root / f".tmp-{version}", seed=1)
    edit_config(staging, target_modules=["no_such_proj"])
    path, digest = publish_dir(staging, server.adapter_root, version, maker.fingerprint)
    return ours(path, version, digest)


def set_first_value(half, value):
    def change(tensors):
        tensors[first_key(tensors, half)][0, 0] = value

    return change


def prepare_nan_tensor(server, maker, version, tmp):
    """Well-formed, checksummed and loadable: only reading the values shows every generation would fail."""
    return rewritten(server, maker, version, set_first_value("B", math.nan))


def prepare_inf_tensor(server, maker, version, tmp):
    return rewritten(server, maker, version, set_first_value("A", -math.inf))


def prepare_nan_axolotl(server, maker, version, tmp):
    path = maker.save(server.adapter_root / f"axo-nan-{version}", seed=1)
    rewrite_tensors(path, set_first_value("B", math.nan))
    return {"lora_name": "x", "lora_int_id": 7, "lora_path": str(path)}


def prepare_nan_bin(server, maker, version, tmp):
    """PEFT's pickled format, read with torch.load(weights_only=True) for the same check."""
    import torch
    from safetensors.torch import load_file

    staging = maker.save(server.adapter_root / f".tmp-{version}", seed=1)
    tensors = load_file(str(staging / "adapter_model.safetensors"))
    set_first_value("B", math.nan)(tensors)
    torch.save(tensors, staging / "adapter_model.bin")
    (staging / "adapter_model.safetensors").unlink()
    path, digest = publish_dir(staging, server.adapter_root, version, maker.fingerprint)
    return ours(path, version, digest)


def prepare_symlinked_weights(server, maker, version, tmp):
    """The manifest's digest matches, but the bytes live outside the root: the link itself is refused."""
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    weights = path / "adapter_model.safetensors"
    outside = tmp / "weights-outside.safetensors"
    shutil.move(weights, outside)
    weights.symlink_to(outside)
    return ours(path, version, digest)


def prepare_symlinked_subdirectory(server, maker, version, tmp):
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    (tmp / "outside-dir").mkdir()
    (tmp / "outside-dir" / "notes.txt").write_text("outside")
    (path / "extra").symlink_to(tmp / "outside-dir", target_is_directory=True)
    return ours(path, version, digest)


def prepare_internal_symlink(server, maker, version, tmp):
    """A link that stays inside the directory is refused too: a version holds regular files only."""
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    (path / "config-link.json").symlink_to("adapter_config.json")
    return ours(path, version, digest)


def prepare_manifest_dotdot_entry(server, maker, version, tmp):
    secret = server.adapter_root.parent / f"secret-{version}.bin"
    secret.write_bytes(os.urandom(64))
    path, _ = maker.publish(server.adapter_root, version, seed=1)
    digest = add_manifest_entry(path, f"../../{secret.name}", hashlib.sha256(secret.read_bytes()).hexdigest())
    return ours(path, version, digest)


def prepare_manifest_absolute_entry(server, maker, version, tmp):
    secret = tmp / "secret.bin"
    secret.write_bytes(os.urandom(64))
    path, _ = maker.publish(server.adapter_root, version, seed=1)
    digest = add_manifest_entry(path, str(secret), hashlib.sha256(secret.read_bytes()).hexdigest())
    return ours(path, version, digest)


def prepare_fifo(server, maker, version, tmp):
    """A FIFO would block whoever opens it: refused before any file is read."""
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    os.mkfifo(path / "pipe")
    return ours(path, version, digest)


REFUSALS: list[tuple[str, Callable[..., dict[str, Any]], int, str]] = [
    ("absolute path outside the root", prepare_outside_root, 403, "adapter_outside_root"),
    ("dot-dot escape", prepare_dotdot, 403, "adapter_outside_root"),
    ("symlink out of the root", prepare_symlink, 403, "adapter_outside_root"),
    ("missing directory", prepare_missing_dir, 404, "adapter_missing"),
    ("missing adapter_config.json", prepare_missing_config, 422, "adapter_config_invalid"),
    ("malformed adapter_config.json", prepare_malformed_config, 422, "adapter_config_invalid"),
    ("manifest of another base model", prepare_other_base_manifest, 409, "adapter_base_model_mismatch"),
    ("axolotl adapter of another base model", prepare_other_base_axolotl, 409, "adapter_base_model_mismatch"),
    ("rank above maxLoraRank", prepare_rank_too_large, 422, "adapter_rank_too_large"),
    ("tensor rank above the config's", prepare_tensor_rank_above_the_config, 422, "adapter_rank_too_large"),
    ("tensors shaped for another model", prepare_shapes_of_another_model, 409, "adapter_base_model_mismatch"),
    ("no LoRA tensors", prepare_no_tensors, 422, "adapter_weights_invalid"),
    ("lora_A without its lora_B", prepare_lora_a_without_b, 422, "adapter_weights_invalid"),
    ("lora_A and lora_B of other ranks", prepare_halves_of_other_ranks, 422, "adapter_weights_invalid"),
    ("a tensor that is not a LoRA weight", prepare_foreign_tensor, 422, "adapter_unsupported"),
    ("modules_to_save", prepare_modules_to_save, 422, "adapter_unsupported"),
    ("DoRA", prepare_dora, 422, "adapter_unsupported"),
    ("bias", prepare_bias, 422, "adapter_unsupported"),
    ("lm_head target", prepare_lm_head_target, 422, "adapter_unsupported"),
    ("embedding target", prepare_embedding_target, 422, "adapter_unsupported"),
    ("file changed after publication", prepare_tampered_file, 409, "adapter_checksum_mismatch"),
    ("tensor bytes changed after publication", prepare_tampered_tensor_bytes, 409, "adapter_checksum_mismatch"),
    ("file not in the manifest", prepare_extra_file, 409, "adapter_checksum_mismatch"),
    ("sha256 not the manifest digest", prepare_wrong_sha, 409, "adapter_checksum_mismatch"),
    ("manifest missing", prepare_no_manifest, 409, "adapter_checksum_mismatch"),
    ("manifest of another version", prepare_manifest_of_another_version, 422, "adapter_config_invalid"),
    ("engine cannot load it", prepare_engine_cannot_load, 422, "adapter_load_failed"),
    ("NaN in a tensor", prepare_nan_tensor, 422, "adapter_weights_invalid"),
    ("Inf in a tensor", prepare_inf_tensor, 422, "adapter_weights_invalid"),
    ("NaN in an axolotl adapter", prepare_nan_axolotl, 422, "adapter_weights_invalid"),
    ("NaN in adapter_model.bin", prepare_nan_bin, 422, "adapter_weights_invalid"),
    ("weights symlinked from outside the root", prepare_symlinked_weights, 403, "adapter_outside_root"),
    ("subdirectory symlinked from outside", prepare_symlinked_subdirectory, 403, "adapter_outside_root"),
    ("symlink inside the version", prepare_internal_symlink, 403, "adapter_outside_root"),
    ("manifest entry with ..", prepare_manifest_dotdot_entry, 403, "adapter_outside_root"),
    ("absolute manifest entry", prepare_manifest_absolute_entry, 403, "adapter_outside_root"),
    ("FIFO in the version", prepare_fifo, 422, "adapter_config_invalid"),
]


@pytest.mark.parametrize(("case", "prepare", "status", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_adapters_get_4xx_with_the_reason_and_the_previous_adapter_stays(
    server, maker, next_version, loaded, tmp_path, case, prepare, status, reason
):
    if case == "engine cannot load it" and SERVED_ENGINE == "vllm":
        pytest.skip("vLLM serves the tensors and ignores target_modules: this adapter loads there")
    before, _ = first_token_distribution(server)
    body = prepare(server, maker, next_version(), tmp_path)
    response = trigger(server, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["error"] == reason and error["message"]
    assert active_version(server) == loaded
    after, versions = first_token_distribution(server)
    assert versions == [loaded, loaded]
    assert same_distribution(before, after), (before, after)
    served = [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]]
    assert not any(name.startswith("policy-v") and int(name[8:]) > loaded for name in served), served
    metrics = httpx.get(server.url + "/metrics").text
    assert f'grpo_server_adapter_load_failures_total{{reason="{reason}"}}' in metrics


def escape_by_dotdot_entry(path: Path, secret: Path) -> str:
    return add_manifest_entry(path, os.path.relpath(secret, path), "0" * 64)


def escape_by_absolute_entry(path: Path, secret: Path) -> str:
    return add_manifest_entry(path, str(secret), "0" * 64)


def escape_by_symlink(path: Path, secret: Path) -> str:
    (path / "notes.bin").symlink_to(secret)
    return add_manifest_entry(path, "notes.bin", "0" * 64)


ESCAPES = [escape_by_dotdot_entry, escape_by_absolute_entry, escape_by_symlink]


@pytest.mark.parametrize("escape", ESCAPES, ids=[e.__name__ for e in ESCAPES])
def test_refusals_say_nothing_about_a_file_outside_the_adapter_root(server, maker, next_version, tmp_path, escape):
    secret = tmp_path / "secret.bin"
    data = os.urandom(77777)
    secret.write_bytes(data)
    version = next_version()
    path, _ = maker.publish(server.adapter_root, version, seed=1)
    digest = escape(path, secret)  # the manifest's true digest: only its entries can be refused
    present = trigger(server, ours(path, version, digest))
    secret.unlink()
    absent = trigger(server, ours(path, version, digest))
    assert present.status_code == 403 and present.json()["error"] == "adapter_outside_root", present.text
    assert present.json() == absent.json()  # the same answer whether the outside file exists or not
    message = present.json()["message"]
    assert hashlib.sha256(data).hexdigest() not in message and "77777" not in message


def test_trigger_payloads_must_be_one_form_with_a_version(server):
    both = trigger(server, {"path": "v1", "version": 1, "sha256": "x", "lora_path": "v1"})
    neither = trigger(server, {"lora_name": "x"})
    no_version = trigger(server, {"path": "v1", "sha256": "x"})
    bad_version = trigger(server, {"path": "v1", "version": 0, "sha256": "x"})
    for response in (both, neither, no_version, bad_version):
        assert response.status_code == 400 and response.json()["error"] == "invalid_request"


def test_trigger_without_token_is_401_and_loads_nothing(server, maker, next_version, loaded):
    version = next_version()
    path, digest = maker.publish(server.adapter_root, version, seed=1)
    assert trigger(server, ours(path, version, digest), auth=False).status_code == 401
    wrong = httpx.post(server.url + "/set_lora_adapter/", json=ours(path, version, digest), timeout=30,
                       headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401
    assert active_version(server) == loaded
