"""`grpo operator`: run the kopf operator that reconciles GRPORuns."""

from __future__ import annotations

import logging

import click

from grpo_operator.reconcile import OperatorConfig


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
