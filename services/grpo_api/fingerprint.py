"""Base-model fingerprint: the server reports it, the trainer and adapters must match it.

A hash of the model's config.json and of its weight files' names, sizes and contents
(sha256): a fine-tuned copy of a base has the same shapes and file sizes but another
fingerprint, and copies of one checkpoint share one.

Reading every weight byte costs time, so the per-file digests are cached beside the model
directory (`<dir>.grpo-fingerprint.json` next to it, not inside it, so copies and uploads of
the model carry no cache: size, mtime_ns and sha256 of each file) and a file is read again
only when its size or mtime changed. `grpo prepare` computes it once per run, so the server
and the trainer find it warm. A model on a read-only volume (a read-only claim, an image
volume) is cached under `$XDG_CACHE_HOME/grpo/fingerprints` (default `~/.cache`), keyed by
the directory's absolute path; when nothing can be written the digests are computed every
time. A cache that cannot be read or written never fails the fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: The digest cache beside the model directory: `<parent>/<dir name><CACHE_SUFFIX>`.
CACHE_SUFFIX = ".grpo-fingerprint.json"
#: The fallback cache's folder under $XDG_CACHE_HOME (or ~/.cache).
USER_CACHE_DIR = Path("grpo") / "fingerprints"
CACHE_FORMAT = 1
#: Files hashed at once (hashlib releases the GIL, so threads read and hash in parallel).
HASH_WORKERS = 4


@dataclass(frozen=True)
class FileDigest:
    size: int
    mtime_ns: int
    sha256: str


def model_fingerprint(model_dir: Path) -> str:
    """`sha256:<32 hex>` of config.json and the weight files' relative paths, sizes and sha256."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    config = json.loads(config_path.read_text())
    digests = weight_digests(model_dir)
    weights = sorted((rel, d.size, d.sha256) for rel, d in digests.items())
    payload = json.dumps({"config": config, "weights": weights}, sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(payload).hexdigest()[:32]


def weight_digests(model_dir: Path) -> dict[str, FileDigest]:
    """Digest of every weight file under model_dir (relative posix path -> digest), cached."""
    model_dir = model_dir.resolve()
    stats = {
        p.relative_to(model_dir).as_posix(): p.stat()
        for p in model_dir.rglob("*")
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    }
    beside = beside_cache_path(model_dir)
    user = user_cache_path(model_dir)
    beside_entries = _read_cache(beside, None)
    user_entries = _read_cache(user, model_dir) if user else {}
    cached = {**user_entries, **beside_entries}
    digests: dict[str, FileDigest] = {}
    stale: list[str] = []
    for rel, st in stats.items():
        entry = cached.get(rel)
        if entry is not None and (entry.size, entry.mtime_ns) == (st.st_size, st.st_mtime_ns):
            digests[rel] = entry
        else:
            stale.append(rel)
    if stale:
        # the stat taken before hashing is recorded: a file changed meanwhile gets a new mtime, so it is read again
        with ThreadPoolExecutor(max_workers=min(HASH_WORKERS, len(stale))) as pool:
            hashed = pool.map(lambda rel: _sha256(model_dir / rel), stale)
            for rel, sha in zip(stale, hashed, strict=True):
                digests[rel] = FileDigest(stats[rel].st_size, stats[rel].st_mtime_ns, sha)
    if digests not in (beside_entries, user_entries):
        _write_cache(model_dir, digests, beside, user)
    return digests


def beside_cache_path(model_dir: Path) -> Path:
    """The digest cache next to the model directory (a sibling file, so the directory itself stays as it was)."""
    return model_dir.parent / (model_dir.name + CACHE_SUFFIX)


def user_cache_path(model_dir: Path) -> Path | None:
    """Where a read-only model directory's digests are cached; None when there is no home to cache in."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no home directory for this user
            return None
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:32]
    return Path(base) / USER_CACHE_DIR / f"{key}.json"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_cache(path: Path, model_dir: Path | None) -> dict[str, FileDigest]:
    """The entries of a cache file; empty when it is missing, unreadable, malformed or (model_dir) another's."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT or not isinstance(raw.get("files"), dict):
        return {}
    if model_dir is not None and raw.get("path") != str(model_dir):
        return {}
    entries: dict[str, FileDigest] = {}
    for rel, entry in raw["files"].items():
        if isinstance(entry, dict) and _valid_entry(entry):
            entries[rel] = FileDigest(entry["size"], entry["mtime_ns"], entry["sha256"])
    return entries


def _valid_entry(entry: dict[str, Any]) -> bool:
    size, mtime_ns, sha = entry.get("size"), entry.get("mtime_ns"), entry.get("sha256")
    return (
        isinstance(size, int) and isinstance(mtime_ns, int) and isinstance(sha, str) and len(sha) == 64
        and all(c in "0123456789abcdef" for c in sha)
    )


def _write_cache(model_dir: Path, digests: dict[str, FileDigest], beside: Path, user: Path | None) -> None:
    """Beside the model, else in the user's cache, else nowhere."""
    content = {
        "format": CACHE_FORMAT,
        "path": str(model_dir),
        "files": {
            rel: {"size": d.size, "mtime_ns": d.mtime_ns, "sha256": d.sha256} for rel, d in sorted(digests.items())
        },
    }
    text = json.dumps(content, indent=1)
    if _replace(beside, text):
        return
    if user is not None:
        try:
            user.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return
        _replace(user, text)


def _replace(path: Path, text: str) -> bool:
    """Write path atomically (a temporary file renamed over it); False if that is not possible here."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # the server and the trainer may run as other users than prepare
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True
