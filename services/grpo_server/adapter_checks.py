"""Checks an adapter directory passes before the engine sees it.

Refusals carry one of `grpo_api.protocol.ADAPTER_REFUSALS` and a message naming the
file or field. The path is confined to the adapter root before anything is read, and
every file the adapter holds or its manifest names must lie inside its directory: a
symbolic link anywhere in it (whatever it points to), a special file, or an absolute or
`..` manifest entry is refused before any file is opened, so no message says anything
(digest, size, existence) about a file outside the adapter root.

Two stages, so the server can hash the files while the engine loads them:
`inspect_adapter` reads the manifest, adapter_config.json and the safetensors header
(small reads); `verify_adapter_files` checks every file against the manifest's
digest (BLAKE3, or sha256 for an earlier manifest: the bulk of the bytes), then reads
the tensors one at a time and refuses non-finite values (NaN or Inf weights would make
every generation on the adapter fail).
The server activates a version only after both passed. When inspection fails on a
version that has a manifest, the files are verified first, so a file changed after
publication is reported as that (`adapter_checksum_mismatch`), not as whatever parse
error the change caused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from grpo_api.adapters import (
    MANIFEST_NAME,
    AdapterManifest,
    ManifestError,
    ManifestPathError,
    directory_files,
    read_manifest,
    verify_files,
)
from grpo_api.protocol import ADAPTER_REFUSALS
from grpo_server.errors import ServerError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: Module names vLLM cannot serve LoRA on (embeddings and output head).
EMBEDDING_MODULES = frozenset({"lm_head", "embed_tokens", "wte", "wpe", "embed_in", "embed_out", "word_embeddings"})
#: Weight-key fragments of things plain LoRA serving cannot apply.
UNSUPPORTED_KEY_PARTS = ("modules_to_save", "lora_magnitude_vector", "lora_embedding_", "trainable_tokens")

#: adapter_config.json and grpo-manifest.json hold a few KiB; a larger one is refused before it is read.
MAX_JSON_BYTES = 1 << 20
#: Beyond the LoRA weights a version may hold this much more (safetensors header, configs, model card, tokenizer).
EXTRA_BYTES = 256 << 20
#: init_lora_weights values whose initialisation touches the adapter's own matrices only (the saved
#: weights replace them). PEFT runs the init when it creates the adapter, also to load one: PiSSA,
#: OLoRA, CorDA, LoftQ rewrite the base layers' weights, for every later request on the transformers engine.
PLAIN_INITS = frozenset({"gaussian", "orthogonal", "eva", "lora_ga", "mica"})
#: adapter_config.json fields that make PEFT build something other than plain LoRA unless they are null
#: (KaSA's `{}` counts: PEFT tests `is not None`).
NOT_PLAIN_LORA = {
    "layer_replication": "duplicates decoder layers of the base model",
    "kasa_config": "KaSA rewrites the base layers' weights",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
}
#: A name PEFT puts into a regular expression (rank_pattern and alpha_pattern keys, layers_pattern):
#: no quantifier, group, class or alternation, so matching it takes linear time.
PLAIN_PATTERN = re.compile(r"^[A-Za-z0-9_.^$-]{1,512}$")

#: HTTP status for each refusal reason.
REFUSAL_STATUS: dict[str, int] = {
    "adapter_outside_root": 403,
    "adapter_missing": 404,
    "adapter_config_invalid": 422,
    "adapter_base_model_mismatch": 409,
    "adapter_rank_too_large": 422,
    "adapter_unsupported": 422,
    "adapter_checksum_mismatch": 409,
    "adapter_load_failed": 422,
    "adapter_load_busy": 409,
    "adapter_version_stale": 409,
    "adapter_version_conflict": 409,
    "adapter_weights_invalid": 422,
}


class AdapterRefusal(ServerError):
    """An adapter the server will not load: the reason is the error, its status from REFUSAL_STATUS."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in ADAPTER_REFUSALS:
            raise ValueError(f"unknown refusal reason {reason}")
        super().__init__(message, status_code=REFUSAL_STATUS[reason], error=reason)
        self.reason = reason


