"""The four destinations of spec.output, each through its own kept client: a folder on a claim (plain file
copies), an OCI registry (oras-py), an S3 bucket (boto3) and a Hugging Face repository (huggingface_hub).

Each returns where the artifact went; each failure is an ExportError that says whether a retry may help
(the network, a 5xx) or not (credentials refused, a destination holding something else).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from grpo_api.export_protocol import ENV_EXPORT_PASSWORD, ENV_EXPORT_TOKEN, ENV_EXPORT_USERNAME, ExportResult
from grpo_api.models import Destination
from grpo_trainer.export.artifact import Artifact, ExportError
from grpo_trainer.objectstore import classify_s3_error, s3_client

#: HTTP statuses no retry fixes: credentials refused, no such repository or bucket, a request refused.
PERMANENT_STATUSES = frozenset({400, 401, 403, 404, 405, 409, 422})


def _result(artifact: Artifact, uri: str, digest: str | None = None) -> ExportResult:
    return ExportResult(uri=uri, form=artifact.form, digest=digest or artifact.digest, size=artifact.size,
                        files=len(artifact.all_files), source=str(artifact.source))


# ------------------------------------------------------------------------------------------------ pvc://


def to_claim(artifact: Artifact, dest: Destination, claim_root: Path, default_folder: str) -> ExportResult:
    """Copy the files into PATH on the claim (the run's name when PATH is empty), all or nothing: into a
    temporary folder beside it, then renamed. No symbolic link on the way is followed, so the copy stays
    inside the claim; a folder that is already there is never overwritten (the same export again succeeds)."""
    root = claim_root.resolve(strict=True)
    parts = dest.path.split("/") if dest.path else [default_folder]
    where = root
    for part in parts[:-1]:
        where = where / part
        if where.is_symlink():
            raise ExportError(f"{dest.uri}: {part!r} on the claim is a symbolic link; nothing was written",
                              permanent=True)
        where.mkdir(exist_ok=True)
    target = where / parts[-1]
    if target.is_symlink():
        raise ExportError(f"{dest.uri} is a symbolic link on the claim; nothing was written", permanent=True)
    uri = dest.uri if dest.path else f"{dest.uri}/{default_folder}"
    if target.exists():
        existing = target / artifact.manifest.name
        same = existing.is_file() and not existing.is_symlink()
        if same and existing.read_bytes() == artifact.manifest.path.read_bytes():
            return _result(artifact, uri)  # an earlier try of this export got there
        raise ExportError(f"{uri} already exists and holds something else; nothing was overwritten", permanent=True)
    temporary = where / f".{parts[-1]}.export-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    for file in artifact.all_files:
        path = temporary / file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file.path, path)
        with path.open("rb") as f:
            os.fsync(f.fileno())
    os.rename(temporary, target)
    return _result(artifact, uri)


# ------------------------------------------------------------------------------------------------ oci://


def to_registry(artifact: Artifact, dest: Destination, *, plain_http: bool) -> ExportResult:
    """Push the files as one OCI artifact (a layer each, titled with its name); the manifest's digest,
    as the registry answered it, pins the result."""
    import requests
    from oras.provider import Registry

    registry = Registry(hostname=dest.target, insecure=plain_http)
    username, password = os.environ.get(ENV_EXPORT_USERNAME), os.environ.get(ENV_EXPORT_PASSWORD)
    if username and password:
        registry.auth.set_basic_auth(username, password)
    reference = f"{dest.target}/{dest.path}:{dest.tag}"
    names = {f.path.name for f in artifact.all_files}
    if len(names) != len(artifact.all_files) or any(f.name != f.path.name for f in artifact.all_files):
        raise ExportError("an OCI artifact holds flat files: the export has nested ones", permanent=True)
    try:
        response = registry.push(
            target=reference,
            files=[str(f.path) for f in artifact.all_files],
            disable_path_validation=True,
            manifest_annotations={"dev.grpo.form": artifact.form, "dev.grpo.export-digest": artifact.digest,
                                  "dev.grpo.source": artifact.source.name},
            quiet=True,
        )
    except requests.ConnectionError as exc:
        raise ExportError(f"{dest.uri}: the registry cannot be reached: {exc}", permanent=False) from exc
    except ValueError as exc:  # oras-py's refused request: "Issue with URL: Reason"
        text = str(exc)
        refused = any(word in text for word in ("Unauthorized", "Forbidden", "Not Found", "Bad Request"))
        raise ExportError(f"{dest.uri}: the registry refused the push: {text}", permanent=refused) from exc
    digest = response.headers.get("Docker-Content-Digest", "")
    if not digest.startswith("sha256:"):
        raise ExportError(f"{dest.uri}: the registry answered no manifest digest", permanent=False)
    return _result(artifact, f"oci://{dest.target}/{dest.path}@{digest}", digest)


# ------------------------------------------------------------------------------------------------- s3://


def to_bucket(artifact: Artifact, dest: Destination, *, endpoint: str | None, region: str | None,
              default_folder: str) -> ExportResult:
    """Upload every file under PREFIX (the run's name when empty), the export manifest last, so a reader
    that finds grpo-export.json finds every file it names. Credentials are boto3's own (AWS_* variables
    from the Secret, or the pod's role)."""
    prefix = dest.path or default_folder
    client = s3_client(endpoint=endpoint, region=region)
    try:
        for file in artifact.all_files:
            client.upload_file(str(file.path), dest.target, f"{prefix}/{file.name}")
    except Exception as exc:  # botocore's errors, or boto3's S3UploadFailedError around one
        info = classify_s3_error(exc)
        raise ExportError(f"{dest.uri}: the upload failed: {info}", permanent=info.permanent) from exc
    return _result(artifact, f"s3://{dest.target}/{prefix}")


# ------------------------------------------------------------------------------------------------- hf://


def to_hub(artifact: Artifact, dest: Destination, *, endpoint: str | None, message: str) -> ExportResult:
    """One commit of every file to the model repository (created private if missing); the commit pins it."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    token = os.environ.get(ENV_EXPORT_TOKEN)
    if not token:
        raise ExportError(f"{dest.uri}: no token (key 'token' of spec.output.credentialsSecret)", permanent=True)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(dest.target, repo_type="model", private=True, exist_ok=True)
        commit = api.create_commit(
            dest.target,
            operations=[CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f.path))
                        for f in artifact.all_files],
            commit_message=message,
            repo_type="model",
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        raise ExportError(f"{dest.uri}: the Hub refused the upload ({status}): {exc}",
                          permanent=status in PERMANENT_STATUSES) from exc
    except OSError as exc:  # the network
        raise ExportError(f"{dest.uri}: {exc}", permanent=False) from exc
    return _result(artifact, f"hf://{dest.target}@{commit.oid}")
