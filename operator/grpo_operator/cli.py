"""`grpo operator`: run the kopf operator that reconciles GRPORuns."""

from __future__ import annotations

import logging

import click

from grpo_api.models import DEFAULT_SERVER_IMAGE, DEFAULT_TRAINER_IMAGE
from grpo_operator.builders import DEFAULT_OPERATOR_POD_LABELS, Images, ServerIngress, parse_label_selector
from grpo_operator.reconcile import OperatorConfig


def _labels(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, str] | None:
    """A KEY=VALUE,... option as matchLabels (None stays None: the option was not given)."""
    if value is None:
        return None
    try:
        return parse_label_selector(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


@click.command("operator")
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NS",
    help="Watch this namespace (repeatable; kopf globs such as 'team-*' work).",
)
@click.option("-A", "--all-namespaces", is_flag=True, help="Watch GRPORuns in every namespace.")
@click.option(
    "--liveness-port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="Port of the liveness endpoint /healthz (it reports seconds since the last reconcile); "
    "0 disables it.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=9090,
    show_default=True,
    help="Port of the Prometheus /metrics endpoint; 0 disables it.",
)
@click.option(
    "--allow-server-url-override",
    is_flag=True,
    help="Poll a run's health at its grpo.dev/server-url annotation instead of its Service "
    "(tests and out-of-cluster operators only: it lets a run's author choose the URL).",
)
@click.option(
    "--reconcile-interval",
    type=click.FloatRange(0.2, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between reconciles of a run when nothing asks for an earlier one.",
)
@click.option(
    "--health-timeout",
    type=click.FloatRange(0.1, 60),
    default=2.0,
    show_default=True,
    help="Timeout in seconds of one health check of a server.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=16,
    show_default=True,
    help="Threads that run reconciles (API and health calls block).",
)
@click.option(
    "--standalone/--peering",
    default=True,
    show_default=True,
    help="Run without kopf peering (one replica, as the chart deploys it) or with it.",
)
@click.option(
    "--network-policy/--no-network-policy",
    default=True,
    show_default=True,
    envvar="GRPO_NETWORK_POLICY",
    help="Give each run a NetworkPolicy: its server's port admits only the run's trainer pods, the "
    "operator's pods and the scrapers below (needs a CNI that enforces NetworkPolicy).",
)
@click.option(
    "--operator-pod-selector",
    default=",".join(f"{k}={v}" for k, v in DEFAULT_OPERATOR_POD_LABELS.items()),
    show_default=True,
    envvar="GRPO_OPERATOR_POD_SELECTOR",
    callback=_labels,
    metavar="K=V,...",
    help="Labels of this operator's pods, admitted to run servers (they poll the server's health).",
)
@click.option(
    "--operator-namespace-selector",
    default="",
    envvar="GRPO_OPERATOR_NAMESPACE_SELECTOR",
    callback=_labels,
    metavar="K=V,...",
    help="Labels of this operator's namespace, e.g. kubernetes.io/metadata.name=grpo-system "
    "[default: any namespace].",
)
@click.option(
    "--scraper-namespace-selector",
    default=None,
    envvar="GRPO_SCRAPER_NAMESPACE_SELECTOR",
    callback=_labels,
    metavar="K=V,...",
    help="Admit Prometheus scrapers from namespaces with these labels ('' = every namespace) to run "
    "servers' port; /metrics shares it with the mutating endpoints (a NetworkPolicy cannot tell "
    "paths apart). [default: no scraper is admitted]",
)
@click.option(
    "--scraper-pod-selector",
    default="",
    envvar="GRPO_SCRAPER_POD_SELECTOR",
    callback=_labels,
    metavar="K=V,...",
    help="Labels of the scraper pods in those namespaces [default: any pod].",
)
@click.option(
    "--server-image",
    default=DEFAULT_SERVER_IMAGE,
    show_default=True,
    envvar="GRPO_SERVER_IMAGE",
    metavar="IMAGE",
    help="Server image of runs whose spec.server.image is unset.",
)
@click.option(
    "--trainer-image",
    default=DEFAULT_TRAINER_IMAGE,
    show_default=True,
    envvar="GRPO_TRAINER_IMAGE",
    metavar="IMAGE",
    help="Trainer and initializer image of runs whose spec.trainer.image is unset.",
)
@click.option(
    "--kueue/--no-kueue",
    default=False,
    show_default=True,
    envvar="GRPO_KUEUE",
    help="Runs labelled kueue.x-k8s.io/queue-name wait for Kueue (v0.17+) to admit their server and trainer as one "
    "Workload (needs the chart's kueue.enabled RBAC); without it such a run is refused, naming the label.",
)
@click.option("--verbose", is_flag=True, help="Log more.")
@click.option("--debug", is_flag=True, help="Log everything kopf does.")
def operator(
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    liveness_port: int,
    metrics_port: int,
    allow_server_url_override: bool,
    reconcile_interval: float,
    health_timeout: float,
    workers: int,
    standalone: bool,
    network_policy: bool,
    operator_pod_selector: dict[str, str],
    operator_namespace_selector: dict[str, str],
    scraper_namespace_selector: dict[str, str] | None,
    scraper_pod_selector: dict[str, str],
    server_image: str,
    trainer_image: str,
    kueue: bool,
    verbose: bool,
    debug: bool,
) -> None:
    """Run the Kubernetes operator: reconcile GRPORuns into a health-gated server and trainer."""
    if bool(namespaces) == all_namespaces:
        raise click.UsageError(
            "pass --namespace NS (repeatable) or --all-namespaces, not both and not neither"
        )
    import kopf

    import grpo_operator.handlers  # noqa: F401  (registers the handlers with kopf)

    config = OperatorConfig(
        reconcile_interval=reconcile_interval,
        allow_server_url_override=allow_server_url_override,
        health_timeout=health_timeout,
        workers=workers,
        metrics_port=metrics_port,
        server_ingress=ServerIngress(
            operator_pods=operator_pod_selector,
            operator_namespaces=operator_namespace_selector,
            scraper_namespaces=scraper_namespace_selector,
            scraper_pods=scraper_pod_selector,
        )
        if network_policy
        else None,
        images=Images(server=server_image, trainer=trainer_image),
        kueue=kueue,
    )
    kopf.configure(verbose=verbose, debug=debug)
    # The client logs whole response bodies at DEBUG: far too much even for --debug.
    logging.getLogger("kubernetes.client.rest").setLevel(logging.INFO)
    kopf.run(
        standalone=standalone,
        clusterwide=all_namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None,
        memo=kopf.Memo(config=config),
    )
