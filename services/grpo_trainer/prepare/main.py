"""`grpo prepare`'s entry: load the run-config, prepare, print the final line, the exit code."""

from __future__ import annotations

from pathlib import Path

from grpo_api.prepare_protocol import EXIT_PERMANENT, EXIT_READY, EXIT_TRANSIENT
from grpo_api.runconfig import RunConfig, RunConfigError, load_run_config
from grpo_trainer.prepare.checks import check_image, check_sources, check_warm_adapter, warm_fingerprint
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.hub import fetch_repository
from grpo_trainer.prepare.inline_rewards import write_inline_rewards
from grpo_trainer.prepare.objects import fetch_object_source
from grpo_trainer.prepare.reporting import PrepareResult, Reporter, write_termination_message


def prepare(cfg: RunConfig, reporter: Reporter) -> PrepareResult:
    """Inline rewards, fetches, checks; raises PrepareFailed."""
    check_image(cfg)
    write_inline_rewards(cfg, reporter)
    commits = {fetch.local_dir: fetch_repository(fetch, reporter) for fetch in cfg.sources.fetches}
    commits |= {fetch.local_dir: fetch_object_source(fetch, reporter) for fetch in cfg.sources.object_fetches}
    if commits:
        try:
            cfg.record_fetched_commits(commits)
        except OSError as exc:
            raise PrepareFailed(f"cannot record the fetched commits in {cfg.paths.fetched_commits_file}: {exc}",
                                permanent=True) from exc
    result = check_sources(cfg, reporter)
    warm_fingerprint(result.model_dir, reporter)
    check_warm_adapter(cfg, result.model_dir, reporter)
    return result


def run_prepare(config_path: str | Path | None, reporter: Reporter | None = None) -> int:
    """Load the run-config, prepare, print the final line; the exit code."""
    reporter = reporter or Reporter()
    try:
        cfg = load_run_config(config_path)
        result = prepare(cfg, reporter)
    except RunConfigError as exc:
        failure = PrepareFailed(str(exc), permanent=True)
    except PrepareFailed as exc:
        failure = exc
    except Exception as exc:  # an unforeseen error: let the Job retry (bounded by its backoffLimit)
        failure = PrepareFailed(f"unexpected error: {type(exc).__name__}: {exc}", permanent=False)
    else:
        write_termination_message(reporter.final(result.message, failed=False), reporter)
        return EXIT_READY
    reporter.note(f"{'permanent' if failure.permanent else 'transient'} failure: {failure}")
    line = reporter.final(str(failure), failed=True, permanent=failure.permanent)
    write_termination_message(line, reporter)
    return EXIT_PERMANENT if failure.permanent else EXIT_TRANSIENT
