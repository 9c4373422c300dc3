"""Where a run's inputs come from: the base model, the prompt dataset, reward functions and their code.

Sources are URIs (pvc://, hf://, oci://, configmap://, s3://, https://; grpo_api.sources resolves them to paths),
for the model, a warm-start adapter (model.adapter), the dataset and reward code; a path inside a source is
relative and holds no `..`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.env import SecretKeySelector
from grpo_api.spec.names import DNS_SUBDOMAIN, KEY_PATTERN, NO_DOTDOT_CEL, has_dotdot
from grpo_api.spec.objectstore import DOUBLE_MESSAGE, HTTPS_URI, S3_URI, S3Access, https_file_name, parse_s3


class ModelDType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


#: Where a model, a dataset or reward code comes from (services/grpo_api/sources.py reads them):
#: pvc://CLAIM[/PATH] an existing claim in the run's namespace, hf://[ORG/]NAME[@REVISION] a Hugging
#: Face repository fetched once per run, oci://REFERENCE an OCI image mounted read-only (image volume),
#: configmap://NAME a ConfigMap in the run's namespace (datasets and reward code only), s3://BUCKET[/PREFIX] the
#: objects under a prefix fetched once per run, https://HOST/PATH one file fetched once per run (datasets and reward
#: code only: a model is many files).
PVC_URI = rf"pvc://{DNS_SUBDOMAIN}(/[-A-Za-z0-9_.@+=,/]*)?"
#: A hub revision: a branch, a tag (refs/pr/1, refs/convert/parquet) or a commit. Relative, of elements that
#: do not start with '.', no '//' nor a trailing '/' (as git ref names): it is a directory on the volume.
_REVISION_PART = r"[-A-Za-z0-9_][-A-Za-z0-9_.]{0,127}"
REVISION = rf"{_REVISION_PART}(/{_REVISION_PART}){{0,7}}"
REVISION_PATTERN = rf"^{REVISION}$"
HF_URI = rf"hf://([A-Za-z0-9][-A-Za-z0-9_.]{{0,95}}/)?[A-Za-z0-9][-A-Za-z0-9_.]{{0,95}}(@{REVISION})?"
OCI_URI = r"oci://[a-z0-9][-a-z0-9.]*(:[0-9]+)?(/[-a-z0-9_.]+)+(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@sha256:[a-f0-9]{64})?"
CONFIGMAP_URI = rf"configmap://{DNS_SUBDOMAIN}"
MODEL_SOURCE_PATTERN = f"^({PVC_URI}|{HF_URI}|{OCI_URI}|{S3_URI})$"
DATASET_SOURCE_PATTERN = f"^({PVC_URI}|{HF_URI}|{OCI_URI}|{CONFIGMAP_URI}|{S3_URI}|{HTTPS_URI})$"
CODE_SOURCE_PATTERN = f"^({PVC_URI}|{OCI_URI}|{CONFIGMAP_URI}|{S3_URI}|{HTTPS_URI})$"
#: A path inside a source: relative, no `..` segment (checked again by CEL and the validators).
RELATIVE_PATH_PATTERN = r"^[-A-Za-z0-9_.@+=,/ ]*$"


#: A file pattern of an hf:// source (fnmatch, as huggingface_hub's snapshot_download takes them; `*` spans '/'):
#: relative to the repository's root.
FILE_PATTERN = r"^[^/\s][^\n]*$"
FilePattern = Annotated[str, Field(min_length=1, max_length=256, pattern=FILE_PATTERN)]
MAX_FILE_PATTERNS = 64


class HubAccess(ApiModel):
    """How an hf:// source is fetched: the token, the endpoint (a mirror, a proxy) and which files."""

    token_secret_ref: SecretKeySelector | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token (HF_TOKEN); only the initializer reads it.",
    )
    endpoint: str | None = Field(
        default=None,
        description="Hub endpoint (HF_ENDPOINT), e.g. an internal mirror; default https://huggingface.co.",
        max_length=1024,
        pattern=r"^https?://[^\s]+$",
    )
    allow_patterns: list[FilePattern] | None = Field(
        default=None,
        description="Fetch only the repository's files that match one of these (fnmatch, as snapshot_download's "
        "allow_patterns: *.safetensors, data/train-*). Default for spec.model: the weights, config and tokenizer "
        "(*.safetensors, *.json, *.model, *.tiktoken, *.txt, *.jinja; *.bin only when the repository has no "
        "*.safetensors); for a dataset or an adapter: every file.",
        min_length=1,
        max_length=MAX_FILE_PATTERNS,
    )
    ignore_patterns: list[FilePattern] | None = Field(
        default=None,
        description="Skip the repository's files that match one of these (fnmatch, as snapshot_download's "
        "ignore_patterns), after allowPatterns or the default.",
        min_length=1,
        max_length=MAX_FILE_PATTERNS,
    )


