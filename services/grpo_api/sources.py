"""Where a run's model, dataset and reward code come from, and where its processes find them.

A source is a URI in the spec (`model.source`, `model.adapter.source`, `dataset.source`, `rewardCode.source`):

- `pvc://CLAIM/PATH`: an existing PersistentVolumeClaim of the run's namespace, mounted read-only;
- `hf://[ORG/]NAME[@REVISION]`: a Hugging Face repository, fetched once per run by the initializer
  onto the run's volume (`hub_dir`: `<volume>/hub/<models|datasets>/<ORG--NAME@REVISION>-<digest>`,
  one folder per distinct source, shared by the runs of a claim, resumable), whose files are kept per
  commit (`hub_snapshot_dir`: `.../snapshots/<commit>`) as huggingface_hub's cache keeps them: a branch
  that moves gets a new folder, and the files another run reads are never changed;
- `oci://REFERENCE`: an OCI image mounted read-only (a Kubernetes image volume);
- `configmap://NAME`: a ConfigMap of the run's namespace (datasets and reward code);
- `s3://BUCKET[/PREFIX]` and `https://HOST/PATH`: objects of an S3 service, or one file of a web server (a dataset
  or a reward module), fetched once per run by the initializer onto the run's volume (`object_dir`:
  `<volume>/objects/<BUCKET--PREFIX>-<digest>`), kept per version as hf:// sources are per commit
  (`.../snapshots/<version>`: for s3:// the digest of the listing, every key with its size and ETag; for https://
  the file's sha256), so an object that changes later gets a new folder and never changes files a run reads.

This module is pure: `cluster_layout` says which volumes the pods need and where the paths land
in them (the operator's builders turn it into pod specs), `local_sources` does the same for
`grpo run`, which has no cluster. Both produce `ResolvedSources`, carried in the run-config, so the
initializer, server and trainer read one answer.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_api.export_protocol import S3_CREDENTIAL_ENV
from grpo_api.models import (
    REVISION_PATTERN,
    AdapterSpec,
    BucketLocation,
    DatasetSpec,
    GRPORunSpec,
    ModelSpec,
    RewardCodeSpec,
    https_file_name,
    parse_s3,
)

#: Where sources are mounted in the pods.
SOURCES_ROOT = "/mnt/grpo"
CLAIMS_ROOT = f"{SOURCES_ROOT}/claims"
REWARDS_DIR = "/opt/grpo/rewards"
#: Env variables that carry the hub tokens into the initializer (never into the server or trainer).
MODEL_TOKEN_ENV = "GRPO_HF_TOKEN_MODEL"
DATASET_TOKEN_ENV = "GRPO_HF_TOKEN_DATASET"
ADAPTER_TOKEN_ENV = "GRPO_HF_TOKEN_ADAPTER"
DEFAULT_REVISION = "main"
#: The variables that carry an s3:// source's credentials into the initializer (never into the server or
#: trainer): GRPO_S3_<ROLE>_ACCESS_KEY_ID, _SECRET_ACCESS_KEY, _SESSION_TOKEN, from the keys of its
#: credentialsSecret (spec.output's keys: accessKeyId, secretAccessKey, sessionToken).
S3_CREDENTIAL_PREFIX = "GRPO_S3_"
#: Hex digits of the sha256 of a hub source's canonical form that end its folder's name (64 bits).
HUB_DIGEST_CHARS = 16
#: The readable part of a hub folder's name is cut to this: a name has at most 255 bytes, a revision
#: alone up to 1031 characters; the digest keeps cut names distinct.
HUB_READABLE_CHARS = 200
#: Inside a hub source's folder: one folder of files per commit (`hub_snapshot_dir`), as in huggingface_hub's
#: cache (snapshots/<commit>), each complete once and never changed after.
HUB_SNAPSHOTS = "snapshots"
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: The files of an hf:// model fetched when spec.model.hub.allowPatterns is not set: what transformers and vLLM load
#: (weights in safetensors and their index, config.json, generation_config.json, the tokenizer: tokenizer.json,
#: tokenizer_config.json, vocab.json, merges.txt, vocab.txt, a sentencepiece *.model, a *.tiktoken vocabulary,
#: chat_template.jinja). Other formats (ONNX, GGUF, Flax, TF, original/*.pth) stay on the hub.
MODEL_DEFAULT_ALLOW_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt",
                                                 "*.jinja")
#: Added to the default when the repository lists no *.safetensors: PyTorch weights (pytorch_model*.bin).
MODEL_FALLBACK_WEIGHT_PATTERNS: tuple[str, ...] = ("*.bin",)
#: The files that are weights in a model repository: patterns that select none of them are refused.
MODEL_WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin")


class SourceError(ValueError):
    """A source that cannot be used here; the message names the field."""


@dataclass(frozen=True)
class ClaimSource:
    claim: str
    path: str  # inside the claim, "" for its root


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    revision: str | None


@dataclass(frozen=True)
class ImageSource:
    reference: str


@dataclass(frozen=True)
class ConfigMapSource:
    name: str


@dataclass(frozen=True)
class BucketSource:
    location: BucketLocation


@dataclass(frozen=True)
class WebFileSource:
    url: str
    name: str  # the URL's last segment: the file's name on the volume


Source = ClaimSource | HubSource | ImageSource | ConfigMapSource | BucketSource | WebFileSource


def parse_source(uri: str, field: str) -> Source:
    """One source URI (already pattern-checked at admission) as a typed value."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not rest:
        raise SourceError(f"{field}: {uri!r} is not SCHEME://... (pvc, hf, oci, configmap, s3 or https)")
    if ".." in rest.replace("@", "/").split("/"):
        raise SourceError(f"{field}: {uri!r} may not hold a '..' segment")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return ClaimSource(claim, path.strip("/"))
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if revision and not re.fullmatch(REVISION_PATTERN, revision):
            # It names a directory on the run's volume: never an absolute path, '.' or '..' element.
            raise SourceError(f"{field}: {uri!r}: the revision must be a branch, tag or commit such as main or "
                              "refs/pr/1 (relative, no element starting with '.', no '//')")
        return HubSource(repo, revision or None)
    if scheme == "oci":
        return ImageSource(rest)
    if scheme == "configmap":
        return ConfigMapSource(rest)
    if scheme == "s3":
        location = parse_s3(uri)
        if location is None:
            raise SourceError(f"{field}: {uri!r} is not s3://BUCKET[/PREFIX] (S3's bucket names; path segments that "
                              "start with a letter, digit or '_'; no '--' or '..')")
        return BucketSource(location)
    if scheme == "https":
        name = https_file_name(uri)
        if name is None:
            raise SourceError(f"{field}: {uri!r} is not https://HOST[:PORT]/PATH (path segments that start with a "
                              "letter, digit or '_'; no query, fragment or user)")
        return WebFileSource(uri, name)
    raise SourceError(f"{field}: unknown scheme {scheme!r} in {uri!r} (pvc, hf, oci, configmap, s3 or https)")