@dataclass(frozen=True)
class ServedModel:
    """What an adapter must have been trained on."""

    name: str
    model_dir: Path
    fingerprint: str
    #: Linear layers of the served model: module name -> (out_features, in_features); empty: unknown.
    linear_shapes: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckedAdapter:
    path: Path  # resolved, inside the adapter root
    digest: str | None  # manifest digest, when there is a manifest
    manifest_version: int | None
    rank: int
    weights: Path  # adapter_model.safetensors or .bin, inside path
    manifest: AdapterManifest | None = None  # files still to verify (verify_adapter_files)


def confine(path: str, root: Path) -> Path:
    """The adapter directory resolved (symlinks, `..`) and required to lie strictly inside root.

    The refusal names the path as sent, not what it resolves to (that would describe the outside).
    """
    root_resolved = root.resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root_resolved / candidate
    try:
        resolved = candidate.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # too long, a link loop (RuntimeError)...
        raise _unusable(path, exc) from exc
    if resolved == root_resolved or not resolved.is_relative_to(root_resolved):
        raise AdapterRefusal("adapter_outside_root", f"{path} is not a directory inside the adapter root {root}")
    return resolved


def _unusable(path: str, exc: BaseException) -> AdapterRefusal:
    """A path nothing can be loaded from (a component too long, a link loop): named as sent, by the error's type."""
    shown = path if len(path) <= 200 else path[:200] + "…"
    return AdapterRefusal("adapter_missing", f"{shown} is not a usable path: {type(exc).__name__}")


def inspect_adapter(
    path: str,
    *,
    root: Path,
    served: ServedModel,
    max_rank: int,
    require_manifest: bool,
    expected_digest: str | None,
    version: int | None,
) -> CheckedAdapter:
    """Every check but the files' checksums; raise AdapterRefusal with the first problem found."""
    directory = confine(path, root)
    try:
        is_dir = directory.is_dir()
    except OSError as exc:  # ENAMETOOLONG and the like: is_dir() answers False only for a few errnos
        raise _unusable(path, exc) from exc
    if not is_dir:
        raise AdapterRefusal("adapter_missing", f"{directory} is not a directory")
    _check_sizes(directory, _check_tree(directory), _max_bytes(served, max_rank))
    manifest = _check_manifest(directory, served, require_manifest, expected_digest, version)
    try:
        config = _read_config(directory)
        rank = _check_rank(config, directory, max_rank)
        _check_supported(config, directory)
        weights = _weight_file(directory)
        _check_weights(weights, served, max_rank)
        if manifest is None:
            _check_base_model_name(config, directory, served)
    except AdapterRefusal:
        if manifest is not None:
            _verify(directory, manifest)  # a changed file is the real reason, if there is one
        raise
    return CheckedAdapter(
        path=directory,
        digest=manifest.digest() if manifest else None,
        manifest_version=manifest.version if manifest else None,
        rank=rank,
        weights=weights,
        manifest=manifest,
    )


def verify_adapter_files(checked: CheckedAdapter) -> None:
    """Every file matches the manifest (when there is one) and every tensor is finite; AdapterRefusal otherwise.

    The checksums and the finite check read the files side by side; a failed checksum is the reason
    reported, so a file changed after publication is reported as that, even when the change made a value
    non-finite.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:  # both read the weights: side by side, each releasing the GIL
        finite = pool.submit(_check_finite, checked.weights)
        if checked.manifest is not None:
            _verify(checked.path, checked.manifest)  # refuses first: the pool waits for the finite check
        else:
            _check_tree(checked.path)  # no manifest binds the files: list them again, as they are now
        finite.result()


def _check_tree(directory: Path) -> list[str]:
    """Regular files and directories only: no symlink (to anywhere), no FIFO or device; the files' relative paths."""
    try:
        return directory_files(directory)
    except ManifestPathError as exc:
        raise AdapterRefusal("adapter_outside_root", str(exc)) from exc
    except ManifestError as exc:
        raise AdapterRefusal("adapter_config_invalid", str(exc)) from exc
    except OSError as exc:  # a tree nested past PATH_MAX, an unreadable directory
        raise _unlistable(directory, exc) from exc


