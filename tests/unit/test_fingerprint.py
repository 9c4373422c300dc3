"""The base-model fingerprint covers the weights' bytes, caches their digests, and never needs to write."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from grpo_api.fingerprint import beside_cache_path, model_fingerprint, user_cache_path

FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{32}$")
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2}


def make_model(directory: Path, seed: int) -> Path:
    """config.json and two safetensors shards: same shapes and file sizes for every seed, other values."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    generator = torch.Generator().manual_seed(seed)
    for shard in (1, 2):
        tensors = {f"layers.{shard}.weight": torch.randn(16, 16, generator=generator)}
        save_file(tensors, str(directory / f"model-0000{shard}-of-00002.safetensors"), metadata={"format": "pt"})
    return directory


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def cache_entries(path: Path) -> dict[str, dict[str, object]]:
    entries: dict[str, dict[str, object]] = json.loads(path.read_text())["files"]
    return entries


def test_checkpoints_of_one_shape_and_file_size_with_other_weights_have_other_fingerprints(tmp_path):
    base = make_model(tmp_path / "base", seed=0)
    tuned = make_model(tmp_path / "tuned", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert [p.stat().st_size for p in weight_files(base)] == [p.stat().st_size for p in weight_files(tuned)]
    assert FINGERPRINT.match(model_fingerprint(base))
    assert model_fingerprint(base) != model_fingerprint(tuned)
    assert model_fingerprint(base) == model_fingerprint(copy)


def test_the_digests_are_cached_beside_the_model_and_read_again_only_when_size_or_mtime_change(tmp_path):
    model = make_model(tmp_path / "model", seed=0)
    original = model_fingerprint(model)
    cache = beside_cache_path(model)
    entries = cache_entries(cache)
    for path in weight_files(model):
        entry = entries[path.name]
        stat = path.stat()
        assert entry == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                         "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}

    # a digest the cache made up is believed while size and mtime match: the weights were not read again
    first = weight_files(model)[0]
    content = json.loads(cache.read_text())
    content["files"][first.name]["sha256"] = "0" * 64
    cache.write_text(json.dumps(content))
    assert model_fingerprint(model) != original

    # a new mtime makes the file read again, and the cache is corrected
    stat = first.stat()
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(model) == original
    assert cache_entries(cache)[first.name]["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()


def test_weights_changed_in_place_change_the_fingerprint_despite_the_cache(tmp_path):
    model = make_model(tmp_path / "model", seed=0)
    original = model_fingerprint(model)
    first = weight_files(model)[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01  # same size, other bytes, a new mtime
    first.write_bytes(bytes(data))
    assert model_fingerprint(model) != original


def test_a_corrupt_cache_is_ignored_and_replaced(tmp_path):
    model = make_model(tmp_path / "model", seed=0)
    original = model_fingerprint(model)
    (beside_cache_path(model)).write_text("{not json")
    assert model_fingerprint(model) == original
    assert set(cache_entries(beside_cache_path(model))) == {p.name for p in weight_files(model)}


def test_a_cache_that_cannot_be_written_beside_the_model_goes_to_xdg_cache_home(tmp_path, monkeypatch):
    model = make_model(tmp_path / "model", seed=0)
    expected = model_fingerprint(make_model(tmp_path / "twin", seed=0))
    (beside_cache_path(model)).mkdir()  # even root cannot rename a file over a directory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_fingerprint(model) == expected
    cached = user_cache_path(model.resolve())
    assert cached is not None and cached.is_relative_to(tmp_path / "xdg" / "grpo" / "fingerprints")
    assert json.loads(cached.read_text())["path"] == str(model.resolve())
    assert set(cache_entries(cached)) == {p.name for p in weight_files(model)}


# ------------------------------------------------------------------------------------ read-only model directory

FINGERPRINT_CODE = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from grpo_api.fingerprint import model_fingerprint\n"
    "assert not os.access(sys.argv[1], os.W_OK), 'the model directory is writable'\n"
    "print(model_fingerprint(Path(sys.argv[1])))\n"
)


@contextmanager
def read_only(model: Path) -> Iterator[list[str]]:
    """The command prefix that runs a program with `model` read-only: a read-only bind mount in a private
    mount namespace as root (root ignores permissions), else permissions. Skips where neither works."""
    if os.geteuid() != 0:
        paths = [model, *model.rglob("*")]
        modes = {p: p.stat().st_mode for p in paths}
        for p in paths:
            p.chmod(modes[p] & ~0o222)
        try:
            yield []
        finally:
            for p in paths:
                p.chmod(modes[p])
        return
    script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'
    prefix = ["unshare", "--mount", "sh", "-c", script, "sh", str(model)]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only directory here (running as root without unshare/mount)")
    yield prefix


def fingerprint_in_subprocess(prefix: list[str], model: Path, env: dict[str, str]) -> str:
    done = subprocess.run([*prefix, sys.executable, "-c", FINGERPRINT_CODE, str(model)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_read_only_model_directory_is_fingerprinted_with_the_cache_in_xdg_cache_home(tmp_path, monkeypatch):
    model = make_model(tmp_path / "volume" / "model", seed=0)  # the whole volume read-only, as a claim or image
    expected = model_fingerprint(make_model(tmp_path / "twin", seed=0))
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))  # where this process looks for what the subprocess wrote
    with read_only(model.parent) as prefix:
        assert fingerprint_in_subprocess(prefix, model, {"XDG_CACHE_HOME": str(xdg)}) == expected
        assert not (beside_cache_path(model)).exists()
        cached = user_cache_path(model.resolve())
        assert cached is not None and cached.is_relative_to(xdg)
        content = json.loads(cached.read_text())
        assert content["path"] == str(model.resolve())

        # the next start reads the digests from there instead of the weights
        first = weight_files(model)[0].name
        content["files"][first]["sha256"] = "0" * 64
        cached.write_text(json.dumps(content))
        assert fingerprint_in_subprocess(prefix, model, {"XDG_CACHE_HOME": str(xdg)}) != expected


def test_with_nothing_writable_the_fingerprint_is_computed_anyway(tmp_path):
    model = make_model(tmp_path / "volume" / "model", seed=0)
    expected = model_fingerprint(make_model(tmp_path / "twin", seed=0))
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    unwritable = {"XDG_CACHE_HOME": str(not_a_dir / "cache"), "HOME": str(not_a_dir)}
    with read_only(model.parent) as prefix:
        assert fingerprint_in_subprocess(prefix, model, unwritable) == expected
        assert fingerprint_in_subprocess(prefix, model, unwritable) == expected
    assert not (beside_cache_path(model)).exists()