@dataclass(frozen=True)
class HubKey:
    """What makes one hf:// source distinct from another: its folder on a volume is named by it, and the
    fetch record in that folder names it. The endpoint belongs to it (another hub's org/model@main may
    be another repository), and so do the file patterns (a folder holds one selection of the files)."""

    repo_type: Literal["model", "dataset"]
    repo_id: str
    revision: str
    endpoint: str | None  # without a trailing '/'; None: the default hub
    allow_patterns: tuple[str, ...] | None = None  # None: every file
    ignore_patterns: tuple[str, ...] = ()

    def to_json(self) -> dict[str, str | list[str] | None]:
        # patterns only when set: the folders of sources fetched whole keep the names they had before patterns
        record: dict[str, str | list[str] | None] = {
            "repoType": self.repo_type, "repoId": self.repo_id, "revision": self.revision, "endpoint": self.endpoint}
        if self.allow_patterns is not None:
            record["allowPatterns"] = list(self.allow_patterns)
        if self.ignore_patterns:
            record["ignorePatterns"] = list(self.ignore_patterns)
        return record

    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HUB_DIGEST_CHARS]


def hub_key(repo_type: Literal["model", "dataset"], source: HubSource, endpoint: str | None,
            allow_patterns: tuple[str, ...] | None = None, ignore_patterns: tuple[str, ...] = ()) -> HubKey:
    return HubKey(repo_type=repo_type, repo_id=source.repo_id, revision=source.revision or DEFAULT_REVISION,
                  endpoint=endpoint.rstrip("/") if endpoint else None, allow_patterns=allow_patterns,
                  ignore_patterns=ignore_patterns)


