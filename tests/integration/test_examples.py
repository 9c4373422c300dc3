"""The shipped examples are valid GRPORuns: for the models and for the real API server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from grpo_api.runconfig import load_grporun
from tests.integration.test_crd import create, objects  # noqa: F401  (fixture)

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_cluster_and_local_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"grpo-run.yaml", "local-run.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_models(path: Path) -> None:
    load_grporun(path)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(objects: CustomObjectsApi, namespace: str, path: Path) -> None:  # noqa: F811
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    stored = create(objects, namespace, body)
    assert stored["spec"]["trainer"]["maxSteps"] == body["spec"]["trainer"]["maxSteps"]
