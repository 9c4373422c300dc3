"""What is exported: the newest adapter version on the run's volume, checked against its manifest, as it
is (form adapter) or merged into the base model (form merged), and the export manifest naming every file.

Nothing here deletes or changes an adapter version: a failed export leaves the volume as it found it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from grpo_api.adapters import MANIFEST_NAME, ManifestError, list_versions, sha256_file, verify_manifest, version_dir
from grpo_api.export_protocol import EXPORT_MANIFEST_NAME


class ExportError(Exception):
    """The export cannot succeed; `permanent` when no retry fixes it (exit code 2)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class ExportFile:
    """One file of the artifact: its name in the destination and where it is read from."""

    name: str
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class Artifact:
    form: str
    #: The adapter version directory it came from.
    source: Path
    files: tuple[ExportFile, ...]
    #: The export manifest (grpo-export.json), itself the last file uploaded.
    manifest: ExportFile

    @property
    def digest(self) -> str:
        return f"sha256:{self.manifest.sha256}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files) + self.manifest.size

    @property
    def all_files(self) -> tuple[ExportFile, ...]:
        return (*self.files, self.manifest)


def final_adapter(adapter_root: Path) -> Path:
    """The newest adapter version whose files match its manifest (the trainer publishes at the last step)."""
    versions = list_versions(adapter_root) if adapter_root.is_dir() else []
    if not versions:
        raise ExportError(f"no adapter version under {adapter_root}: the trainer published none", permanent=True)
    newest = version_dir(adapter_root, versions[-1])
    try:
        verify_manifest(newest)
    except ManifestError as exc:
        raise ExportError(f"the final adapter {newest} does not match its manifest: {exc}", permanent=True) from exc
    return newest


def describe(path: Path, name: str) -> ExportFile:
    return ExportFile(name=name, path=path, size=path.stat().st_size, sha256=sha256_file(path))


def adapter_files(version: Path) -> list[ExportFile]:
    """The adapter's files as PEFT reads them (the publication manifest is ours, not PEFT's)."""
    names = sorted(json.loads((version / MANIFEST_NAME).read_text())["files"])
    return [describe(version / name, name) for name in names]


def merge_adapter(model_dir: Path, version: Path, staging: Path) -> list[ExportFile]:
    """The base model with the adapter merged in, saved as safetensors with its config and tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if staging.exists():
        shutil.rmtree(staging)  # an earlier try's partial merge: ours, under the run's export folder
    staging.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    merged = PeftModel.from_pretrained(model, str(version)).merge_and_unload()
    with torch.no_grad():
        merged.save_pretrained(str(staging), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(staging))
    names = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    return [describe(staging / name, name) for name in names if name != EXPORT_MANIFEST_NAME]


def write_export_manifest(files: list[ExportFile], *, form: str, source: Path, staging: Path) -> ExportFile:
    """grpo-export.json: the form, the adapter version and every file's size and sha256; its digest names the
    export (the same bytes give the same digest wherever they went)."""
    staging.mkdir(parents=True, exist_ok=True)
    body = {
        "form": form,
        "source": source.name,
        "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)},
    }
    data = json.dumps(body, sort_keys=True, indent=1).encode()
    path = staging / EXPORT_MANIFEST_NAME
    path.write_bytes(data)
    return ExportFile(EXPORT_MANIFEST_NAME, path, len(data), hashlib.sha256(data).hexdigest())


def build_artifact(form: str, adapter_root: Path, staging: Path, model_dir: Path | None) -> Artifact:
    version = final_adapter(adapter_root)
    if form == "merged":
        assert model_dir is not None
        files = merge_adapter(model_dir, version, staging / "merged")
    else:
        files = adapter_files(version)
    manifest = write_export_manifest(files, form=form, source=version, staging=staging)
    return Artifact(form=form, source=version, files=tuple(files), manifest=manifest)