def hub_dir(volume_root: str, key: HubKey) -> str:
    """Where an hf:// repository lands on a volume, shared by the runs of the claim: one folder per
    distinct source, directly under hub/<models|datasets>/.

    Repository ids and revisions both may hold '/', so no path built from them alone can tell
    hf://org/model@main from hf://org@model/main (or keep one source's folder out of another's). The
    name is one path element: a readable ORG--NAME@REVISION ('/' as '--'), then the digest of the
    canonical source, which alone makes it distinct."""
    readable = f"{key.repo_id}@{key.revision}".replace("/", "--")[:HUB_READABLE_CHARS]
    return posixpath.join(volume_root, "hub", f"{key.repo_type}s", f"{readable}-{key.digest()}")


def hub_snapshot_dir(source_dir: str, commit: str) -> str:
    """The files of one commit of the source whose folder is source_dir. A run reads the commit its initializer
    fetched (`ResolvedSources.at_commits`), so a branch that moves later gives the next run a folder of its own
    instead of changing files under a run that reads them."""
    if not _COMMIT.fullmatch(commit):
        raise SourceError(f"{commit!r} is not a commit (40 lowercase hex digits)")
    return posixpath.join(source_dir, HUB_SNAPSHOTS, commit)


#: The most bytes an https:// source may have: a dataset file, a reward module.
WEB_FILE_MAX_BYTES: dict[Literal["dataset", "rewards"], int] = {"dataset": 16 << 30, "rewards": 1 << 20}


@dataclass(frozen=True)
class ObjectKey:
    """What makes one s3:// or https:// source distinct from another, as HubKey for hf://: the URI, the endpoint
    it is read at (another S3 service's bucket of that name is another bucket) and, for s3://, the path inside the
    prefix that is fetched (a folder holds one selection of the objects)."""

    uri: str
    endpoint: str | None  # without a trailing '/'; None: AWS (s3://), the URL's host (https://)
    select: str = ""

    def to_json(self) -> dict[str, str | None]:
        return {"uri": self.uri, "endpoint": self.endpoint, "select": self.select}

    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HUB_DIGEST_CHARS]


def object_dir(volume_root: str, key: ObjectKey) -> str:
    """Where an s3:// or https:// source lands on a volume, shared by the runs of the claim: one folder per distinct
    source under objects/, named as hub_dir names a hub source's (the URI without its scheme, '/' as '--', then the
    digest of the canonical source, which alone makes it distinct)."""
    readable = key.uri.partition("://")[2].replace("/", "--")[:HUB_READABLE_CHARS]
    return posixpath.join(volume_root, "objects", f"{readable}-{key.digest()}")


def s3_credential_env(role: str) -> list[tuple[str, str, bool]]:
    """(variable, Secret key, optional) of the credentials of a role's s3:// source in the initializer."""
    return [(f"{S3_CREDENTIAL_PREFIX}{role.upper()}_{aws.removeprefix('AWS_')}", key, key == "sessionToken")
            for aws, key in S3_CREDENTIAL_ENV]


