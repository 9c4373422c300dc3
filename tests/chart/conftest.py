"""Fixtures for the chart tests: the real helm and promtool, rendering, the Prometheus-operator CRDs.

helm and promtool are built from the Go module proxy by hack/build-testbin.sh (cached, like the
control plane's binaries). The Prometheus-operator CRDs come from the published Go module in the
module cache (`go mod download`), never from a copy in this repository.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
RELEASE = "grpo"
RELEASE_NAMESPACE = "grpo-system"
BUILD_TIMEOUT_S = 45 * 60

#: The newest prometheus-operator root module the Go proxy serves (v0.95.x answers 403 there); its
#: example/prometheus-operator-crd/ holds the CRDs. pkg/apis/monitoring@v0.95.x ships Go types only.
PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.94.0"
PROMETHEUS_OPERATOR_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


@dataclass(frozen=True)
class ChartTools:
    helm: Path
    promtool: Path


def _tools_in(directory: Path) -> ChartTools | None:
    tools = ChartTools(helm=directory / "helm", promtool=directory / "promtool")
    if tools.helm.is_file() and tools.promtool.is_file():
        return tools
    return None


@pytest.fixture(scope="session")
def chart_tools(tmp_path_factory: pytest.TempPathFactory) -> ChartTools:
    """helm and promtool from hack/build-testbin.sh (GRPO_TESTBIN_DIR when hack/test.sh already built them)."""
    prebuilt = os.environ.get("GRPO_TESTBIN_DIR")
    if prebuilt and (tools := _tools_in(Path(prebuilt))):
        return tools
    log = tmp_path_factory.mktemp("chart-tools") / "build-testbin.log"
    with log.open("w") as err:
        try:
            proc = subprocess.run(["bash", str(REPO / "hack" / "build-testbin.sh"), "helm", "promtool"],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hack/build-testbin.sh helm promtool took over {BUILD_TIMEOUT_S}s; log: {log}")
    lines = proc.stdout.strip().splitlines()
    tools = _tools_in(Path(lines[-1])) if lines else None
    if proc.returncode != 0 or tools is None:
        pytest.fail(f"could not build helm and promtool (exit {proc.returncode}); log tail:\n"
                    + "\n".join(log.read_text().splitlines()[-30:]), pytrace=False)
    return tools


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-05` (no dot) is a string; Helm and Kubernetes read it as
    YAML 1.2 does, as a number."""


Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                                   list("-+0123456789"))


class Chart:
    """`helm template` / `helm lint` of charts/grpo-operator with given values."""

    def __init__(self, tools: ChartTools, workdir: Path) -> None:
        self.tools = tools
        self.workdir = workdir
        self._count = 0

    def _values_file(self, values: dict[str, Any]) -> Path:
        self._count += 1
        path = self.workdir / f"values-{self._count}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    def helm(self, *args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        argv = [str(self.tools.helm), *args]
        if values:
            argv += ["-f", str(self._values_file(values))]
        env = {**os.environ, "HELM_CACHE_HOME": str(self.workdir / "helm-cache"),
               "HELM_CONFIG_HOME": str(self.workdir / "helm-config"),
               "HELM_DATA_HOME": str(self.workdir / "helm-data")}
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)

    def template_text(self, values: dict[str, Any] | None = None, namespace: str = RELEASE_NAMESPACE) -> str:
        result = self.helm("template", RELEASE, str(CHART), "--namespace", namespace, values=values)
        assert result.returncode == 0, f"helm template failed with values {values}:\n{result.stderr}"
        return result.stdout

    def render(self, values: dict[str, Any] | None = None, namespace: str = RELEASE_NAMESPACE) -> list[dict[str, Any]]:
        docs = yaml.load_all(self.template_text(values, namespace), Loader=Yaml12Loader)
        return [doc for doc in docs if doc]

    def lint(self, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return self.helm("lint", "--strict", str(CHART), "--namespace", RELEASE_NAMESPACE, values=values)


@pytest.fixture(scope="session")
def chart(chart_tools: ChartTools, tmp_path_factory: pytest.TempPathFactory) -> Chart:
    return Chart(chart_tools, tmp_path_factory.mktemp("chart"))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None,
         namespace: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)
            and (namespace is None or d["metadata"].get("namespace") == namespace)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def prometheus_rules_file(docs: list[dict[str, Any]], directory: Path) -> Path:
    """The rendered PrometheusRule's groups as a plain Prometheus rules file (what promtool reads)."""
    rule = one(docs, "PrometheusRule")
    path = directory / "grpo-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def prometheus_operator_crds() -> list[Path]:
    """The ServiceMonitor, PodMonitor and PrometheusRule CRDs from the published Go module."""
    with tempfile.TemporaryDirectory() as scratch:  # outside any Go module
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION}"],
            cwd=scratch, capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"go mod download {PROMETHEUS_OPERATOR_MODULE}: {proc.stderr or proc.stdout}", pytrace=False)
    if "Error" in info or "Dir" not in info:
        pytest.fail(f"go mod download {PROMETHEUS_OPERATOR_MODULE}: {info.get('Error')}", pytrace=False)
    crd_dir = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    paths = [crd_dir / f"monitoring.coreos.com_{plural}.yaml" for plural in PROMETHEUS_OPERATOR_CRDS]
    missing = [str(p) for p in paths if not p.is_file()]
    assert not missing, f"the module zip no longer holds {missing}"
    return paths
