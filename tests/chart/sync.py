"""Refresh the chart's generated files from their sources of truth:

  charts/grpo-operator/files/crds/grpo.dev_grporuns.yaml  <- crds/grpo.dev_grporuns.yaml (`grpo crd`)
  charts/grpo-operator/files/rbac-rules.yaml              <- operator/grpo_operator/rbac.py

    .venv/bin/python -m tests.chart.sync           # write them
    .venv/bin/python -m tests.chart.sync --check   # exit 1 if any is stale (the tests check this too)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from grpo_operator.rbac import APPLICATION_RULES, FRAMEWORK_RULES, KUEUE_CLUSTER_RULES, KUEUE_RULES

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
CRD_SOURCE = REPO / "crds" / "grpo.dev_grporuns.yaml"
CRD_COPY = CHART / "files" / "crds" / "grpo.dev_grporuns.yaml"
RBAC_RULES = CHART / "files" / "rbac-rules.yaml"

RBAC_HEADER = """\
# Generated from operator/grpo_operator/rbac.py by `python -m tests.chart.sync`. Do not edit by hand.
# clusterRules: cluster-scoped (kopf's framework rules), always in a ClusterRole.
# namespacedRules: what the reconciler does to runs and their children; a Role in each watched
# namespace, or part of the ClusterRole when the operator watches all namespaces.
# kueueClusterRules, kueueNamespacedRules: added to those with kueue.enabled.
"""


def rbac_rules_text() -> str:
    body = yaml.safe_dump({"clusterRules": FRAMEWORK_RULES, "namespacedRules": APPLICATION_RULES,
                           "kueueClusterRules": KUEUE_CLUSTER_RULES, "kueueNamespacedRules": KUEUE_RULES},
                          sort_keys=False, default_flow_style=None, width=110)
    return RBAC_HEADER + body


def expected_files() -> dict[Path, str]:
    return {CRD_COPY: CRD_SOURCE.read_text(), RBAC_RULES: rbac_rules_text()}


def stale_files() -> list[Path]:
    return [path for path, text in expected_files().items() if not path.is_file() or path.read_text() != text]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_files()
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run `python -m tests.chart.sync`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