class ObjectFetch(BaseModel):
    """One s3:// prefix or https:// file the initializer fetches."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(description="The spec field that named it, e.g. spec.model.source.")
    uri: str = Field(description="s3://BUCKET[/PREFIX] or https://HOST/PATH, as the spec gives it.")
    select: str = Field(default="", description="s3://: the path inside the prefix whose objects (the one at it, "
                        "or those under it) are fetched; empty: every object under the prefix.")
    local_dir: str = Field(description="Where the files land (on the run's volume).")
    endpoint: str | None = Field(default=None, description="s3://: the S3 service's endpoint URL; None: AWS.")
    region: str | None = Field(default=None, description="s3://: the region requests are signed for.")
    credentials_role: str | None = Field(
        default=None, description="s3://: the role whose variables (s3_credential_env) hold the credentials from "
        "credentialsSecret; None: boto3's own chain (AWS_* variables, a web identity, an instance role), else "
        "unsigned.")
    max_bytes: int | None = Field(default=None, description="https://: the most bytes the file may have.")

    @property
    def key(self) -> ObjectKey:
        return ObjectKey(self.uri, self.endpoint, self.select)

    @property
    def label(self) -> str:
        return f"{self.field} {self.uri}"

    @property
    def credentials_field(self) -> str:
        """The spec field of the credentials Secret, e.g. spec.model.s3.credentialsSecret."""
        return f"{self.field.rsplit('.', 1)[0]}.s3.credentialsSecret"


class HubFetch(BaseModel):
    """One hf:// repository the initializer fetches."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(description="The spec field that named it, e.g. spec.model.source.")
    repo_id: str
    revision: str = DEFAULT_REVISION
    repo_type: Literal["model", "dataset"]
    local_dir: str = Field(description="Where the files land (on the run's volume).")
    token_env: str | None = Field(default=None, description="Env variable holding the token, if any.")
    endpoint: str | None = None
    allow_patterns: list[str] | None = Field(default=None, description="Only the files matching one; None: all.")
    ignore_patterns: list[str] = Field(default_factory=list, description="Files skipped (after allow_patterns).")
    model_weights: bool = Field(
        default=False,
        description="The base model: its patterns must select weights, and the default (allow_patterns None in "
        "the spec) adds *.bin when the repository has no *.safetensors.",
    )
    default_patterns: bool = Field(default=False, description="allow_patterns is the model's default.")

    @property
    def key(self) -> HubKey:
        return hub_key(self.repo_type, HubSource(self.repo_id, self.revision), self.endpoint,
                       None if self.allow_patterns is None else tuple(self.allow_patterns), tuple(self.ignore_patterns))

    @property
    def patterns_field(self) -> str:
        """The spec fields of the patterns, e.g. spec.model.hub.allowPatterns/ignorePatterns."""
        return f"{self.field.rsplit('.', 1)[0]}.hub.allowPatterns/ignorePatterns"


class ResolvedSources(BaseModel):
    """Where the processes of a run find its model, dataset and reward modules."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str | None = Field(default=None, description="The model directory; None: resolve spec.model.")
    adapter_dir: str | None = Field(
        default=None, description="The warm-start adapter (spec.model.adapter.source); None: its path, or none."
    )
    dataset_path: str | None = Field(default=None, description="The dataset; None: spec.dataset.path.")
    reward_paths: list[str] = Field(default_factory=list, description="Directories reward modules import from.")
    fetches: list[HubFetch] = Field(default_factory=list, description="hf:// repositories to fetch first.")
    object_fetches: list[ObjectFetch] = Field(default_factory=list,
                                              description="s3:// prefixes and https:// files to fetch first.")
    inline_rewards_dir: str | None = Field(
        default=None, description="Where the initializer writes spec.rewardCode.inline (grpo run only)."
    )

    def at_commits(self, path: str, commits: dict[str, str]) -> str:
        """`path` (model_dir, adapter_dir, dataset_path or a reward path) inside the folder of the commit (or
        object version) the run's initializer fetched, when it lies in a fetch's source folder (`commits`:
        local_dir -> commit or version); raises SourceError naming the field when that fetch has none yet."""
        folders = [(f.local_dir, f"{f.field} hf://{f.repo_id}@{f.revision}") for f in self.fetches]
        folders += [(f.local_dir, f.label) for f in self.object_fetches]
        for local_dir, label in folders:
            inner = posixpath.relpath(path, local_dir)
            if inner == ".." or inner.startswith("../"):
                continue
            commit = commits.get(local_dir)
            if commit is None:
                raise SourceError(f"{label}: the initializer has not fetched it for this run (no commit on record)")
            return posixpath.normpath(posixpath.join(hub_snapshot_dir(local_dir, commit), inner))
        return path


@dataclass(frozen=True)
class SourceVolume:
    """A volume the pods mount for a source (the builders make the core/v1 Volume of it)."""

    name: str
    mount_path: str
    kind: Literal["claim", "image", "configmap"]
    ref: str  # claim name, image reference or ConfigMap name


@dataclass(frozen=True)
class ClusterLayout:
    volumes: tuple[SourceVolume, ...]
    sources: ResolvedSources

    @property
    def claims(self) -> tuple[str, ...]:
        return tuple(v.ref for v in self.volumes if v.kind == "claim")


def _hub_fetch(
    role: Literal["model", "dataset"], section: ModelSpec | AdapterSpec | DatasetSpec, source: HubSource, field: str,
    volume_root: str, token_env: str,
) -> HubFetch:
    """role: the hub's repository type (an adapter is a model repository)."""
    hub = section.hub
    endpoint = hub.endpoint if hub is not None else None
    base_model = isinstance(section, ModelSpec)
    allow = hub.allow_patterns if hub is not None else None
    default_patterns = base_model and allow is None
    if default_patterns:
        allow = list(MODEL_DEFAULT_ALLOW_PATTERNS)
    ignore = list(hub.ignore_patterns or []) if hub is not None else []
    key = hub_key(role, source, endpoint, None if allow is None else tuple(allow), tuple(ignore))
    return HubFetch(
        field=field,
        repo_id=key.repo_id,
        revision=key.revision,
        repo_type=role,
        local_dir=hub_dir(volume_root, key),
        token_env=token_env if hub is not None and hub.token_secret_ref is not None else None,
        endpoint=endpoint,
        allow_patterns=allow,
        ignore_patterns=ignore,
        model_weights=base_model,
        default_patterns=default_patterns,
    )


