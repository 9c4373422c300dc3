"""The cluster commands: thin click wrappers over `client`, `render`, `outcome`, `logs` and `pull`.

Each takes -n/--namespace, --context and --kubeconfig as kubectl does; the namespace defaults to the
kubeconfig context's. Expected failures (no credentials, a run not found, forbidden) are one line
naming the run and namespace, never a traceback.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from grpo_api.models import DEFAULT_TRAINER_IMAGE, TERMINAL_PHASES, Phase
from grpo_cli.cluster import logs as pod_logs
from grpo_cli.cluster import outcome, pull, render
from grpo_cli.cluster.client import ClusterApi, ClusterError
from grpo_operator.builders import INITIALIZER, SERVER, TRAINER
from grpo_stage import kube as stage_kube
from grpo_stage.errors import StageError

F = TypeVar("F", bound=Callable[..., Any])
#: How long `grpo logs -f` waits between looks at a pod that has not started.
START_POLL_SECONDS = 2.0


def cluster_options(command: F) -> F:
    """-n/--namespace, --context and --kubeconfig, as kubectl and grpo stage take them."""
    command = click.option("--context", metavar="NAME", help="Kubeconfig context [default: the current one].")(command)
    command = click.option(
        "--kubeconfig", type=click.Path(dir_okay=False), metavar="PATH",
        help="Kubeconfig file [default: $KUBECONFIG, ~/.kube/config, else in-cluster credentials].",
    )(command)
    command = click.option(
        "-n", "--namespace", metavar="NS", help="Namespace of the run [default: the kubeconfig context's]."
    )(command)
    return command


def reporting(command: F) -> F:
    """ClusterError (and the stage helpers' StageError) as one line, exit code 1."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (ClusterError, StageError, pull.PullError, render.StatusUnreadable) as exc:
            raise click.ClickException(str(exc)) from exc

    return run  # type: ignore[return-value]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# ------------------------------------------------------------------------------------ get, status


@click.command("get")
@click.argument("runs", metavar="[RUN]...", nargs=-1)
@click.option("-A", "--all-namespaces", is_flag=True, help="Runs of every namespace.")
@cluster_options
@reporting
def get(runs: tuple[str, ...], all_namespaces: bool, namespace: str | None, kubeconfig: str | None,
        context: str | None) -> None:
    """List GRPORuns: phase, step, reward, adapter version, attempt, age.

    \b
    Examples:
      grpo get -n team-a
      grpo get tiny-cpu -n team-a
      grpo get -A
    """
    api = ClusterApi.connect(kubeconfig, context, namespace)
    if runs and all_namespaces:
        raise click.UsageError("give RUN names or -A, not both")
    found = [api.get_run(name) for name in runs] if runs else api.list_runs(all_namespaces)
    if not found:
        where = "any namespace" if all_namespaces else f"namespace {api.namespace}"
        click.echo(f"No GRPORuns in {where}.", err=True)
        return
    click.echo(render.runs_table(found, _now(), all_namespaces))


@click.command("status")
@click.argument("run")
@click.option("--events", "events_shown", type=click.IntRange(0, 1000), default=render.EVENTS_SHOWN,
              show_default=True, metavar="N", help="How many of the run's latest Events to show.")
@cluster_options
@reporting
def status(run: str, events_shown: int, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
    """Show one GRPORun: phase and reason, attempt, step, reward, adapter version and when it was loaded,
    staleness (server replicas behind the trainer's current policy version), server, sources, conditions
    and the latest Events.

    \b
    Example:
      grpo status tiny-cpu -n team-a
    """
    api = ClusterApi.connect(kubeconfig, context, namespace)
    obj = api.get_run(run)
    events = api.run_events(run) if events_shown else []
    click.echo(render.status_text(obj, events, _now(), events_shown))


# --------------------------------------------------------------------------------------------- wait


def _target(ctx: click.Context, param: click.Parameter, value: str) -> outcome.Target:
    try:
        return outcome.parse_target(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return outcome.parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


@click.command("wait")
@click.argument("run")
@click.option("--for", "target", default="Succeeded", show_default=True, callback=_target,
              metavar="PHASE|condition=TYPE",
              help="A phase (Succeeded, Failed, Training, Suspended, ...) or condition=TYPE[=True|False] "
              "(SourcesReady, ServerReady, TrainerRunning, Succeeded, Failed, Suspended, Reconciled).")
@click.option("--timeout", callback=_duration, metavar="DURATION",
              help="Give up after this long (90s, 30m, 1h30m; 0: look once) [default: no limit].")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing; the exit code says it.")
@cluster_options
@reporting
def wait(run: str, target: outcome.Target, timeout: float | None, quiet: bool, namespace: str | None,
         kubeconfig: str | None, context: str | None) -> None:
    """Wait until a GRPORun reaches a phase or condition; the exit code says how it ended.

    \b
    Exit codes:
      0  the run reached it
      1  an error: the run is not found, was deleted while waiting, no credentials, forbidden
      2  a usage error (a bad --for or --timeout)
      3  the run Failed (and Failed was not asked for)
      4  --timeout ran out
      5  the run Succeeded without reaching it (e.g. --for Suspended)

    It watches the run (no polling) and reads it again whenever the watch ends.

    \b
    Examples:
      grpo wait tiny-cpu -n team-a --timeout 30m
      grpo wait tiny-cpu --for condition=ServerReady --timeout 10m
    """
    api = ClusterApi.connect(kubeconfig, context, namespace)
    deadline = None if timeout is None else time.monotonic() + timeout
    result, said = _wait(api, run, target, deadline)
    where = api.where(run)
    if result is None:
        if not quiet:
            click.echo(f"timed out after {timeout:g}s waiting for {where} to reach {target}; it is {said}", err=True)
        sys.exit(outcome.EXIT_TIMEOUT)
    if not quiet:
        lines = {
            outcome.Outcome.MET: f"{where} reached {target}: {said}",
            outcome.Outcome.FAILED: f"{where} failed: {said}",
            outcome.Outcome.ENDED: f"{where} ended without reaching {target}: {said}",
        }
        click.echo(lines[result], err=result is not outcome.Outcome.MET)
    sys.exit(outcome.EXIT_CODES[result])


def _wait(api: ClusterApi, run: str, target: outcome.Target,
          deadline: float | None) -> tuple[outcome.Outcome | None, str]:
    """(outcome, why) once decided, (None, the run's state) when the deadline passes."""
    while True:
        looked = time.monotonic()
        obj = api.get_run(run)
        result, said = outcome.decide(target, obj)
        if result is not outcome.Outcome.WAITING:
            return result, said
        remaining = math.inf if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            return None, said
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        for kind, changed in api.watch_run(run, version, max(1, min(300, math.ceil(remaining)))):
            if kind == "DELETED":
                raise ClusterError(f"{api.where(run)} was deleted while waiting for {target}")
            result, said = outcome.decide(target, changed)
            if result is not outcome.Outcome.WAITING:
                return result, said
            if deadline is not None and time.monotonic() >= deadline:
                return None, said
        if deadline is not None and time.monotonic() >= deadline:
            return None, said
        time.sleep(max(0.0, 1.0 - (time.monotonic() - looked)))  # a watch that ends at once: at most 1/s


# --------------------------------------------------------------------------------------------- logs


@click.command("logs")
@click.argument("run")
@click.option("--trainer", "component", flag_value=TRAINER, default=True,
              help="The trainer's log (default): the latest attempt's pod; of several nodes, node 0.")
@click.option("--server", "component", flag_value=SERVER, help="The server's log: the latest attempt's pod.")
@click.option("--initializer", "component", flag_value=INITIALIZER, help="The initializer's log.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the pod logs (waits for it to start).")
@click.option("--tail", type=click.IntRange(0), metavar="N", help="Only the last N lines [default: all].")
@cluster_options
@reporting
def logs(run: str, component: str, follow: bool, tail: int | None, namespace: str | None, kubeconfig: str | None,
         context: str | None) -> None:
    """Print the log of a GRPORun's trainer, server or initializer pod.

    The pod is found by the labels the operator puts on the run's children (grpo.dev/run,
    grpo.dev/component); a run whose pod has not started yet is said so (exit code 1), or, with -f,
    waited for.

    \b
    Examples:
      grpo logs tiny-cpu -n team-a -f
      grpo logs tiny-cpu --server --tail 100
    """
    api = ClusterApi.connect(kubeconfig, context, namespace)
    api.get_run(run)  # a run that does not exist is named as such
    told = False
    while True:
        choice = pod_logs.choose(api.run_pods(run, component), run, api.namespace, component)
        if choice.waiting is None:
            break
        if not follow:
            raise ClusterError(choice.waiting)
        if not told:
            click.echo(f"grpo logs: {choice.waiting}; waiting for it", err=True)
            told = True
        time.sleep(START_POLL_SECONDS)
    pod = choice.pod
    assert pod is not None
    out = sys.stdout.buffer
    try:
        for chunk in api.pod_log(pod, pod_logs.CONTAINERS[component], follow, tail):
            out.write(chunk)
            out.flush()
    except KeyboardInterrupt:
        sys.exit(130)


# ---------------------------------------------------------------------------- suspend, resume, cancel


@click.command("suspend")
@click.argument("run")
@cluster_options
@reporting
def suspend(run: str, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
    """Suspend a GRPORun: sets spec.runPolicy.suspend. The operator stops the trainer and scales the
    server to 0; `grpo resume` continues from the last checkpoint. A suspended attempt does not count
    against backoffLimit."""
    _set_suspend(run, True, namespace, kubeconfig, context)


@click.command("resume")
@click.argument("run")
@cluster_options
@reporting
def resume(run: str, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
    """Resume a suspended GRPORun: clears spec.runPolicy.suspend. The next attempt gets a fresh server
    and resumes from the last checkpoint."""
    _set_suspend(run, False, namespace, kubeconfig, context)


def _set_suspend(run: str, value: bool, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
    api = ClusterApi.connect(kubeconfig, context, namespace)
    obj = api.get_run(run)
    phase = (obj.get("status") or {}).get("phase") or Phase.PENDING.value
    where, verb = api.where(run), "suspend" if value else "resume"
    if phase in TERMINAL_PHASES:
        raise ClusterError(f"{where} has ended ({phase}): there is nothing to {verb}")
    current = bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend", False))
    if current == value:
        click.echo(f"{where} is already {'suspended' if value else 'not suspended'} "
                   f"(spec.runPolicy.suspend: {str(value).lower()}; phase {phase})")
        return
    api.patch_run_policy(run, {"suspend": value})
    click.echo(f"{where}: spec.runPolicy.suspend set to {str(value).lower()} (phase {phase}); "
               f"`grpo wait {run} --for {'Suspended' if value else 'Training'}` waits for the operator")


@click.command("cancel")
@click.argument("run")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@cluster_options
@reporting
def cancel(run: str, yes: bool, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
    """Cancel a GRPORun by deleting it: a GRPORun has no stop field (to pause it, `grpo suspend`).

    Its server, trainer and other children are garbage-collected with it, and so is its own claim
    (spec.storage.size) with the adapters and checkpoints on it: `grpo pull` the adapter first. A claim
    named by spec.storage.existingClaim is kept. Asks for confirmation unless --yes.
    """
    api = ClusterApi.connect(kubeconfig, context, namespace)
    obj = api.get_run(run)
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    phase = (obj.get("status") or {}).get("phase") or Phase.PENDING.value
    claim = (spec.get("storage") or {}).get("existingClaim")
    kept = (f"claim {claim} (spec.storage.existingClaim) is kept" if claim
            else f"its claim {run}-data with the adapters and checkpoints is deleted too")
    if not yes:
        click.confirm(f"Delete {api.where(run)} (phase {phase})? Its children go, and {kept}", abort=True)
    api.delete_run(run, str(meta.get("uid") or ""))
    click.echo(f"deleted {api.where(run)} (it was {phase}); {kept}")


# --------------------------------------------------------------------------------------------- pull


@click.command("pull")
@click.argument("run")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--version", "version", type=click.IntRange(1), metavar="N",
              help="This adapter version instead of the newest published (the final one of a finished run).")
@click.option("--force", is_flag=True, help="Replace what DEST holds (without it DEST must be absent or empty).")
@click.option("--image", metavar="IMAGE",
              help="Image of the pull pod; it needs python3 (3.8+) [default: the run's spec.trainer.image, else "
              f"{DEFAULT_TRAINER_IMAGE}].")
@click.option("--image-pull-policy", type=click.Choice(["Always", "IfNotPresent", "Never"]), default="IfNotPresent",
              show_default=True, help="Pull policy of the pull pod's image.")
@click.option("--timeout", type=click.IntRange(10, 7 * 24 * 3600), default=3600, show_default=True,
              metavar="SECONDS", help="Limit of the whole pull; the pod also ends by itself after it.")
@click.option("--start-timeout", type=click.IntRange(1, 7 * 24 * 3600), default=300, show_default=True,
              metavar="SECONDS", help="How long to wait for the pull pod to run (image pull, scheduling).")
@click.option("-q", "--quiet", is_flag=True, help="Only the summary and errors.")
@cluster_options
@reporting
def pull_command(run: str, dest: Path, version: int | None, force: bool, image: str | None, image_pull_policy: str,
                 timeout: int, start_timeout: int, quiet: bool, namespace: str | None, kubeconfig: str | None,
                 context: str | None) -> None:
    """Copy a GRPORun's final adapter from its claim into the local directory DEST, checked against its manifest.

    As `grpo stage`, the other way: a short-lived non-root pod mounts the run's claim read-only and
    streams the newest published version (adapters/RUN/v<N>, with its grpo-manifest.json) through the
    API (pods/exec); every file must match the digest its manifest gives before DEST is replaced. The pod is
    deleted whatever happens. DEST then holds adapter_config.json, adapter_model.safetensors and
    grpo-manifest.json: PEFT and vLLM load it as a LoRA adapter.

    \b
    Example:
      grpo pull tiny-cpu ./tiny-cpu-adapter -n team-a
    """
    started = time.monotonic()
    pull.check_dest(dest, force)
    api = ClusterApi.connect(kubeconfig, context, namespace)
    obj = api.get_run(run)
    source = pull.source_of(obj)
    spec_image = ((obj.get("spec") or {}).get("trainer") or {}).get("image")
    settings = pull.PodSettings(
        image=image or spec_image or DEFAULT_TRAINER_IMAGE, image_pull_policy=image_pull_policy,
        start_timeout=start_timeout, lifetime_seconds=timeout,
    )

    def say(line: str) -> None:
        if not quiet:
            click.echo(f"grpo pull: {line}", err=True)

    pulled = pull.pull(stage_kube.StageApi(api.api_client), source, dest, version, settings,
                       started + timeout, say)
    manifest = pulled.manifest
    click.echo(
        f"grpo pull: adapter v{manifest.version} (step {manifest.step}) of {api.where(run)} to {dest}: "
        f"{pulled.files} files, {pulled.size} bytes, each verified against its grpo-manifest.json "
        f"in {time.monotonic() - started:.1f} s"
    )
