"""Adapter loads over HTTP with hostile request bodies and hostile files in the adapter root.

Every refusal is a 4xx naming the field or file, and nothing a refused adapter holds touches what
the server serves: the previous adapter stays active with the same outputs, and so does the base
model. Complements test_adapters.py (paths, manifests, shapes, ranks, NaN weights, symlinks) with
adapter_config.json values the engine would act on (PEFT runs its inits, layer surgery and regular
expressions when it loads an adapter), tensor names and dtypes no engine loads as written, paths the
file system cannot take, and files too large to read or hash. Most loads go through vLLM's
`/v1/load_lora_adapter`, which has no manifest to bind the files: the server's own checks are all
that stands between the files and the engine.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.adapters import MANIFEST_NAME
from tests.fixtures.server import RunningServer, start_server
from tests.fixtures.server_requests import active_version, first_token_distribution, same_distribution
from tests.server.adapters import LoraMaker, add_manifest_entry, edit_config, rewrite_tensors

MAX_RANK = 8
BASE = "tiny:base"
_names = itertools.count(1)


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("hostile-adapters"), served_model_dir,
                           server_overrides={"maxLoraRank": MAX_RANK, "maxLoras": 4})
    yield running
    running.stop(timeout=10)


@pytest.fixture(scope="module")
def maker(served_model_dir: Path) -> LoraMaker:
    return LoraMaker(served_model_dir)


def load(server: RunningServer, name: str, path: Path | str, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=server.auth, timeout=timeout)


def fresh(server: RunningServer, maker: LoraMaker, prefix: str) -> tuple[str, Path]:
    """A new adapter name (no `-v<N>`: the server numbers it) and a saved, valid adapter under the root."""
    name = f"{prefix}-{next(_names)}"
    return name, maker.save(server.adapter_root / "hostile" / name, seed=next(_names))


@pytest.fixture
def loaded(server: RunningServer, maker: LoraMaker) -> int:
    """A good adapter, active: the one a refusal must leave serving."""
    name, path = fresh(server, maker, "good")
    response = load(server, name, path)
    assert response.status_code == 200, response.text
    return int(response.json()["adapter"]["version"])


def assert_refused_and_nothing_changed(
    server: RunningServer, loaded: int, before: dict[str, list[dict[str, float]]], response: httpx.Response,
    status: int, reason: str, names: tuple[str, ...],
) -> None:
    base, _ = first_token_distribution(server, BASE)  # first: the harm an adapter accepted in error may have done
    assert same_distribution(before[BASE], base), ("the base model changed", before[BASE], base)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["error"] == reason, error
    for word in names:
        assert word in error["message"], error
    assert active_version(server) == loaded
    after, versions = first_token_distribution(server, "tiny")
    assert same_distribution(before["tiny"], after), ("the active adapter changed", before["tiny"], after)
    assert versions == [loaded, loaded]


def snapshot(server: RunningServer) -> dict[str, list[dict[str, float]]]:
    """First-token distributions of the active adapter and of the base model."""
    return {model: first_token_distribution(server, model)[0] for model in ("tiny", BASE)}


def write_config_text(path: Path, text: str) -> None:
    (path / "adapter_config.json").write_text(text)


def raw_value(field: str, raw: str) -> Callable[[Path], None]:
    """Set a field of adapter_config.json to a raw JSON token (NaN, Infinity: Python's json reads them)."""

    def change(path: Path) -> None:
        config = json.loads((path / "adapter_config.json").read_text())
        config[field] = "__RAW__"
        write_config_text(path, json.dumps(config).replace('"__RAW__"', raw))

    return change


def value(**changes: Any) -> Callable[[Path], None]:
    return lambda path: edit_config(path, **changes)


# ---------------------------------------------------------------- adapter_config.json values

CONFIG_VALUES: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("target_modules a number", value(target_modules=5), ("adapter_config.json", "target_modules")),
    ("rank_pattern a list", value(rank_pattern=[4, 4]), ("adapter_config.json", "rank_pattern")),
    ("lora_alpha NaN", raw_value("lora_alpha", "NaN"), ("adapter_config.json", "lora_alpha")),
    ("lora_alpha Infinity", raw_value("lora_alpha", "Infinity"), ("adapter_config.json", "lora_alpha")),
    ("lora_alpha 1e400", raw_value("lora_alpha", "1e400"), ("adapter_config.json", "lora_alpha")),
    ("alpha_pattern NaN", raw_value("alpha_pattern", '{"q_proj": NaN}'), ("adapter_config.json", "alpha_pattern")),
    ("deeply nested JSON", lambda path: write_config_text(path, "[" * 100_000 + "]" * 100_000),
     ("adapter_config.json",)),
]


@pytest.mark.parametrize(("case", "change", "names"), CONFIG_VALUES, ids=[c[0] for c in CONFIG_VALUES])
def test_hostile_adapter_config_values_get_a_422_naming_the_field(server, maker, loaded, case, change, names):
    before = snapshot(server)
    name, path = fresh(server, maker, "config")
    change(path)
    response = load(server, name, path)
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_config_invalid", names)