def _join(root: str, path: str | None) -> str:
    return posixpath.join(root, path) if path else root


ObjectRole = Literal["model", "adapter", "dataset", "rewards"]


def _object_fetch(
    role: ObjectRole, section: ModelSpec | AdapterSpec | DatasetSpec | RewardCodeSpec,
    source: BucketSource | WebFileSource, field: str, volume_root: str, *, secrets: bool,
) -> tuple[ObjectFetch, str]:
    """The fetch of an s3:// or https:// source, and where the section's path lands (for https://, the file; for
    reward code, the folder its modules import from). `secrets`: the credentials come from the section's
    credentialsSecret (the operator), not from boto3's own chain (`grpo run`)."""
    if isinstance(source, WebFileSource):
        if role not in ("dataset", "rewards"):
            raise SourceError(f"{field}: {source.url!r}: an https:// source is one file, and a {role} is several; "
                              "use s3:// or hf://")
        key = ObjectKey(source.url, None)
        local = object_dir(volume_root, key)
        fetch = ObjectFetch(field=field, uri=source.url, local_dir=local,
                            max_bytes=WEB_FILE_MAX_BYTES["rewards" if role == "rewards" else "dataset"])
        return fetch, local if role == "rewards" else posixpath.join(local, source.name)
    access = section.s3
    endpoint = access.endpoint.rstrip("/") if access is not None and access.endpoint else None
    select = posixpath.normpath(section.path) if section.path else ""
    key = ObjectKey(source.location.uri, endpoint, "" if select == "." else select)
    local = object_dir(volume_root, key)
    fetch = ObjectFetch(
        field=field, uri=key.uri, select=key.select, local_dir=local, endpoint=endpoint,
        region=access.region if access is not None else None,
        credentials_role=role if secrets and access is not None and access.credentials_secret else None,
    )
    return fetch, _join(local, key.select)


