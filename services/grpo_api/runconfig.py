"""The run-config: what the server and trainer read to know their run.

The operator renders it from a `GRPORun` into a ConfigMap (mounted as a file,
path in `$GRPO_RUN_CONFIG`); the local runner writes the same file into the
run directory. Server and trainer also accept a plain `GRPORun` file, for
which paths default to a directory beside the file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_api.models import GRPORun, GRPORunSpec
from grpo_api.protocol import ENV_RUN_CONFIG, ENV_SERVER_URL, ENV_TOKEN, ENV_TOKEN_FILE
from grpo_api.sources import ResolvedSources, SourceError, local_sources

RUN_CONFIG_KIND = "GRPORunConfig"
RUN_CONFIG_FILE = "run-config.yaml"


class RunRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="GRPORun name.")
    namespace: str = Field(default="default", description="Namespace (local for `grpo run`).")
    uid: str = Field(default="", description="GRPORun UID.")


def history_file_for(progress_file: Path) -> Path:
    """Where the trainer appends each step's progress, beside the progress file."""
    return progress_file.with_suffix(".history.jsonl")


class RunPaths(BaseModel):
    """Where things live on the shared volume (or the local run directory)."""

    model_config = ConfigDict(extra="forbid")

    volume_root: str = Field(description="Mount point of the shared volume.")
    adapter_root: str = Field(description="Published adapters: <adapterRoot>/v<N>.")
    checkpoint_dir: str = Field(description="Resumable checkpoints.")
    progress_file: str = Field(description="The trainer's progress JSON.")

    @property
    def history_file(self) -> str:
        """Every step's progress record, one JSON line each (the local runner's reward curve)."""
        return str(history_file_for(Path(self.progress_file)))

    @property
    def fetched_commits_file(self) -> str:
        """The commit of each hf:// source the run's initializer fetched (FetchedCommits), beside the progress file."""
        return str(Path(self.progress_file).with_suffix(".sources.json"))

    @classmethod
    def under(cls, volume_root: str | Path, run_name: str) -> RunPaths:
        root = Path(volume_root)
        return cls(
            volume_root=str(root),
            adapter_root=str(root / "adapters" / run_name),
            checkpoint_dir=str(root / "checkpoints" / run_name),
            progress_file=str(root / "progress" / f"{run_name}.json"),
        )