def _unlistable(directory: Path, exc: OSError) -> AdapterRefusal:
    return AdapterRefusal(
        "adapter_config_invalid", f"{directory} cannot be listed: {exc.strerror or type(exc).__name__}"
    )


def _max_bytes(served: ServedModel, max_rank: int) -> int | None:
    """The most bytes a version's files may hold: two copies of LoRA weights of maxLoraRank on every linear
    layer, at 8 bytes a value, plus EXTRA_BYTES; None when the served model's layers are unknown."""
    if not served.linear_shapes:
        return None
    values = sum(out_features + in_features for out_features, in_features in served.linear_shapes.values())
    return 2 * values * max_rank * 8 + EXTRA_BYTES


def _check_sizes(directory: Path, files: list[str], limit: int | None) -> None:
    """Refuse, before any byte is read or hashed, a version larger than any adapter of the served model."""
    if limit is None:
        return
    sizes: dict[str, int] = {}
    for rel in files:
        try:
            sizes[rel] = (directory / rel).lstat().st_size
        except OSError as exc:
            raise _unlistable(directory, exc) from exc
    total = sum(sizes.values())
    if total > limit:
        largest = max(sizes, key=lambda rel: sizes[rel])
        raise AdapterRefusal(
            "adapter_config_invalid",
            f"{directory} holds {total} bytes ({directory / largest}: {sizes[largest]}); an adapter of this "
            f"model with rank up to maxLoraRank holds at most {limit}",
        )


def _verify(directory: Path, manifest: AdapterManifest) -> None:
    try:
        verify_files(directory, manifest)
    except ManifestPathError as exc:
        raise AdapterRefusal("adapter_outside_root", str(exc)) from exc
    except ManifestError as exc:
        raise AdapterRefusal("adapter_checksum_mismatch", str(exc)) from exc
    except OSError as exc:  # listing the directory failed
        raise _unlistable(directory, exc) from exc


#: safetensors dtype -> (unsigned view of one value, the bits that are all set exactly when it is NaN or Inf):
#: the IEEE exponent field (float8 e4m3fn has no Inf, and its NaN is every bit but the sign; e8m0, a scale
#: format of exponent bits only, is NaN at 0xFF, where torch.isfinite on CPU answers True).
_NON_FINITE_BITS: dict[str, tuple[type[np.unsignedinteger[Any]], int]] = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),
    "F8_E8M0": (np.uint8, 0xFF),
}
#: Values tested per numpy call: bounds the temporaries (a few MiB), each call releases the GIL.
_FINITE_CHUNK = 1 << 22
#: Threads a file's chunks are tested on (the 74 MB of an r=32 adapter of a 1.5B model is 9 chunks).
_FINITE_THREADS = min(8, os.cpu_count() or 1)


def _check_finite(weights: Path) -> None:
    """Every floating-point tensor holds finite values only.

    A safetensors file is tested on its raw bytes, a few numpy calls over each run of tensors of one
    dtype: a check that takes the GIL back once per tensor (392 of them in an r=32 adapter of a 1.5B model)
    waits up to the interpreter's switch interval each time while the event loop is busy serving
    generations, which made a 74 MB adapter's checks take seconds beside generation (BENCHMARKS.md).
    Other files, and dtypes without a bit test, are read one tensor at a time with torch.
    """
    if weights.suffix == ".safetensors" and _safetensors_finite_by_bits(weights):
        return
    _check_finite_by_tensor(weights)


