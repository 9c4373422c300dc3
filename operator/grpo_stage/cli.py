"""`grpo stage`: copy local files onto a PersistentVolumeClaim, or small files into a ConfigMap,
through the Kubernetes API."""

from __future__ import annotations

import contextlib
import re
import secrets
import sys
import time
import typing
from dataclasses import dataclass

import click
from click.core import ParameterSource

from grpo_api.models import DEFAULT_TRAINER_IMAGE, QUANTITY_PATTERN, AccessMode
from grpo_stage import configmap, kube
from grpo_stage.errors import StageError
from grpo_stage.manifests import POD_PREFIX, build_pod, compare_manifest, exec_status, receiver_command
from grpo_stage.paths import Mapping, check_overlaps, parse_mapping
from grpo_stage.progress import Progress, human_bytes
from grpo_stage.sources import Entry, collect
from grpo_stage.tarstream import FileDigest, write_tar

DEFAULT_IMAGE = DEFAULT_TRAINER_IMAGE
#: Parameters that only apply with --claim (refused with --configmap when given on the command line).
CLAIM_ONLY = (
    "create_size",
    "storage_class",
    "access_mode",
    "image",
    "image_pull_policy",
    "start_timeout",
)


def _mappings(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[Mapping]:
    mappings = []
    for value in values:
        try:
            mappings.append(parse_mapping(value))
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    try:
        check_overlaps(mappings)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    return mappings


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (value.startswith("-") or not re.fullmatch(QUANTITY_PATTERN, value)):
        raise click.BadParameter(f"{value!r} is not a storage size such as 10Gi", ctx=ctx, param=param)
    return value


def _configmap_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    try:
        return None if value is None else configmap.validate_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def _configmap_sources(values: tuple[str, ...]) -> list[configmap.Source]:
    try:
        return [configmap.parse_source(value) for value in values]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'SRC[:KEY]...'") from exc


def _param(ctx: click.Context, name: str) -> click.Parameter:
    return next(p for p in ctx.command.params if p.name == name)


def _option(param: click.Parameter) -> str:
    return max(param.opts, key=len)


def _given_claim_options(ctx: click.Context) -> list[str]:
    """The --claim-only options given on the command line (their defaults do not count)."""
    return [
        _option(_param(ctx, name))
        for name in CLAIM_ONLY
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]


def _stderr(quiet: bool) -> typing.TextIO | None:
    return None if quiet else sys.stderr


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        click.echo(f"grpo stage: {line}", err=True)


@click.command("stage")
@click.argument("sources", metavar="SRC:DEST...", nargs=-1, required=True)
@click.option("--claim", metavar="CLAIM", help="The PersistentVolumeClaim to copy onto (this or --configmap).")
@click.option(
    "--configmap",
    "configmap_name",
    metavar="NAME",
    callback=_configmap_name,
    help="The ConfigMap to put small files into instead of a claim (arguments SRC[:KEY]; see above).",
)
@click.option(
    "--force",
    is_flag=True,
    help="With --configmap: replace the ConfigMap even if grpo stage did not make it.",
)
@click.option(
    "-n", "--namespace", metavar="NS", help="Namespace of the claim or ConfigMap [default: the kubeconfig context's]."
)
@click.option(
    "--create",
    "create_size",
    metavar="SIZE",
    callback=_size,
    help="Create the claim with this size (e.g. 10Gi) if it does not exist; an existing one is used as is.",
)
@click.option(
    "--storage-class", metavar="NAME", help="Storage class of a claim made by --create [default: the cluster's]."
)
@click.option(
    "--access-mode",
    type=click.Choice([m for m in typing.get_args(AccessMode) if m != "ReadOnlyMany"]),
    default=None,
    help="Access mode of a claim made by --create [default: ReadWriteOnce].",
)
@click.option(
    "--image",
    default=DEFAULT_IMAGE,
    metavar="IMAGE",
    show_default=True,
    help="Image of the staging pod; it needs python3 (3.8+). Any image the nodes can pull will do.",
)
@click.option(
    "--image-pull-policy",
    type=click.Choice(["Always", "IfNotPresent", "Never"]),
    default="IfNotPresent",
    show_default=True,
    help="Pull policy of the staging pod's image.",
)
@click.option(
    "--timeout",
    type=click.IntRange(10, 7 * 24 * 3600),
    default=3600,
    show_default=True,
    metavar="SECONDS",
    help="Limit of the whole staging; the pod also ends by itself after it.",
)
@click.option(
    "--start-timeout",
    type=click.IntRange(1, 7 * 24 * 3600),
    default=300,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for the staging pod to run (image pull, scheduling).",
)
@click.option(
    "-L",
    "--dereference",
    is_flag=True,
    help="Follow symbolic links (with --claim or --configmap): a SRC that is a link, and links to files inside "
    "a SRC directory, are read as what they point to, wherever that lies (e.g. a Hugging Face cache "
    "snapshot). Without it every link is refused, named. Links to directories inside a SRC directory are "
    "refused even with it.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Kubeconfig file [default: $KUBECONFIG, ~/.kube/config, else in-cluster credentials].",
)
@click.option("--context", metavar="NAME", help="Kubeconfig context [default: the current one].")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines (nor keys); only the summary and errors.")
@click.pass_context
def stage(
    ctx: click.Context,
    sources: tuple[str, ...],
    claim: str | None,
    configmap_name: str | None,
    force: bool,
    namespace: str | None,
    create_size: str | None,
    storage_class: str | None,
    access_mode: str | None,
    image: str,
    image_pull_policy: str,
    timeout: int,
    start_timeout: int,
    dereference: bool,
    kubeconfig: str | None,
    context: str | None,
    quiet: bool,
) -> None:
    """Copy local files and directories onto a PersistentVolumeClaim, atomically and verified; or put
    small files into a ConfigMap.

    Each SRC (a local file or directory, copied recursively) goes to DEST, a path relative to the
    claim's root (a GRPORun mounts it at storage.mountPath, /data by default). A short-lived pod
    mounts the claim and receives a tar stream through the API (pods/exec: no registry, no hub);
    every file's sha256 is checked before a DEST replaces what was there, all at once.

    \b
    Example:
      grpo stage -n team-a --claim grpo-data --create 10Gi \\
        ./my-model:models/my-model ./prompts.jsonl:datasets/prompts.jsonl \\
        ./my_rewards.py:datasets/my_rewards.py

    With --configmap NAME instead of --claim, each argument is SRC[:KEY]: a local file, which becomes
    the key KEY [default: the file's name] of the ConfigMap NAME, or a directory, whose regular files at
    its top level each become a key of their name (not recursive: subdirectories are refused). UTF-8
    text goes to data, other files to binaryData; at most 1,000,000 bytes in all (more: use --claim).
    The ConfigMap is created, or replaced whole (keys not given go); one that grpo stage did not make is
    only replaced with --force. A GRPORun reads it as configmap://NAME.

    \b
    Example:
      grpo stage -n team-a --configmap my-rewards \\
        ./my_rewards.py ./prompts-v2.jsonl:prompts.jsonl

    In both modes only regular files (and, onto a claim, directories) are read: a symbolic link, given
    as SRC or inside a SRC directory, is refused, named with where it points, unless -L is given.
    """
    if (claim is None) == (configmap_name is None):
        raise click.UsageError(
            "give one of --claim CLAIM (files onto a PersistentVolumeClaim) or --configmap NAME "
            "(small files into a ConfigMap)" + (", not both" if claim is not None else "")
        )
    if configmap_name is not None:
        given = _given_claim_options(ctx)
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise click.UsageError(f"{', '.join(given)} only {verb} with --claim, not with --configmap")
        _stage_configmap(
            configmap_name, _configmap_sources(sources), namespace, force, dereference, kubeconfig, context, quiet
        )
        return
    assert claim is not None
    if force:
        raise click.UsageError("--force only applies with --configmap")
    mappings = _mappings(ctx, _param(ctx, "sources"), sources)
    if create_size is None and (storage_class or access_mode):
        raise click.UsageError("--storage-class and --access-mode only apply with --create SIZE")
    started = time.monotonic()
    deadline = started + timeout
    try:
        entries = collect(mappings, dereference=dereference)
        api_client, default_namespace = kube.load_client(kubeconfig, context)
        namespace = namespace or default_namespace
        api = kube.StageApi(api_client)
        request = (
            kube.ClaimRequest(size=create_size, access_mode=access_mode or "ReadWriteOnce", storage_class=storage_class)
            if create_size
            else None
        )
        _say(quiet, kube.ensure_claim(api, namespace, claim, request))
        pod = PodSettings(image, image_pull_policy, timeout, start_timeout)
        digests = _stage(api, namespace, claim, entries, mappings, pod, deadline, quiet)
    except StageError as exc:
        raise click.ClickException(str(exc)) from exc
    total = sum(d.size for d in digests.values())
    seconds = time.monotonic() - started
    click.echo(
        f"grpo stage: staged {_files(len(digests))} ({human_bytes(total)}) onto PersistentVolumeClaim {claim} "
        f"in namespace {namespace} in {seconds:.1f} s; sha256 of every file verified on the claim"
    )


def _stage_configmap(
    name: str,
    sources: list[configmap.Source],
    namespace: str | None,
    force: bool,
    dereference: bool,
    kubeconfig: str | None,
    context: str | None,
    quiet: bool,
) -> None:
    """--configmap: check and read the files, then create or replace the ConfigMap (no pod)."""
    try:
        payload = configmap.read_payload(configmap.collect_files(sources, dereference=dereference))
        api_client, default_namespace = kube.load_client(kubeconfig, context)
        namespace = namespace or default_namespace
        manifest = configmap.build_configmap(name=name, namespace=namespace, payload=payload)
        outcome = kube.put_configmap(kube.StageApi(api_client), manifest, force=force)
    except StageError as exc:
        raise click.ClickException(str(exc)) from exc
    for item in payload.items:
        _say(quiet, f"{item.key}  {human_bytes(item.size)}{'  (binaryData)' if item.binary else ''}")
    click.echo(
        f"grpo stage: staged {_files(len(payload.items))} ({human_bytes(payload.file_bytes)}) into ConfigMap {name} "
        f"in namespace {namespace} ({outcome})"
    )


@dataclass(frozen=True)
class PodSettings:
    image: str
    image_pull_policy: str
    lifetime_seconds: int
    start_timeout: int


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _stage(
    api: kube.StageApi,
    namespace: str,
    claim: str,
    entries: list[Entry],
    mappings: list[Mapping],
    settings: PodSettings,
    deadline: float,
    quiet: bool,
) -> dict[str, FileDigest]:
    """Create the pod, stream, verify; the pod is deleted whatever happens (Ctrl-C included)."""
    stage_id = secrets.token_hex(4)
    pod = f"{POD_PREFIX}{stage_id}"
    where = f"pod {pod} in namespace {namespace}"
    total = sum(e.size for e in entries)
    files = sum(1 for e in entries if not e.is_dir)
    api.create(
        build_pod(
            name=pod,
            namespace=namespace,
            claim=claim,
            image=settings.image,
            image_pull_policy=settings.image_pull_policy,
            lifetime_seconds=settings.lifetime_seconds,
        )
    )
    try:
        _say(quiet, f"started staging {where} (image {settings.image}); waiting for it to run")
        start_timeout = min(settings.start_timeout, max(1.0, deadline - time.monotonic()))
        kube.wait_running(api, namespace, pod, start_timeout)
        _say(quiet, f"sending {_files(files)} ({human_bytes(total)}) to claim {claim}")
        ws = api.open_exec(namespace, pod, receiver_command(stage_id, [m.dest for m in mappings]))
        digests: dict[str, FileDigest] | None = None
        try:
            sink = kube.ExecStdin(ws, deadline)
            try:
                digests = write_tar(entries, sink, Progress(total, _stderr(quiet)).advance)
                sink.close()
            except kube.ReceiverGone:
                pass  # the receiver's own words (below) say why
            except BaseException:
                kube.abort_exec(ws)
                raise
            result = kube.finish_exec(ws, deadline)
        finally:
            with contextlib.suppress(Exception):
                ws.close()
        code, message = exec_status(result.error_channel)
        if code != 0 or digests is None:
            said = result.stderr.strip() or message or "no message"
            status = f"exit code {code}" if code is not None else message or "no exit status"
            raise StageError(f"the receiver in {where} failed ({status}), staging onto claim {claim}:\n{said}")
        problems = compare_manifest(digests, result.stdout)
        if problems:
            raise StageError(f"claim {claim} does not hold what was sent ({where}):\n  " + "\n  ".join(problems[:20]))
        return digests
    finally:
        _say(quiet, f"deleting {where}")
        try:
            api.delete_pod(namespace, pod)
        except StageError as exc:
            click.echo(f"grpo stage: warning: {exc}", err=True)