S3_ONLY = "applies only to an s3:// source"
HTTPS_NO_PATH = "an https:// source is one file (the URL names it): path does not apply"


def _check_source_path(section: str, source: str | None, path: str | None, s3: S3Access | None = None) -> None:
    if source is not None and ".." in re.split(r"[/@]", source):
        raise ValueError(f"{section}.source may not hold a '..' segment")
    if source is not None and source.startswith("s3://") and parse_s3(source) is None:
        raise ValueError(f"{section}.source {source!r} {DOUBLE_MESSAGE}")
    if s3 is not None and not (source or "").startswith("s3://"):
        raise ValueError(f"{section}.s3 {S3_ONLY}")
    if source is not None and source.startswith("https://") and path is not None:
        raise ValueError(f"{section}.path: {HTTPS_NO_PATH}")
    if source is None or path is None:
        return
    if path.startswith("/") or has_dotdot(path) or not re.fullmatch(RELATIVE_PATH_PATTERN, path):
        raise ValueError(
            f"{section}.path must be a relative path inside {section}.source (no leading '/', no '..'), "
            f"got {path!r}"
        )


def _source_rules(section: str, *, https: bool = False) -> list[cel.Rule]:
    """CEL of _check_source_path and of the hub's check, for the section's source, path and hub."""
    return [
        cel.rule(
            "!has(self.source) || !has(self.path) || (!self.path.startsWith('/') && "
            f"self.path.matches('{RELATIVE_PATH_PATTERN}') && "
            f"{NO_DOTDOT_CEL.replace('self', 'self.path')})",
            f"{section}.path must be a relative path inside {section}.source (no leading '/', no '..')",
            fieldPath=".path",
        ),
        cel.rule(
            "!has(self.source) || !self.source.matches('(^|/)[.][.](/|@|$)')",
            f"{section}.source may not hold a '..' segment",
            fieldPath=".source",
        ),
        cel.rule(
            "!has(self.hub) || (has(self.source) && self.source.startsWith('hf://'))",
            f"{section}.hub applies only to an hf:// {section}.source",
            fieldPath=".hub",
        ),
        *_object_rules(section, https=https),
    ]


def _object_rules(section: str, *, https: bool) -> list[cel.Rule]:
    """CEL of _check_source_path's object-storage checks: an s3:// URI without '--' or '..', s3 only beside an
    s3:// source, and where the section takes https://, no path beside it."""
    rules = [
        cel.rule(
            "!has(self.source) || !self.source.startsWith('s3://') || "
            "(!self.source.contains('--') && !self.source.contains('..'))",
            f"{section}.source {DOUBLE_MESSAGE}",
            fieldPath=".source",
        ),
        cel.rule(
            "!has(self.s3) || (has(self.source) && self.source.startsWith('s3://'))",
            f"{section}.s3 {S3_ONLY}",
            fieldPath=".s3",
        ),
    ]
    if https:
        rules.append(cel.rule(
            "!has(self.path) || !has(self.source) || !self.source.startsWith('https://')",
            f"{section}.path: {HTTPS_NO_PATH}",
            fieldPath=".path",
        ))
    return rules


MODEL_RULES: list[cel.Rule] = [
    *_source_rules("model"),
    cel.rule(
        "!has(self.source) || !has(self.revision)",
        "model.revision applies to a model resolved by name; with a source, write hf://ORG/NAME@REVISION",
        fieldPath=".revision",
    ),
]


ADAPTER_RULES: list[cel.Rule] = [
    cel.rule("has(self.source) || has(self.path)", "model.adapter needs a source or a path"),
    *_source_rules("model.adapter"),
]