def _safetensors_finite_by_bits(weights: Path) -> bool:
    """True when every tensor of the file was tested by its bits and is finite; False when the file needs the
    per-tensor path (a dtype or layout not covered here). Raises AdapterRefusal naming a non-finite tensor."""
    try:  # O_NOFOLLOW: a link put in the file's place since its directory was inspected is not followed
        with open(os.open(weights, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
            data = np.memmap(handle, dtype=np.uint8, mode="r", offset=8 + header_size)
    except (OSError, ValueError):  # the per-tensor path reports the file as unreadable
        return False
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype in _NOT_FLOATING:
            continue
        if dtype not in _NON_FINITE_BITS:
            return False
        begin, end = entry.get("data_offsets", (None, None))
        width = np.dtype(_NON_FINITE_BITS[dtype][0]).itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data.size
                and (end - begin) % width == 0):
            return False
        entries.append((begin, end, dtype, key))
    entries.sort()
    runs: list[list[tuple[int, int, str, str]]] = []
    for entry in entries:  # contiguous tensors of one dtype are tested together
        if runs and runs[-1][-1][1] == entry[0] and runs[-1][-1][2] == entry[2]:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    with ThreadPoolExecutor(max_workers=_FINITE_THREADS) as pool:  # each run's chunks over the threads
        flagged = [_any_all_bits_set(data[run[0][0] : run[-1][1]], *_NON_FINITE_BITS[run[0][2]], pool)
                   for run in runs]
    for run, any_bad in zip(runs, flagged, strict=True):
        unsigned, bits = _NON_FINITE_BITS[run[0][2]]
        if any_bad:
            for begin, end, _, key in run:  # only now, one tensor at a time: which one
                if _any_all_bits_set(data[begin:end], unsigned, bits):
                    values = data[begin:end].view(unsigned)
                    bad = int(np.count_nonzero((values & unsigned(bits)) == bits))
                    raise AdapterRefusal(
                        "adapter_weights_invalid",
                        f"{weights}: tensor {key} holds {bad} non-finite value(s) (NaN or Inf) of {values.size}",
                    )
    return True


#: safetensors dtypes that hold no floating-point values (nothing to test).
_NOT_FLOATING = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


def _any_all_bits_set(
    raw: np.ndarray[Any, Any], unsigned: type[np.unsignedinteger[Any]], bits: int, pool: Executor | None = None
) -> bool:
    """Whether any value has every one of `bits` set, tested in chunks (spread over `pool`'s threads when given)."""
    values = raw.view(unsigned)
    mask = unsigned(bits)

    def chunk_flagged(start: int) -> bool:
        chunk = values[start : start + _FINITE_CHUNK]
        return bool(np.any((chunk & mask) == mask))

    starts = range(0, values.size, _FINITE_CHUNK)
    if pool is None or len(starts) < 2:
        return any(chunk_flagged(start) for start in starts)
    return any(list(pool.map(chunk_flagged, starts)))


def _check_finite_by_tensor(weights: Path) -> None:
    """Every floating-point tensor holds finite values only, read one tensor at a time."""
    import torch

    for key, tensor in _tensors(weights):
        if not tensor.is_floating_point():
            continue
        try:
            finite = torch.isfinite(tensor)
        except (NotImplementedError, RuntimeError):  # float8_e4m3fn and others: none on CPU
            try:
                finite = torch.isfinite(tensor.float())
            except (NotImplementedError, RuntimeError) as exc:  # float4: not even a cast
                raise AdapterRefusal(
                    "adapter_weights_invalid", f"{weights}: tensor {key} is {tensor.dtype}, which no engine serves"
                ) from exc
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise AdapterRefusal(
                "adapter_weights_invalid",
                f"{weights}: tensor {key} holds {bad} non-finite value(s) (NaN or Inf) of {tensor.numel()}",
            )


def _tensors(weights: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of an adapter's weights, one at a time; a .bin that torch cannot load safely yields none."""
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield key, handle.get_tensor(key)
        except AdapterRefusal:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise AdapterRefusal(
                "adapter_config_invalid", f"{weights} is not a readable safetensors file: {exc}"
            ) from exc
        return
    import torch

    try:  # memory-mapped where the file's format allows it; weights_only never runs pickled code
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # the engine's own loader decides about this file
        log.warning("%s: tensors not checked for finite values (%s: %s)", weights, type(exc).__name__, exc)
        return
    if isinstance(state, dict):
        yield from ((str(k), v) for k, v in state.items() if isinstance(v, torch.Tensor))


def _check_manifest(
    directory: Path, served: ServedModel, required: bool, expected_digest: str | None, version: int | None
) -> AdapterManifest | None:
    if not (directory / MANIFEST_NAME).is_file():
        if required:
            raise AdapterRefusal("adapter_checksum_mismatch", f"{directory / MANIFEST_NAME} is missing")
        return None
    try:
        size = (directory / MANIFEST_NAME).lstat().st_size
    except OSError as exc:
        raise AdapterRefusal("adapter_checksum_mismatch", f"{directory / MANIFEST_NAME} cannot be read") from exc
    if size > MAX_JSON_BYTES:  # read_manifest reads it whole
        raise AdapterRefusal(
            "adapter_checksum_mismatch", f"{directory / MANIFEST_NAME} is {size} bytes; at most {MAX_JSON_BYTES}"
        )
    try:
        manifest = read_manifest(directory)
    except ManifestPathError as exc:
        raise AdapterRefusal("adapter_outside_root", str(exc)) from exc
    except ManifestError as exc:
        raise AdapterRefusal("adapter_checksum_mismatch", str(exc)) from exc
    digest = manifest.digest()
    if required and expected_digest is None:
        raise AdapterRefusal("adapter_checksum_mismatch", "sha256: the request must carry the manifest digest")
    if expected_digest is not None and expected_digest != digest:
        raise AdapterRefusal(
            "adapter_checksum_mismatch",
            f"sha256 {expected_digest} does not match the digest {digest} of {directory / MANIFEST_NAME}",
        )
    if manifest.base_model_fingerprint != served.fingerprint:
        raise AdapterRefusal(
            "adapter_base_model_mismatch",
            f"{directory / MANIFEST_NAME}: trained on base model {manifest.base_model_fingerprint}, "
            f"this server serves {served.name} ({served.fingerprint})",
        )
    if version is not None and manifest.version != version:
        raise AdapterRefusal(
            "adapter_config_invalid",
            f"version {version} was requested but {directory / MANIFEST_NAME} holds version {manifest.version}",
        )
    return manifest


def _read_small(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused above `limit` without reading more (the file may grow meanwhile)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterRefusal("adapter_config_invalid", f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise AdapterRefusal("adapter_config_invalid", f"{path} is larger than {limit} bytes")
    return data


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterRefusal("adapter_config_invalid", f"{path} is missing")
    try:
        config = json.loads(_read_small(path, MAX_JSON_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefusal("adapter_config_invalid", f"{path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise AdapterRefusal("adapter_config_invalid", f"{path} is not valid JSON: nested too deeply") from exc
    if not isinstance(config, dict):
        raise AdapterRefusal("adapter_config_invalid", f"{path} must hold a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterRefusal("adapter_unsupported", f"{path}: peft_type is {peft_type!r}; only LORA is served")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterRefusal("adapter_config_invalid", f"{path}: r must be a positive integer, got {r!r}")
    if not config.get("target_modules") and not config.get("target_parameters"):
        raise AdapterRefusal("adapter_config_invalid", f"{path}: target_modules is missing")
    _check_values(config, path)
    _check_patterns(config, path)
    return config


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_values(config: dict[str, Any], path: Path) -> None:
    """Types and values the checks below and the engine rely on: a 422 naming the field, never a 500."""
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise AdapterRefusal("adapter_config_invalid", f"{path}: target_modules must be a list of module names")
    for entry in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(entry) or {}, dict):
            raise AdapterRefusal("adapter_config_invalid", f"{path}: {entry} must be an object")
    for module, rank in (config.get("rank_pattern") or {}).items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterRefusal(
                "adapter_config_invalid", f"{path}: rank_pattern[{module!r}] must be a positive integer, got {rank!r}"
            )
    # lora_alpha / r scales every LoRA output: NaN or Inf would make every generation on the adapter fail,
    # as NaN weights would (1e400 reads as Inf)
    alphas = {"lora_alpha": config.get("lora_alpha", 8)}
    alphas.update({f"alpha_pattern[{k!r}]": v for k, v in (config.get("alpha_pattern") or {}).items()})
    for entry, alpha in alphas.items():
        if not _is_number(alpha) or not math.isfinite(alpha):
            raise AdapterRefusal("adapter_config_invalid", f"{path}: {entry} must be a finite number, got {alpha!r}")


def _check_patterns(config: dict[str, Any], path: Path) -> None:
    """No regular expression of the adapter's runs in the server (ours or PEFT's module matching).

    A pattern such as `(.|.|.)*X` backtracks for hours on a module name, holding the interpreter. PEFT
    matches a string target_modules or exclude_modules as a regular expression, and embeds rank_pattern
    and alpha_pattern keys and layers_pattern in one: only names without regex syntax are accepted.
    """
    problems = []
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        problems.append(f"target_modules {targets[:100]!r} is a regular expression (list the module names)")
    if isinstance(config.get("exclude_modules"), str):
        problems.append("exclude_modules is a regular expression (list the module names)")
    names: list[tuple[str, Any]] = [
        (f"{entry} key", key) for entry in ("rank_pattern", "alpha_pattern") for key in config.get(entry) or {}
    ]
    layers_pattern = config.get("layers_pattern")
    if layers_pattern is not None:
        patterns = layers_pattern if isinstance(layers_pattern, list) else [layers_pattern]
        names += [("layers_pattern", p) for p in patterns]
    problems += [
        f"{entry} {name if not isinstance(name, str) else name[:100]!r} is not a plain module name"
        for entry, name in names
        if not isinstance(name, str) or not PLAIN_PATTERN.match(name)
    ]
    if problems:
        raise AdapterRefusal(
            "adapter_unsupported", f"{path}: the server runs no regular expression of an adapter: {'; '.join(problems)}"
        )


def _check_rank(config: dict[str, Any], directory: Path, max_rank: int) -> int:
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]  # positive integers (_check_values)
    rank = max(ranks)
    if rank > max_rank:
        raise AdapterRefusal(
            "adapter_rank_too_large",
            f"{directory / ADAPTER_CONFIG}: rank {rank} exceeds the server's maxLoraRank {max_rank}",
        )
    return int(rank)


def _targets_embedding(target_modules: Any) -> list[str]:
    if isinstance(target_modules, str):  # "all-linear" (_check_patterns refused any other string): no output layer
        return []
    return [m for m in target_modules if isinstance(m, str) and m.split(".")[-1] in EMBEDDING_MODULES]


def _check_supported(config: dict[str, Any], directory: Path) -> None:
    path = directory / ADAPTER_CONFIG
    problems = []
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append(f"bias {config.get('bias')!r}" if config.get("bias", "none") != "none" else "lora_bias")
    if config.get("trainable_token_indices"):
        problems.append("trainable_token_indices")
    embedding = _targets_embedding(config.get("target_modules") or [])
    if embedding:
        problems.append(f"embedding or lm_head targets {embedding}")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, bool) and not (isinstance(init, str) and init in PLAIN_INITS):
        shown = init[:100] if isinstance(init, str) else init
        problems.append(f"init_lora_weights {shown!r} (PEFT's init of it rewrites the base model's weights)")
    problems += [f"{entry} ({what})" for entry, what in NOT_PLAIN_LORA.items() if config.get(entry) is not None]
    if problems:
        raise AdapterRefusal(
            "adapter_unsupported", f"{path}: not servable as plain LoRA: {'; '.join(problems)}"
        )


def _weight_file(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise AdapterRefusal("adapter_missing", f"{directory} has no {' or '.join(WEIGHT_FILES)}")


#: A LoRA tensor as PEFT saves it: `base_model.model.<module>.lora_<A|B>.weight`.
#: No segment after lora_A/lora_B: the transformers engine loads none of `<module>.lora_A.<name>.weight` (not
#: even with the version's own name) and would serve lora_B's zero init, the base model, under the adapter's name.
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


def _check_weights(weights: Path, served: ServedModel, max_rank: int) -> None:
    """Tensors plain LoRA can serve, shaped for the served model's layers, of a rank the server holds.

    vLLM copies LoRA tensors into slots sized for the base layer and maxLoraRank when a request
    first uses the adapter, inside an engine step: a tensor that does not fit there would fail
    that step, so shapes are checked here, before the engine sees the file.
    """
    if weights.suffix != ".safetensors":
        return
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise AdapterRefusal("adapter_config_invalid", f"{weights} is not a readable safetensors file: {exc}") from exc
    bad = [
        k
        for k in shapes
        if any(part in k for part in UNSUPPORTED_KEY_PARTS)
        or any(seg in EMBEDDING_MODULES for seg in k.split("."))
        or (".lora_" not in k and k.endswith(".bias"))
    ]
    if bad:
        raise AdapterRefusal("adapter_unsupported", f"{weights}: tensors plain LoRA cannot serve: {bad[:3]}")
    _check_pairs(weights, shapes)
    wrong_model, too_large = _shape_problems(shapes, served.linear_shapes, max_rank)
    if too_large:
        raise AdapterRefusal(
            "adapter_rank_too_large", f"{weights}: rank above the server's maxLoraRank {max_rank}: {too_large[:3]}"
        )
    if wrong_model:
        raise AdapterRefusal(
            "adapter_base_model_mismatch",
            f"{weights}: tensors that do not fit {served.name}'s layers: {'; '.join(wrong_model[:3])}",
        )


def _check_pairs(weights: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Only LoRA weights, at least one module's, each module with both halves of one rank.

    An engine skips tensors it has no use for: an adapter with none it can use (an empty file, a
    lora_A without its lora_B, names of no LoRA weight) would be served as the base model under the
    adapter's name, and a trainer would learn from generations that never saw its policy."""
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    foreign = []
    for key, shape in shapes.items():
        match = LORA_KEY.match(key)
        if match is None:
            foreign.append(key)
        else:
            halves.setdefault(match["module"], {})[match["half"]] = shape
    if foreign:
        raise AdapterRefusal(
            "adapter_unsupported", f"{weights}: tensors that are not LoRA weights (<module>.lora_A.weight, "
            f"<module>.lora_B.weight): {sorted(foreign)[:3]}"
        )
    if not halves:
        raise AdapterRefusal("adapter_weights_invalid", f"{weights} holds no LoRA tensors")
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise AdapterRefusal("adapter_weights_invalid", f"{weights}: {module} has no lora_{missing} tensor")
        a, b = pair["A"], pair["B"]
        if len(a) == 2 and len(b) == 2 and a[0] != b[1]:
            raise AdapterRefusal(
                "adapter_weights_invalid",
                f"{weights}: {module}'s lora_A is {list(a)} and lora_B {list(b)}: their ranks differ",
            )


def _shape_problems(
    shapes: Mapping[str, tuple[int, ...]], layers: Mapping[str, tuple[int, int]], max_rank: int
) -> tuple[list[str], list[str]]:
    """(shape mismatches with the served model's layers, tensors whose rank exceeds max_rank)."""
    wrong_model: list[str] = []
    too_large: list[str] = []
    for key, shape in sorted(shapes.items()):
        match = LORA_KEY.match(key)
        if match is None:
            continue
        if len(shape) != 2:
            wrong_model.append(f"{key} has shape {list(shape)}, not 2-D")
            continue
        half, module = match["half"], match["module"]
        rank = shape[0] if half == "A" else shape[1]
        if rank > max_rank:
            too_large.append(f"{key} has rank {rank}")
        if not layers:
            continue
        layer = layers.get(module)
        if layer is None:
            wrong_model.append(f"{module} is not a linear layer of the served model")
            continue
        out_features, in_features = layer
        if half == "A" and shape[1] != in_features:
            wrong_model.append(f"{key} is {list(shape)}; {module} takes {in_features} inputs")
        if half == "B" and shape[0] != out_features:
            wrong_model.append(f"{key} is {list(shape)}; {module} has {out_features} outputs")
    return wrong_model, too_large


def _check_base_model_name(config: dict[str, Any], directory: Path, served: ServedModel) -> None:
    """Without a manifest, adapter_config's base_model_name_or_path is the only evidence of the base.

    It is compared as a name (or the served model's own path): nothing at that path is read, so an
    adapter cannot make the server read, hash or report on a directory outside the adapter root.
    """
    base = config.get("base_model_name_or_path")
    if not base or base == served.name:
        return
    if not isinstance(base, str):
        raise AdapterRefusal(
            "adapter_config_invalid", f"{directory / ADAPTER_CONFIG}: base_model_name_or_path must be a string"
        )
    if os.path.normpath(base) in (os.path.normpath(served.model_dir), str(served.model_dir.resolve())):
        return
    base_path = Path(base)
    if base_path.name in (served.name, served.name.split("/")[-1], served.model_dir.name):
        return
    raise AdapterRefusal(
        "adapter_base_model_mismatch",
        f"{directory / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not the served model {served.name!r}",
    )
