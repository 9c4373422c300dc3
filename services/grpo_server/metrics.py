"""Prometheus metrics of the server, on prometheus_client's default registry.

The vLLM engine registers its own `vllm:` metrics on the same registry, so
`GET /metrics` shows both. `METRIC_NAMES` lists every family this module exports,
as it appears in the exposition (counters with `_total`; histograms also export
`_bucket`, `_sum` and `_count` series); dashboards and alerts are checked against it.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from grpo_api.protocol import ADAPTER_REFUSALS

# `*_created` series double the exposition and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "grpo_server_requests", "HTTP requests by endpoint (route template) and status code.", ["endpoint", "status"]
)
REQUEST_DURATION = Histogram(
    "grpo_server_request_duration_seconds",
    "HTTP request latency by endpoint.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
REQUESTS_IN_FLIGHT = Gauge("grpo_server_requests_in_flight", "Generation requests being served now.")
REQUESTS_ABORTED = Counter(
    "grpo_server_requests_aborted",
    "Generation requests aborted in the engine because their client disconnected.",
    ["endpoint"],
)
PROMPT_TOKENS = Counter("grpo_server_prompt_tokens", "Prompt tokens of served generation requests.")
GENERATION_TOKENS = Counter("grpo_server_generation_tokens", "Tokens generated.")
ADAPTER_LOADS = Counter("grpo_server_adapter_loads", "Adapter versions loaded and activated.")
ADAPTER_LOAD_FAILURES = Counter(
    "grpo_server_adapter_load_failures", "Refused or failed adapter loads by reason.", ["reason"]
)
# Every reason starts at 0: dashboards show "no failures" rather than no data, and increase() sees the first.
for _reason in ADAPTER_REFUSALS:
    ADAPTER_LOAD_FAILURES.labels(_reason)
ADAPTER_LOAD_DURATION = Histogram(
    "grpo_server_adapter_load_duration_seconds",
    "Time from trigger to active adapter (validation + engine load).",
    buckets=LOAD_BUCKETS,
)
ACTIVE_ADAPTER_VERSION = Gauge(
    "grpo_server_active_adapter_version", "Version of the active adapter; 0 when the base model is active."
)
LOADED_ADAPTERS = Gauge("grpo_server_loaded_adapters", "Adapter versions resident in the engine.")
BOOT_TIME = Gauge("grpo_server_boot_time_seconds", "Unix time the server process started.")
PAUSED = Gauge("grpo_server_paused", "1 while generation is paused (POST /pause until /resume), else 0.")
ENGINE_READY = Gauge("grpo_server_engine_ready", "1 when the engine can serve generations, else 0.")
INFO = Gauge("grpo_server_info", "Constant 1, labelled with the server's identity.", ["boot_id", "engine", "model"])

#: Every metric family this module exports, as named in the exposition.
METRIC_NAMES: tuple[str, ...] = (
    "grpo_server_requests_total",
    "grpo_server_request_duration_seconds",
    "grpo_server_requests_in_flight",
    "grpo_server_requests_aborted_total",
    "grpo_server_prompt_tokens_total",
    "grpo_server_generation_tokens_total",
    "grpo_server_adapter_loads_total",
    "grpo_server_adapter_load_failures_total",
    "grpo_server_adapter_load_duration_seconds",
    "grpo_server_active_adapter_version",
    "grpo_server_loaded_adapters",
    "grpo_server_boot_time_seconds",
    "grpo_server_engine_ready",
    "grpo_server_paused",
    "grpo_server_info",
)
