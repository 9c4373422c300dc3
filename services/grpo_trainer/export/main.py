"""`grpo export`: build the artifact, upload it to spec.output's destination, report where it went.

Its last words are the result line (`grpo_api.export_protocol.ExportResult`) when it succeeded, the reason
when it failed, in its termination log (the executors read them) and on stdout/stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import assert_never

from grpo_api.exit_codes import (
    EXIT_FAILED,
    EXIT_INVALID_SPEC,
    EXIT_SUCCEEDED,
    clip_final_message,
    write_termination_message,
)
from grpo_api.export_protocol import ENV_EXPORT_CLAIM_ROOT, ExportResult
from grpo_api.models import Destination, OutputSpec
from grpo_api.runconfig import RunConfig, RunConfigError, load_run_config
from grpo_trainer.export.artifact import Artifact, ExportError, build_artifact
from grpo_trainer.export.destinations import to_bucket, to_claim, to_hub, to_registry


def export(cfg: RunConfig) -> ExportResult:
    output = cfg.spec.output
    if output is None:
        raise ExportError("the run has no spec.output", permanent=True)
    dest = output.parsed
    run_name = cfg.run.name
    staging = Path(cfg.paths.volume_root) / "export" / run_name
    try:
        model_dir = cfg.model_dir() if output.form == "merged" else None
    except RunConfigError as exc:
        raise ExportError(str(exc), permanent=True) from exc
    artifact = build_artifact(output.form, Path(cfg.paths.adapter_root), staging, model_dir)
    result = upload(artifact, dest, output, run_name)
    # The merged copy is the size of the model: once it is where it goes, the run's volume need not keep it.
    shutil.rmtree(staging / "merged", ignore_errors=True)
    return result


def upload(artifact: Artifact, dest: Destination, output: OutputSpec, run_name: str) -> ExportResult:
    match dest.scheme:
        case "pvc":
            root = os.environ.get(ENV_EXPORT_CLAIM_ROOT)
            if not root or not Path(root).is_dir():
                raise ExportError(f"the claim of {dest.uri} is not mounted (${ENV_EXPORT_CLAIM_ROOT})", permanent=True)
            return to_claim(artifact, dest, Path(root), run_name)
        case "oci":
            return to_registry(artifact, dest, plain_http=bool(output.plain_http))
        case "s3":
            return to_bucket(artifact, dest, endpoint=output.endpoint, region=output.region, default_folder=run_name)
        case "hf":
            return to_hub(artifact, dest, endpoint=output.endpoint,
                          message=f"GRPORun {run_name}: {output.form} of {artifact.source.name}")
        case _:
            assert_never(dest.scheme)


def run_export(config_path: Path | None) -> int:
    try:
        cfg = load_run_config(config_path)
        result = export(cfg)
    except (ExportError, RunConfigError, ImportError) as exc:
        # An image without the destination's client (boto3, oras) is fixed by another image, not a retry.
        permanent = not isinstance(exc, ExportError) or exc.permanent
        message = clip_final_message(f"export failed: {exc}")
        print(f"grpo export: {message}", file=sys.stderr, flush=True)
        write_termination_message(message)
        return EXIT_INVALID_SPEC if permanent else EXIT_FAILED
    line = result.line()
    print(line, flush=True)
    write_termination_message(line)
    return EXIT_SUCCEEDED