class ServerEndpoints(BaseModel):
    """How the trainer finds the server's replicas: the A records of a headless Service (on a cluster,
    looked up again whenever a replica is lost), or fixed addresses (`grpo run`'s local processes)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=1, ge=1, description="Replicas the trainer waits for before it starts.")
    dns_name: str | None = Field(
        default=None, description="Headless Service whose A records are the ready replicas (cluster)."
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Port of the replicas (with dnsName).")
    urls: list[str] = Field(default_factory=list, description="Base URLs of the replicas (local processes).")


class FetchedCommits(BaseModel):
    """What the initializer fetched for one run: hf:// source folder -> commit (s3:// and https:// source folder ->
    object version). The server and trainer read the
    files of these commits (`ResolvedSources.at_commits`), so another run's fetch of a moved branch, which lands in
    a folder of its own, changes nothing they read; the run names whose record it is (a run re-created under the
    same name writes its own before its server starts)."""

    model_config = ConfigDict(extra="forbid")

    run: RunRef
    commits: dict[str, str]


class RunConfig(BaseModel):
    """Everything a server or trainer process needs to know about its run."""

    model_config = ConfigDict(extra="forbid")

    api_version: str = Field(default="grpo.dev/v1alpha1", alias="apiVersion")
    kind: Literal["GRPORunConfig"] = Field(default="GRPORunConfig")
    run: RunRef
    spec: GRPORunSpec
    paths: RunPaths
    server_url: str = Field(description="Base URL of the generation server, as the trainer reaches it.")
    server_endpoints: ServerEndpoints | None = Field(
        default=None, description="Where the server's replicas are; None: server_url is the only one."
    )
    token_file: str | None = Field(default=None, description="File holding the run's bearer token.")
    base_dir: str = Field(
        default="/", description="Directory that relative model and dataset paths are resolved against."
    )
    sources: ResolvedSources = Field(
        default_factory=ResolvedSources,
        description="Where the sources landed (model directory, dataset, reward module directories).",
    )

    def resolve(self, path: str) -> Path:
        """A spec path made absolute against base_dir."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (Path(self.base_dir) / p)

    def record_fetched_commits(self, commits: dict[str, str]) -> None:
        """The initializer's record of the commits it fetched for this run, replaced atomically."""
        path = Path(self.paths.fetched_commits_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(FetchedCommits(run=self.run, commits=commits).model_dump_json())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def fetched_commits(self) -> dict[str, str]:
        """The commits this run's initializer fetched; empty when it has not (or the record is another run's)."""
        try:
            record = FetchedCommits.model_validate_json(Path(self.paths.fetched_commits_file).read_bytes())
        except (OSError, ValidationError):
            return {}
        return record.commits if record.run == self.run else {}

    def _fetched(self, path: str | None) -> Path | None:
        """A source path; one inside an hf://, s3:// or https:// source's folder is taken in the folder of the commit
        (or object version) fetched for this run, so another run's fetch of a moved branch or a changed object
        changes nothing this run reads."""
        if path is None or not (self.sources.fetches or self.sources.object_fetches):
            return None if path is None else Path(path)
        try:
            return Path(self.sources.at_commits(path, self.fetched_commits()))
        except SourceError as exc:
            raise RunConfigError(f"{exc}: {self.paths.fetched_commits_file} has no record for this run") from exc

    def model_dir(self) -> Path:
        """The base model's directory: spec.model.path, else spec.model.name as a directory or a cached hub id.

        Raises RunConfigError naming the field when neither resolves (no hub is contacted).
        """
        model = self.spec.model
        path = self._fetched(self.sources.model_dir)
        if path is not None:
            if not (path / "config.json").is_file():
                raise RunConfigError(
                    f"spec.model.source {model.source}: {path} is not a Hugging Face model directory "
                    "(no config.json); check spec.model.path inside the source"
                )
            return path
        if model.path:
            path = self.resolve(model.path)
            if not (path / "config.json").is_file():
                raise RunConfigError(
                    f"spec.model.path: {path} is not a Hugging Face model directory (no config.json)"
                )
            return path
        direct = Path(model.name).expanduser()
        if (direct / "config.json").is_file():
            return direct
        try:
            # Only server and trainer images resolve hub names; they ship huggingface_hub.
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model.name, revision=model.revision, local_files_only=True))
        except Exception as exc:  # huggingface_hub raises several error types for "not cached"
            raise RunConfigError(
                f"spec.model.name: {model.name!r} is neither a model directory nor in the local model cache "
                f"(HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}); set spec.model.path "
                f"or pre-fill the cache: {exc}"
            ) from exc

    def adapter_dir(self) -> Path | None:
        """The warm-start adapter's directory (spec.model.adapter): inside its source, else its path; None without
        one. Whether it holds an adapter of this model is the initializer's and the trainer's to check."""
        adapter = self.spec.model.adapter
        if adapter is None:
            return None
        path = self._fetched(self.sources.adapter_dir)
        if path is not None:
            return path
        if adapter.path is None:  # a source the run-config was not resolved for
            raise RunConfigError(f"spec.model.adapter.source {adapter.source}: not resolved in this run-config")
        return self.resolve(adapter.path)

    def dataset_path(self) -> Path:
        """The dataset file or directory: inside its source, else spec.dataset.path."""
        dataset_path = self._fetched(self.sources.dataset_path)
        if dataset_path is not None:
            return dataset_path
        if self.spec.dataset.path is None:  # a source the run-config was not resolved for
            raise RunConfigError(f"spec.dataset.source {self.spec.dataset.source}: not resolved in this run-config")
        return self.resolve(self.spec.dataset.path)

    def reward_search_paths(self) -> list[Path]:
        """Where `module:function` rewards are imported from, first match wins: the reward code's
        directories, the dataset's directory, the volume."""
        dataset = self.dataset_path()
        return [
            *(Path(p) for p in map(self._fetched, self.sources.reward_paths) if p is not None),
            dataset.parent if not dataset.is_dir() else dataset,
            Path(self.paths.volume_root),
        ]

    def read_token(self) -> str | None:
        """The run's bearer token: $GRPO_TOKEN, else the token file."""
        if token := os.environ.get(ENV_TOKEN):
            return token.strip()
        path = os.environ.get(ENV_TOKEN_FILE) or self.token_file
        if path and Path(path).is_file():
            return Path(path).read_text().strip()
        return None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