# ---------------------------------------------------------------- configs PEFT would act on the base model with

BASE_REWRITES: list[tuple[str, Callable[[Path], None], str]] = [
    # PiSSA, OLoRA: PEFT's init subtracts the adapter's principal part from the base layers' weights
    ("init_lora_weights pissa", value(init_lora_weights="pissa_niter_2"), "init_lora_weights"),
    ("init_lora_weights olora", value(init_lora_weights="olora"), "init_lora_weights"),
    # PEFT duplicates decoder layers of the base model itself: every later generation fails
    ("layer_replication", value(layer_replication=[[0, 2], [0, 2]]), "layer_replication"),
    # activated LoRA: the transformers engine applies it only after the invocation tokens, vLLM everywhere
    ("alora_invocation_tokens", value(alora_invocation_tokens=[6]), "alora_invocation_tokens"),
]


@pytest.mark.parametrize(("case", "change", "field"), BASE_REWRITES, ids=[c[0] for c in BASE_REWRITES])
def test_an_adapter_config_that_rewrites_the_base_model_or_is_no_plain_lora_is_refused_and_the_base_stays(
    server, maker, loaded, case, change, field
):
    before = snapshot(server)
    name, path = fresh(server, maker, "rewrite")
    change(path)
    response = load(server, name, path)
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_unsupported",
                                       ("adapter_config.json", field))


def test_kasa_on_a_server_with_no_adapter_loaded_is_refused_and_the_base_stays(server, maker):
    """KaSA truncates the base layers' singular values. PEFT itself refuses to mix it with a loaded adapter,
    so the engine must hold none: a client clears the active version and unloads the others."""
    cleared = httpx.post(server.url + "/clear_lora_adapter/", headers=server.auth, timeout=30)
    assert cleared.status_code == 200, cleared.text
    for card in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]:
        if card["id"] not in ("tiny", BASE):
            unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": card["id"]},
                                  headers=server.auth, timeout=30)
            assert unloaded.status_code == 200, unloaded.text
    time.sleep(0.5)  # the engine drops them in the background
    base = first_token_distribution(server, BASE)[0]
    name, path = fresh(server, maker, "kasa")
    edit_config(path, kasa_config={})
    response = load(server, name, path)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "adapter_unsupported" and "kasa_config" in response.json()["message"]
    assert active_version(server) is None
    for model in ("tiny", BASE):
        after, versions = first_token_distribution(server, model)
        assert same_distribution(base, after) and versions == [None, None], (model, base, after)


# ---------------------------------------------------------------- tensors


def first_key(tensors: dict[str, Any], half: str) -> str:
    return sorted(k for k in tensors if f".lora_{half}." in k and "q_proj" in k)[0]


def with_a_segment(segment: str) -> Callable[[dict[str, Any]], None]:
    """`<module>.lora_A.<segment>.weight`: the transformers engine loads none of them (lora_B stays zero)."""

    def change(tensors: dict[str, Any]) -> None:
        for key in list(tensors):
            half = ".lora_A." if ".lora_A." in key else ".lora_B."
            tensors[key.replace(half, f"{half}{segment}.")] = tensors.pop(key)

    return change


def float8_with_a_nan(tensors: dict[str, Any]) -> None:
    import torch

    for key in list(tensors):
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    tensors[first_key(tensors, "B")][0, 0] = float("nan")


def float4(tensors: dict[str, Any]) -> None:
    import torch

    for key in list(tensors):  # two values a byte: the header's shape is the unpacked one
        rows, cols = tensors[key].shape
        tensors[key] = torch.zeros(rows, cols // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)


TENSORS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("a segment after lora_A (PEFT's adapter name)", with_a_segment("default"), "adapter_unsupported",
     "lora_A.default"),
    ("a segment after lora_A (the version's engine name)", with_a_segment("policy-v99"), "adapter_unsupported",
     "lora_A.policy-v99"),
    ("float8 holding a NaN", float8_with_a_nan, "adapter_weights_invalid", "non-finite"),
    ("float4", float4, "adapter_weights_invalid", "float4"),
]


@pytest.mark.parametrize(("case", "change", "reason", "word"), TENSORS, ids=[c[0] for c in TENSORS])
def test_tensors_no_engine_serves_as_written_get_a_422_naming_them(server, maker, loaded, case, change, reason, word):
    before = snapshot(server)
    name, path = fresh(server, maker, "tensors")
    rewrite_tensors(path, change)
    response = load(server, name, path)
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, reason,
                                       ("adapter_model.safetensors", word))


# ---------------------------------------------------------------- paths the file system cannot take


def link_loop(server: RunningServer) -> str:
    loop = server.adapter_root / "hostile" / f"loop-{next(_names)}"
    loop.parent.mkdir(parents=True, exist_ok=True)
    loop.symlink_to(loop.name)  # resolving it raises RuntimeError, not OSError
    return str(loop)