class AdapterSpec(ApiModel):
    """A LoRA adapter trained earlier (by another run, or published on the hub) that training starts from.

    It is loaded as `PeftModel.from_pretrained(model, path, is_trainable=True)` loads it: its own
    adapter_config.json decides the rank, alpha, dropout and target modules (spec.trainer.lora's r, alpha,
    dropout and targetModules are not used), and the server serves it from step 0.
    """

    source: str | None = Field(
        default=None,
        description="Where the adapter comes from: pvc://CLAIM/PATH (an existing claim in the run's namespace, "
        "e.g. another run's volume: pvc://CLAIM/adapters/RUN/vN), hf://ORG/NAME@REVISION (an adapter repository, "
        "fetched once per run onto the run's volume), oci://REGISTRY/IMAGE:TAG (an image volume), or "
        "s3://BUCKET/PREFIX (the objects under the prefix, fetched once per run). `path` is then the adapter "
        "directory inside the source.",
        max_length=1024,
        pattern=MODEL_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None,
        description="With `source`: the adapter directory inside it (relative). Without: a directory on a "
        "mounted volume (absolute in the cluster; relative to the run file for `grpo run`). It holds "
        "adapter_config.json and adapter_model.safetensors (and grpo-manifest.json when a run published it).",
        max_length=1024,
    )
    hub: HubAccess | None = Field(default=None, description="Token and endpoint for an hf:// source.")
    s3: S3Access | None = Field(
        default=None, description="Credentials Secret, endpoint and region for an s3:// source."
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*ADAPTER_RULES))

    @model_validator(mode="after")
    def _source_path(self) -> AdapterSpec:
        if self.source is None and self.path is None:
            raise ValueError("model.adapter needs a source or a path")
        _check_source_path("model.adapter", self.source, self.path, self.s3)
        if self.hub is not None and not (self.source or "").startswith("hf://"):
            raise ValueError("model.adapter.hub applies only to an hf:// model.adapter.source")
        return self


class ModelSpec(ApiModel):
    """The base model that the server serves and the trainer adapts."""

    name: str = Field(
        description="Model name: the served name; without `source` or `path`, a hub id resolved from the "
        "model cache (e.g. Qwen/Qwen2.5-1.5B-Instruct).",
        min_length=1,
        max_length=253,
    )
    source: str | None = Field(
        default=None,
        description="Where the weights come from: pvc://CLAIM/PATH (an existing claim in the run's "
        "namespace), hf://ORG/NAME@REVISION (fetched once per run onto the run's volume by the "
        "initializer), oci://REGISTRY/IMAGE:TAG (an OCI image mounted read-only; Kubernetes image "
        "volumes), or s3://BUCKET/PREFIX (the objects under the prefix, fetched once per run onto the run's "
        "volume by the initializer). `path` is then a directory inside the source.",
        max_length=1024,
        pattern=MODEL_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None,
        description="With `source`: the model directory inside it (relative). Without: the directory of a "
        "Hugging Face model on a mounted volume (absolute in the cluster; relative to the run file for "
        "`grpo run`).",
        max_length=1024,
    )
    revision: str | None = Field(
        default=None, description="Revision (branch, tag or commit) of a hub model, e.g. main or refs/pr/1.",
        max_length=256, pattern=REVISION_PATTERN,
    )
    hub: HubAccess | None = Field(default=None, description="Token and endpoint for an hf:// source.")
    s3: S3Access | None = Field(
        default=None, description="Credentials Secret, endpoint and region for an s3:// source."
    )
    dtype: ModelDType = Field(default=ModelDType.AUTO, description="Weights dtype for serving and training.")
    adapter: AdapterSpec | None = Field(
        default=None,
        description="Warm start: a LoRA adapter of this base model to train on from (its rank, alpha and "
        "target modules come with it; checked against the model before any server starts; the server serves it "
        "as the first adapter version, at step 0). Not with trainer.tuning full.",
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*MODEL_RULES))

    @model_validator(mode="after")
    def _source_path(self) -> ModelSpec:
        _check_source_path("model", self.source, self.path, self.s3)
        if self.hub is not None and not (self.source or "").startswith("hf://"):
            raise ValueError("model.hub applies only to an hf:// model.source")
        if self.source is not None and self.revision is not None:
            raise ValueError("model.revision applies to a model resolved by name; with a source, write "
                             "hf://ORG/NAME@REVISION")
        return self


class DatasetFormat(StrEnum):
    AUTO = "auto"
    JSONL = "jsonl"
    PARQUET = "parquet"
    ARROW = "arrow"
    REPOSITORY = "repository"


class PromptFormat(StrEnum):
    AUTO = "auto"
    PLAIN = "plain"
    CONVERSATIONAL = "conversational"


#: A dataset config (load_dataset's `name`: main, socratic, 20231101.en).
DATASET_CONFIG_PATTERN = r"^[A-Za-z0-9_][-A-Za-z0-9_.+]{0,127}$"
#: A split name, as datasets allows them (\w+(\.\w+)*).
SPLIT_PATTERN = r"^[A-Za-z0-9_]+([.][A-Za-z0-9_]+)*$"
DATASET_PATH_REQUIRED = ("dataset.path is required unless dataset.source is an hf:// repository (then loaded by "
                         "config and split) or an https:// file")