class RunConfigError(ValueError):
    """A run-config or GRPORun file that cannot be used; the message names the file and field."""


def format_validation_error(source: str, exc: ValidationError) -> str:
    """One line per problem, each naming the field by its camelCase path."""
    lines = [f"{source} is invalid:"]
    for err in exc.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in err["loc"]).replace(".[", "[")
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def parse_grporun(data: Any, source: str) -> GRPORun:
    """Validate a GRPORun document; RunConfigError names the file and every bad field."""
    if not isinstance(data, dict):
        raise RunConfigError(f"{source}: expected a mapping (a GRPORun object), got {type(data).__name__}")
    try:
        return GRPORun.model_validate(data)
    except ValidationError as exc:
        raise RunConfigError(format_validation_error(source, exc)) from exc


def load_grporun(path: Path) -> GRPORun:
    """Read and validate a GRPORun YAML file."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise RunConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        raise RunConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_grporun(data, str(path))


def run_config_for(
    run: GRPORun,
    *,
    volume_root: str | Path,
    server_url: str,
    token_file: str | None,
    base_dir: str | Path = "/",
    sources: ResolvedSources | None = None,
    server_endpoints: ServerEndpoints | None = None,
) -> RunConfig:
    """The run-config for a run whose shared volume is mounted at volume_root.

    Without `sources` (grpo run), hf:// sources land in the volume and cluster-only sources are
    refused with the field named (RunConfigError)."""
    meta = run.metadata
    if sources is None:
        try:
            sources = local_sources(run.spec, Path(volume_root))
        except SourceError as exc:
            raise RunConfigError(str(exc)) from exc
    return RunConfig(
        sources=sources,
        run=RunRef(name=meta.name, namespace=meta.namespace or "default", uid=meta.uid or ""),
        spec=run.spec,
        paths=RunPaths.under(volume_root, meta.name),
        server_url=server_url,
        server_endpoints=server_endpoints,
        token_file=token_file,
        base_dir=str(base_dir),
    )


def load_run_config(path: str | Path | None = None) -> RunConfig:
    """Load a run-config (or a GRPORun file) from path, else from $GRPO_RUN_CONFIG.

    A GRPORun file gets local defaults: the volume is `<file dir>/.grpo/<run>`,
    relative paths resolve against the file's directory, the server URL comes
    from $GRPO_SERVER_URL (default http://127.0.0.1:<server port>).
    """
    source = path or os.environ.get(ENV_RUN_CONFIG)
    if not source:
        raise RunConfigError(f"no run-config: pass --config FILE or set ${ENV_RUN_CONFIG}")
    file = Path(source)
    try:
        data = yaml.safe_load(file.read_text())
    except FileNotFoundError as exc:
        raise RunConfigError(f"{file}: file not found") from exc
    except yaml.YAMLError as exc:
        raise RunConfigError(f"{file}: not valid YAML: {exc}") from exc
    if isinstance(data, dict) and data.get("kind") == RUN_CONFIG_KIND:
        try:
            return RunConfig.model_validate(data)
        except ValidationError as exc:
            raise RunConfigError(format_validation_error(str(file), exc)) from exc
    run = parse_grporun(data, str(file))
    base = file.resolve().parent
    port = run.spec.effective_server.port
    return run_config_for(
        run,
        volume_root=base / ".grpo" / run.metadata.name,
        server_url=os.environ.get(ENV_SERVER_URL, f"http://127.0.0.1:{port}"),
        token_file=os.environ.get(ENV_TOKEN_FILE),
        base_dir=base,
    )
