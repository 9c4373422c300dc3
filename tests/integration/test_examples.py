"""The shipped examples are valid GRPORuns: for the models and for the real API server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from grpo_api.runconfig import load_grporun
from tests.fixtures.grporun_objects import create

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_cluster_and_local_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"grpo-run.yaml", "local-run.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_models(path: Path) -> None:
    load_grporun(path)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(objects: CustomObjectsApi, namespace: str, path: Path) -> None:
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    stored = create(objects, namespace, body)
    assert stored["spec"]["trainer"]["maxSteps"] == body["spec"]["trainer"]["maxSteps"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_user_reward_an_example_names_is_shipped_beside_it(path: Path) -> None:
    """A cluster example's reward modules are the ones its comments tell users to stage."""
    import importlib.util

    run = load_grporun(path)
    for reward in run.spec.rewards:
        if ":" not in reward.function:
            continue
        module, function = reward.function.split(":")
        found = [p for p in (path.parent / "rewards" / f"{module}.py", path.parent / f"{module}.py") if p.is_file()]
        assert found, f"{path.name}: no module {module}.py for {reward.function}"
        if run.spec.reward_code is not None and run.spec.reward_code.source:
            assert f"{module}.py" in path.read_text(), f"{path.name} does not say how {module}.py is staged"
        spec = importlib.util.spec_from_file_location(module, found[0])
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        assert callable(getattr(loaded, function, None)), f"{found[0]} has no {function}"
