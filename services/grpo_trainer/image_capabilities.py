"""Whether this image (the trainer's, which the initializer runs in too) can run the spec.

The initializer runs before any server exists, so a run its trainer could not execute fails there, at
once and for good (exit code 2, naming spec.trainer.image), instead of after a GPU server has loaded and
then once per attempt. What the trainer needs is `config.vllm_needed_for`; this module looks for it by
importing it, as the trainer would: an installed but broken vLLM (a missing library, a compiled
extension built for another torch) is as useless as none. The trackers of spec.trainer.reportTo are looked
for as transformers looks for them (their package is installed), and so is the client the export step needs
for spec.output's destination (the export runs in this image after the last step: better to know now), and
the S3 client of s3:// sources.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from grpo_api.models import GRPORunSpec
from grpo_api.weight_transfer import ENV_WEIGHT_TRANSFER, resolve_weight_transfer
from grpo_trainer.config import TRACKER_MODULES, image_lacks_vllm, trackers_missing, vllm_needed_for
from grpo_trainer.errors import UnsupportedSetting

#: The module of vLLM the trainer uses first in either case (it imports vllm itself and its NCCL wrapper).
VLLM_PROBE_MODULE = "vllm.distributed.weight_transfer.nccl_engine"


def vllm_import_error() -> str | None:
    """None when vLLM's trainer-side module imports here, else what went wrong (one line)."""
    try:
        importlib.import_module(VLLM_PROBE_MODULE)
    except Exception as exc:  # any failure to import is the answer, not a crash of the check
        return f"import {VLLM_PROBE_MODULE}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return None


def available_trackers() -> frozenset[str]:
    """The trackers of spec.trainer.reportTo whose package is installed here, found as transformers finds them."""
    return frozenset(
        tracker for tracker, modules in TRACKER_MODULES.items()
        if any(importlib.util.find_spec(module) is not None for module in modules)
    )


#: The package `grpo export` uploads with, by spec.output's destination scheme.
EXPORT_CLIENTS = {"oci": "oras", "s3": "boto3", "hf": "huggingface_hub"}


def export_client_missing(spec: GRPORunSpec) -> UnsupportedSetting | None:
    """The refusal of a spec.output whose destination's client this image lacks; None if it has it (or needs none)."""
    if spec.output is None:
        return None
    scheme = spec.output.parsed.scheme
    module = EXPORT_CLIENTS.get(scheme)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return UnsupportedSetting(
        f"spec.output.destination {scheme}:// needs the {module} package, which this trainer image lacks (the "
        "export step runs in it); use an image that has it"
    )


def source_client_missing(spec: GRPORunSpec) -> UnsupportedSetting | None:
    """The refusal of an s3:// source when this image lacks boto3 (the initializer fetches it in this image)."""
    sections = {"spec.model.source": spec.model, "spec.model.adapter.source": spec.model.adapter,
                "spec.dataset.source": spec.dataset, "spec.rewardCode.source": spec.reward_code}
    for field, section in sections.items():
        source = section.source if section is not None else None
        if source is not None and source.startswith("s3://") and importlib.util.find_spec("boto3") is None:
            return UnsupportedSetting(f"{field} s3:// needs the boto3 package, which this trainer image lacks (the "
                                      "initializer fetches it in this image); use an image that has it")
    return None


def check_trainer_image(spec: GRPORunSpec, weight_transfer_auto: str | None = None) -> None:
    """Raise UnsupportedSetting when the spec needs vLLM in the trainer and this image cannot import it, or
    reports to a tracker whose package it lacks. `weight_transfer_auto` defaults to $GRPO_WEIGHT_TRANSFER, as the
    server resolves it."""
    lacking = (trackers_missing(spec, available_trackers()) or export_client_missing(spec)
               or source_client_missing(spec))
    if lacking is not None:
        raise lacking
    auto = weight_transfer_auto if weight_transfer_auto is not None else os.environ.get(ENV_WEIGHT_TRANSFER)
    need = vllm_needed_for(spec, resolve_weight_transfer(spec, auto))
    if need is None:
        return
    error = vllm_import_error()
    if error is not None:
        raise image_lacks_vllm(need, error)