DATASET_RULES: list[cel.Rule] = [
    *_source_rules("dataset", https=True),
    cel.rule(
        "has(self.path) || (has(self.source) && (self.source.startsWith('hf://') || "
        "self.source.startsWith('https://')))",
        DATASET_PATH_REQUIRED,
        fieldPath=".path",
    ),
    cel.rule(
        "!has(self.path) || !has(self.source) || !self.source.startsWith('configmap://') || "
        f"self.path.matches('{KEY_PATTERN}')",
        "dataset.path must be a key of the ConfigMap in dataset.source",
        fieldPath=".path",
    ),
]


class DatasetSpec(ApiModel):
    """The prompts to train on: a file, a saved Hugging Face dataset, or a dataset repository (by config and split)."""

    source: str | None = Field(
        default=None,
        description="Where the data comes from: pvc://CLAIM/PATH, hf://ORG/NAME@REVISION (a dataset "
        "repository, fetched once per run), oci://REGISTRY/IMAGE:TAG (an image volume), configmap://NAME "
        "(small prompt sets; `path` is then the key), s3://BUCKET/PREFIX (the objects at or under "
        "PREFIX/`path`, fetched once per run) or https://HOST/PATH (one .jsonl or .parquet file, fetched once "
        "per run; no `path`). Without it, `path` is on a mounted volume. An hf:// repository without `path` is "
        "loaded whole, by `config` and `split`, as "
        "load_dataset(\"ORG/NAME\", config, split=split) loads it.",
        max_length=1024,
        pattern=DATASET_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None,
        description="Path of a .jsonl or .parquet file, of a directory written by `save_to_disk`, or of a "
        "directory laid out as a hub dataset repository (data files named by split, configs in README.md; "
        "loaded by `config` and `split`): inside `source` (relative) when it is set, else on a mounted volume "
        "(absolute in the cluster; relative to the run file for `grpo run`). Required unless `source` is hf:// or "
        "https://.",
        min_length=1,
        max_length=1024,
    )
    hub: HubAccess | None = Field(default=None, description="Token and endpoint for an hf:// source.")
    s3: S3Access | None = Field(
        default=None, description="Credentials Secret, endpoint and region for an s3:// source."
    )
    format: DatasetFormat = Field(default=DatasetFormat.AUTO, description="File format; auto by extension, and for a "
                                 "directory: arrow (save_to_disk's) or repository (loaded as load_dataset loads it).")
    prompt_field: str = Field(default="prompt", description="Column that holds the prompt.", max_length=128)
    prompt_format: PromptFormat = Field(
        default=PromptFormat.AUTO,
        description="plain (a string, no chat template) or conversational (a list of messages; the trainer "
        "applies the chat template); auto decides from the data.",
    )
    config: str | None = Field(
        default=None,
        description="Config of a dataset repository (load_dataset's second argument, e.g. main for "
        "openai/gsm8k); required when the repository has several and none is the default.",
        max_length=128,
        pattern=DATASET_CONFIG_PATTERN,
    )
    split: str = Field(
        default="train",
        description="Split to use: of a dataset repository (load_dataset's split), or of a save_to_disk "
        "directory that holds several.",
        max_length=128,
        pattern=SPLIT_PATTERN,
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*DATASET_RULES))

    @model_validator(mode="after")
    def _source_path(self) -> DatasetSpec:
        _check_source_path("dataset", self.source, self.path, self.s3)
        if self.hub is not None and not (self.source or "").startswith("hf://"):
            raise ValueError("dataset.hub applies only to an hf:// dataset.source")
        if self.path is None and not (self.source or "").startswith(("hf://", "https://")):
            raise ValueError(DATASET_PATH_REQUIRED)
        if (self.source or "").startswith("configmap://") and not re.fullmatch(KEY_PATTERN, self.path or ""):
            raise ValueError(f"dataset.path must be a key of the ConfigMap in dataset.source, got {self.path!r}")
        return self