class _ClusterBuilder:
    def __init__(self, spec: GRPORunSpec, data_claim: str, inline_configmap: str) -> None:
        self.spec = spec
        self.data_claim = data_claim
        self.data_root = spec.storage.mount_path
        self.inline_configmap = inline_configmap
        self.volumes: list[SourceVolume] = []
        self.fetches: list[HubFetch] = []
        self.object_fetches: list[ObjectFetch] = []

    def fetched(self, role: ObjectRole, section: ModelSpec | AdapterSpec | DatasetSpec | RewardCodeSpec,
                source: BucketSource | WebFileSource, field: str) -> str:
        fetch, path = _object_fetch(role, section, source, field, self.data_root, secrets=True)
        self.object_fetches.append(fetch)
        return path

    def claim_root(self, claim: str) -> str:
        if claim == self.data_claim:
            return self.data_root
        for volume in self.volumes:
            if volume.kind == "claim" and volume.ref == claim:
                return volume.mount_path
        mount = posixpath.join(CLAIMS_ROOT, claim)
        self.volumes.append(SourceVolume(f"src-claim-{len(self.volumes)}", mount, "claim", claim))
        return mount

    def mounted(self, role: str, kind: Literal["image", "configmap"], ref: str, mount: str) -> str:
        self.volumes.append(SourceVolume(f"src-{role}", mount, kind, ref))
        return mount

    def resolve(
        self, role: Literal["model", "adapter", "dataset"], section: ModelSpec | AdapterSpec | DatasetSpec, uri: str,
        path: str | None, field: str, token_env: str,
    ) -> str:
        source = parse_source(uri, field)
        match source:
            case ClaimSource(claim=claim, path=inner):
                return _join(_join(self.claim_root(claim), inner), path)
            case HubSource():
                repo_type: Literal["model", "dataset"] = "dataset" if role == "dataset" else "model"
                fetch = _hub_fetch(repo_type, section, source, field, self.data_root, token_env)
                self.fetches.append(fetch)
                return _join(fetch.local_dir, path)
            case ImageSource(reference=ref):
                return _join(self.mounted(role, "image", ref, posixpath.join(SOURCES_ROOT, role)), path)
            case ConfigMapSource(name=name):
                if role != "dataset":
                    raise SourceError(f"{field}: a {role} cannot come from a ConfigMap")
                return _join(self.mounted(role, "configmap", name, posixpath.join(SOURCES_ROOT, role)), path)
            case BucketSource() | WebFileSource():
                return self.fetched(role, section, source, field)
        raise SourceError(f"{field}: unsupported source {uri!r}")  # pragma: no cover - exhaustive match

    def rewards(self) -> list[str]:
        code = self.spec.reward_code
        if code is None:
            return []
        if code.inline:
            self.volumes.append(SourceVolume("src-rewards", REWARDS_DIR, "configmap", self.inline_configmap))
            return [REWARDS_DIR]
        assert code.source is not None
        source = parse_source(code.source, "spec.rewardCode.source")
        match source:
            case ClaimSource(claim=claim, path=inner):
                return [_join(_join(self.claim_root(claim), inner), code.path)]
            case ImageSource(reference=ref):
                self.volumes.append(SourceVolume("src-rewards", REWARDS_DIR, "image", ref))
                return [_join(REWARDS_DIR, code.path)]
            case ConfigMapSource(name=name):
                self.volumes.append(SourceVolume("src-rewards", REWARDS_DIR, "configmap", name))
                return [REWARDS_DIR]
            case BucketSource() | WebFileSource():
                return [self.fetched("rewards", code, source, "spec.rewardCode.source")]
        raise SourceError(f"spec.rewardCode.source: {code.source!r} cannot hold reward code")


def cluster_layout(spec: GRPORunSpec, *, data_claim: str, inline_rewards_configmap: str) -> ClusterLayout:
    """The source volumes every pod of the run mounts, and where the paths land in them."""
    builder = _ClusterBuilder(spec, data_claim, inline_rewards_configmap)
    model_dir = adapter_dir = dataset_path = None
    model, adapter = spec.model, spec.model.adapter
    if model.source is not None:
        model_dir = builder.resolve("model", model, model.source, model.path, "spec.model.source", MODEL_TOKEN_ENV)
    if adapter is not None and adapter.source is not None:
        adapter_dir = builder.resolve("adapter", adapter, adapter.source, adapter.path, "spec.model.adapter.source",
                                      ADAPTER_TOKEN_ENV)
    if spec.dataset.source is not None:
        dataset_path = builder.resolve(
            "dataset", spec.dataset, spec.dataset.source, spec.dataset.path, "spec.dataset.source", DATASET_TOKEN_ENV
        )
    reward_paths = builder.rewards()
    return ClusterLayout(
        volumes=tuple(builder.volumes),
        sources=ResolvedSources(model_dir=model_dir, adapter_dir=adapter_dir, dataset_path=dataset_path,
                                reward_paths=reward_paths, fetches=builder.fetches,
                                object_fetches=builder.object_fetches),
    )