PATHS: list[tuple[str, Callable[[RunningServer], str]]] = [
    ("a component of 300 characters", lambda server: "a" * 300),
    ("a nested component of 256 characters", lambda server: "hostile/" + "b" * 256 + "/c"),
    ("a symbolic link to itself", link_loop),
]


@pytest.mark.parametrize(("case", "lora_path"), PATHS, ids=[p[0] for p in PATHS])
def test_a_path_the_file_system_cannot_take_is_a_404(server, loaded, case, lora_path):
    before = snapshot(server)
    response = load(server, "odd-path", lora_path(server))
    assert_refused_and_nothing_changed(server, loaded, before, response, 404, "adapter_missing", ("usable path",))


def nest_past_path_max(path: Path) -> None:
    """Directories nested deeper than PATH_MAX (4096) allows to name from the root: made one level at a time."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(25):
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)


def test_a_tree_nested_past_path_max_in_the_adapter_is_a_422(server, maker, loaded):
    before = snapshot(server)
    name, path = fresh(server, maker, "deep")
    nest_past_path_max(path)
    response = load(server, name, path)
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_config_invalid",
                                       (str(path), "cannot be listed"))


# ---------------------------------------------------------------- huge files (sparse: no disk, no time to make)

TIB = 1 << 40  # above any machine's memory: reading it whole is a MemoryError, or the OOM killer


def test_a_huge_adapter_config_is_refused_before_it_is_read(server, maker, loaded):
    before = snapshot(server)
    name, path = fresh(server, maker, "huge-config")
    os.truncate(path / "adapter_config.json", TIB)
    response = load(server, name, path)
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_config_invalid",
                                       ("adapter_config.json",))


def ours(server: RunningServer, path: Path, version: int, digest: str) -> httpx.Response:
    return httpx.post(server.url + "/set_lora_adapter/", json={"path": str(path), "version": version, "sha256": digest},
                      headers=server.auth, timeout=60)


def test_a_huge_manifest_is_refused_before_it_is_read(server, maker, loaded):
    before = snapshot(server)
    version = 1_000_000 + next(_names)
    path, digest = maker.publish(server.adapter_root, version, seed=version)
    os.truncate(path / MANIFEST_NAME, TIB)
    response = ours(server, path, version, digest)
    assert_refused_and_nothing_changed(server, loaded, before, response, 409, "adapter_checksum_mismatch",
                                       (MANIFEST_NAME,))


def test_a_huge_file_the_manifest_lists_is_refused_before_it_is_hashed(server, maker, loaded):
    """Hashing a terabyte takes the better part of an hour, holding the trigger lock: every later load is
    answered adapter_load_busy meanwhile, and a trainer's sync fails."""
    before = snapshot(server)
    version = 1_000_000 + next(_names)
    path, _ = maker.publish(server.adapter_root, version, seed=version)
    with (path / "notes.bin").open("wb") as notes:
        notes.truncate(TIB)
    digest = add_manifest_entry(path, "notes.bin", "0" * 64)
    started = time.monotonic()
    response = ours(server, path, version, digest)
    assert time.monotonic() - started < 30
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_config_invalid",
                                       ("notes.bin", "at most"))


# ---------------------------------------------------------------- regular expressions from adapter_config.json

REGEXES: list[tuple[str, Callable[[Path], None], str]] = [
    ("target_modules invalid", value(target_modules="(q_proj"), "target_modules"),  # was a 500 (re.error)
    # backtrack 4^n on a module name of n characters, in the server's checks and in PEFT's module matching
    ("target_modules backtracking", value(target_modules="(.|.|.|.)*X"), "target_modules"),
    ("rank_pattern key backtracking", value(rank_pattern={"(.|.|.|.)*X": 4}), "rank_pattern"),
]


@pytest.mark.parametrize(("case", "change", "field"), REGEXES, ids=[c[0] for c in REGEXES])
def test_a_regex_in_adapter_config_is_refused_without_running_it(server, maker, loaded, case, change, field):
    """Runs last: before the fix a backtracking one held the server's interpreter for hours."""
    before = snapshot(server)
    name, path = fresh(server, maker, "regex")
    change(path)
    started = time.monotonic()
    response = load(server, name, path, timeout=60)
    assert time.monotonic() - started < 30
    assert_refused_and_nothing_changed(server, loaded, before, response, 422, "adapter_unsupported",
                                       ("adapter_config.json", field))
    assert server.health()["_status_code"] == 200


@pytest.mark.parametrize("name", ["tiny", BASE])
def test_an_adapter_named_as_the_served_model_is_refused(server, maker, loaded, name):
    """A request for the served model's name selects the active adapter, and `<served>:base` the base model:
    an adapter loaded under either name could never be selected by it, and /v1/models would list the id twice."""
    _, path = fresh(server, maker, "shadow")
    response = load(server, name, path)
    assert response.status_code == 400, response.text
    assert "lora_name" in response.json()["message"], response.text
    assert active_version(server) == loaded
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models", headers=server.auth, timeout=10).json()["data"]]
    assert len(ids) == len(set(ids)), ids