INLINE_MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,100}[.]py$"
#: An https:// reward code source is one module: its URL ends in a module file name.
HTTPS_MODULE = INLINE_MODULE_PATTERN.strip("^$")
HTTPS_MODULE_MESSAGE = "an https:// rewardCode.source is one module: its URL must end in a module file name (NAME.py)"
MAX_INLINE_MODULE_BYTES = 65536
REWARD_CODE_RULES: list[cel.Rule] = [
    cel.rule("has(self.source) != (has(self.inline) && size(self.inline) > 0)",
             "rewardCode needs exactly one of source or inline"),
    cel.rule(
        f"!has(self.inline) || self.inline.all(k, k.matches('{INLINE_MODULE_PATTERN}') && "
        f"size(bytes(self.inline[k])) <= {MAX_INLINE_MODULE_BYTES})",
        f"rewardCode.inline keys must be module file names (NAME.py) and each module at most "
        f"{MAX_INLINE_MODULE_BYTES} bytes",
        fieldPath=".inline",
    ),
    *_source_rules("rewardCode")[:2],
    *_object_rules("rewardCode", https=True),
    cel.rule(
        f"!has(self.source) || !self.source.startsWith('https://') || self.source.matches('/{HTTPS_MODULE}$')",
        HTTPS_MODULE_MESSAGE,
        fieldPath=".source",
    ),
]


class RewardCodeSpec(ApiModel):
    """User reward modules: mounted read-only at /opt/grpo/rewards and importable by the trainer."""

    source: str | None = Field(
        default=None,
        description="configmap://NAME (each key NAME.py is a module), oci://REGISTRY/IMAGE:TAG (an image "
        "volume; `path` the directory of the modules in it), pvc://CLAIM/PATH (a directory on a claim), "
        "s3://BUCKET/PREFIX (the objects at or under PREFIX/`path`, fetched once per run) or "
        "https://HOST/PATH/NAME.py (one module, fetched once per run).",
        max_length=1024,
        pattern=CODE_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None, description="Directory of the modules inside an oci:// or s3:// source (relative).",
        max_length=1024,
    )
    inline: dict[str, str] = Field(
        default_factory=dict,
        description="Modules written in the spec: file name (NAME.py) to source, for a short function. The "
        "operator puts them in a ConfigMap owned by the run.",
        max_length=8,
        json_schema_extra={"maxProperties": 8},
    )
    s3: S3Access | None = Field(
        default=None, description="Credentials Secret, endpoint and region for an s3:// source."
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*REWARD_CODE_RULES))

    @model_validator(mode="after")
    def _one_kind(self) -> RewardCodeSpec:
        if (self.source is None) == (not self.inline):
            raise ValueError("rewardCode needs exactly one of source or inline")
        _check_source_path("rewardCode", self.source, self.path, self.s3)
        if (self.source or "").startswith("https://") and not re.fullmatch(
                INLINE_MODULE_PATTERN, https_file_name(self.source or "") or ""):
            raise ValueError(HTTPS_MODULE_MESSAGE)
        for name, text in self.inline.items():
            if not re.fullmatch(INLINE_MODULE_PATTERN, name):
                raise ValueError(f"rewardCode.inline: {name!r} must be a module file name such as my_rewards.py")
            if len(text.encode()) > MAX_INLINE_MODULE_BYTES:
                raise ValueError(
                    f"rewardCode.inline[{name}] is larger than {MAX_INLINE_MODULE_BYTES} bytes: use "
                    "configmap:// (grpo stage --configmap) or an image"
                )
        return self


#: Reward functions the trainer ships (services/grpo_trainer/rewards.py registers exactly these).
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match", "regex_match", "length_penalty", "token_fraction")
REWARD_RULES: list[cel.Rule] = [
    cel.rule(
        "self.contains(':') || self in [" + ", ".join(f"'{b}'" for b in BUILTIN_REWARDS) + "]",
        "function must be a built-in (" + ", ".join(BUILTIN_REWARDS) + ") or module:function",
    ),
]


class RewardSpec(ApiModel):
    """One reward function: a built-in by name or a user function by import path."""

    function: str = Field(
        description="A built-in (exact_match, regex_match, length_penalty, token_fraction) or "
        "`module:function` of a user function with TRL's reward contract (modules from spec.rewardCode, "
        "or installed in the trainer image).",
        min_length=1,
        max_length=512,
        pattern=r"^([a-z_]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        json_schema_extra=cel.rules(*REWARD_RULES),  # CEL of _known_builtin
    )
    weight: float = Field(default=1.0, description="Weight of this reward in the total.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the function (e.g. {pattern: ...} for regex_match).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> RewardSpec:
        if ":" not in self.function and self.function not in BUILTIN_REWARDS:
            raise ValueError(
                f"function {self.function!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}); "
                "a user function is written module:function"
            )
        return self