def local_sources(spec: GRPORunSpec, volume_root: Path) -> ResolvedSources:
    """`grpo run`: hf://, s3:// and https:// fetched into the run directory (s3:// with boto3's own credentials:
    there are no Secrets), inline reward modules written there; the cluster-only kinds (pvc, oci, configmap) are
    refused with the field named."""
    root = str(volume_root)
    fetches: list[HubFetch] = []
    object_fetches: list[ObjectFetch] = []
    resolved: dict[str, str | None] = {"model": None, "model.adapter": None, "dataset": None}
    roles: tuple[tuple[str, Literal["model", "dataset"], ModelSpec | AdapterSpec | DatasetSpec | None, str], ...] = (
        ("model", "model", spec.model, MODEL_TOKEN_ENV),
        ("model.adapter", "model", spec.model.adapter, ADAPTER_TOKEN_ENV),
        ("dataset", "dataset", spec.dataset, DATASET_TOKEN_ENV),
    )
    for role, repo_type, section, token_env in roles:
        if section is None or section.source is None:
            continue
        field = f"spec.{role}.source"
        source = parse_source(section.source, field)
        if isinstance(source, BucketSource | WebFileSource):
            object_role: ObjectRole = "adapter" if role == "model.adapter" else repo_type
            object_fetch, resolved[role] = _object_fetch(object_role, section, source, field, root, secrets=False)
            object_fetches.append(object_fetch)
            continue
        if not isinstance(source, HubSource):
            raise SourceError(
                f"{field}: {section.source!r} names a cluster object; `grpo run` reads local files: set "
                f"spec.{role}.path instead (or use hf://, s3:// or https://)"
            )
        fetch = _hub_fetch(repo_type, section, source, field, root, token_env)
        fetches.append(fetch)
        resolved[role] = _join(fetch.local_dir, section.path)
    reward_paths: list[str] = []
    inline_dir: str | None = None
    code = spec.reward_code
    if code is not None:
        if code.source is not None:
            field = "spec.rewardCode.source"
            code_source = parse_source(code.source, field)
            if not isinstance(code_source, BucketSource | WebFileSource):
                raise SourceError(
                    f"{field}: {code.source!r} names a cluster object; `grpo run` imports reward modules from "
                    "s3:// or https://, the dataset's directory, the run file's directory or rewardCode.inline"
                )
            object_fetch, code_path = _object_fetch("rewards", code, code_source, field, root, secrets=False)
            object_fetches.append(object_fetch)
            reward_paths.append(code_path)
        else:
            inline_dir = posixpath.join(root, "rewards")
            reward_paths.append(inline_dir)
    return ResolvedSources(
        model_dir=resolved["model"],
        adapter_dir=resolved["model.adapter"],
        dataset_path=resolved["dataset"],
        reward_paths=reward_paths,
        fetches=fetches,
        object_fetches=object_fetches,
        inline_rewards_dir=inline_dir,
    )


def s3_credentials(spec: GRPORunSpec) -> list[tuple[str, str, str]]:
    """(env name, Secret name, key) of each s3:// source's credentials the initializer needs (every key optional:
    the initializer names the field when one it needs is missing, instead of its pod never starting)."""
    credentials = []
    sections: tuple[tuple[ModelSpec | AdapterSpec | DatasetSpec | RewardCodeSpec | None, str], ...] = (
        (spec.model, "model"), (spec.model.adapter, "adapter"), (spec.dataset, "dataset"), (spec.reward_code, "rewards")
    )
    for section, role in sections:
        if section is None or not (section.source or "").startswith("s3://"):
            continue
        if section.s3 is not None and section.s3.credentials_secret:
            credentials += [(env, section.s3.credentials_secret, key) for env, key, _ in s3_credential_env(role)]
    return credentials


def hub_tokens(spec: GRPORunSpec) -> list[tuple[str, str, str]]:
    """(env name, Secret name, key) of each hub token the initializer needs."""
    tokens = []
    sections: tuple[tuple[ModelSpec | AdapterSpec | DatasetSpec | None, str], ...] = (
        (spec.model, MODEL_TOKEN_ENV), (spec.model.adapter, ADAPTER_TOKEN_ENV), (spec.dataset, DATASET_TOKEN_ENV)
    )
    for section, env in sections:
        if section is None:
            continue
        if (section.source or "").startswith("hf://") and section.hub is not None and section.hub.token_secret_ref:
            ref = section.hub.token_secret_ref
            tokens.append((env, ref.name, ref.key))
    return tokens
