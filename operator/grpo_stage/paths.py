"""SRC:DEST arguments: parsing and validation (pure; nothing here touches the disk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_stage.receiver import STAGING_PREFIX


@dataclass(frozen=True)
class Mapping:
    """One SRC:DEST argument: a local file or directory and its relative path on the claim."""

    source: Path
    dest: str

    def __str__(self) -> str:
        return f"{self.source}:{self.dest}"


def validate_dest(dest: str) -> str:
    """A relative path on the claim, '/'-separated, without a trailing '/'; ValueError if not acceptable."""
    if dest.startswith("/"):
        raise ValueError(f"DEST {dest!r} is absolute: give a path relative to the claim's root")
    if "\x00" in dest:
        raise ValueError(f"DEST {dest!r} contains a NUL character")
    stripped = dest[:-1] if dest.endswith("/") else dest
    if not stripped:
        raise ValueError("DEST is empty: give a path relative to the claim's root")
    parts = stripped.split("/")
    if ".." in parts:
        raise ValueError(f"DEST {dest!r} contains '..'")
    if any(part in ("", ".") for part in parts):
        raise ValueError(f"DEST {dest!r} has an empty or '.' part")
    if parts[0].startswith(STAGING_PREFIX):
        raise ValueError(f"DEST {dest!r} uses the reserved prefix {STAGING_PREFIX!r}")
    return stripped


def parse_mapping(text: str) -> Mapping:
    """`SRC:DEST` (split at the last ':', so SRC may contain colons); ValueError if malformed."""
    source, sep, dest = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not SRC:DEST (e.g. ./my-model:models/my-model)")
    if not source:
        raise ValueError(f"{text!r} has an empty SRC")
    return Mapping(source=Path(source), dest=validate_dest(dest))


def check_overlaps(mappings: list[Mapping]) -> None:
    """Refuse two arguments with the same DEST, or one DEST inside another; ValueError naming both."""
    for i, a in enumerate(mappings):
        for b in mappings[i + 1 :]:
            if a.dest == b.dest:
                raise ValueError(f"{a} and {b} have the same DEST")
            inner, outer = (a, b) if len(a.dest) > len(b.dest) else (b, a)
            if inner.dest.startswith(outer.dest + "/"):
                raise ValueError(f"DEST of {inner} lies inside DEST of {outer}: stage them as one")
