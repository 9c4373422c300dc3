"""Values the run's children must carry, refused by the models as the API server refuses them (issue 18).

Every spec field that ends up in a child object (a container's env, resources, image, ports and mounts; the
pod's volumes, labels, annotations, node selector, tolerations and class names; the claim's size and class;
the source volumes' claim and ConfigMap names) has a rule at admission. ADMISSION_CASES
(tests/fixtures/admission_cases.py) is shared with tests/integration/test_admission.py, which sends the same
manifests to a real kube-apiserver: each `bad` spec is refused by both, naming the field, and each `good` one
(the nearest valid spec) accepted by both.
"""

from __future__ import annotations

import pytest

from grpo_api.models import (
    MAX_RUN_NAME,
    GRPORunStatus,
    ProgressStatus,
    parse_quantity,
    round_reward,
)
from grpo_api.runconfig import parse_grporun
from tests.fixtures.admission_cases import ADMISSION_CASES, BAD_RUN_NAMES, GOOD_RUN_NAMES, Case
from tests.fixtures.run_specs import refusal, run_with, valid_run


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_models_refuse_what_no_child_can_carry_naming_the_field(case: Case) -> None:
    message = refusal(run_with(case.bad))
    lines = [line.strip() for line in message.splitlines()[1:]]
    assert any(line.startswith(f"{case.model_loc}:") and case.model_text in line for line in lines), (
        f"expected a line '{case.model_loc}: ...{case.model_text}...' in:\n{message}"
    )


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_models_accept_the_nearest_valid_spec(case: Case) -> None:
    parse_grporun(run_with(case.good), "good.yaml")


def test_the_cases_are_distinct() -> None:
    assert len({c.id for c in ADMISSION_CASES}) == len(ADMISSION_CASES)


@pytest.mark.parametrize("name", BAD_RUN_NAMES)
def test_models_refuse_a_run_name_its_children_cannot_carry(name: str) -> None:
    message = refusal(valid_run(name))
    assert "metadata.name:" in message and f"at most {MAX_RUN_NAME} characters" in message, message


@pytest.mark.parametrize("name", GOOD_RUN_NAMES)
def test_models_accept_a_run_name_its_children_can_carry(name: str) -> None:
    assert parse_grporun(valid_run(name), "run.yaml").metadata.name == name


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", 1), ("500m", 0.5), ("1Ki", 1024), ("2Gi", 2 * 2**30), ("1e3", 1000), ("1.5k", 1500), (".5", 0.5),
     ("+2", 2), ("3E", 3 * 10**18), ("4n", 4e-9), ("1E-2", 0.01), (7, 7)],
)
def test_quantities_parse_as_kubernetes_parses_them(text: str | int, value: float) -> None:
    parsed = parse_quantity(text)
    assert parsed is not None and float(parsed) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "1K", "1 Gi", "Gi", "1e", "1Ki3", "1.2.3", "٣", "1gi", "0x10"])
def test_quantities_kubernetes_refuses_do_not_parse(text: str) -> None:
    assert parse_quantity(text) is None


def test_status_reward_is_kept_short_for_the_printer_column() -> None:
    """kubectl prints a number column with every digit the object holds (0.8234567890123456)."""
    assert ProgressStatus(reward_mean=0.8234567890123456).reward_mean == 0.8235
    assert round_reward(1234.5678) == 1235.0 and round_reward(-0.000123456) == -0.0001235
    status = GRPORunStatus.model_validate({"progress": {"rewardMean": 0.123456789}})
    assert status.to_wire()["progress"]["rewardMean"] == 0.1235
    assert round_reward(round_reward(2 / 3)) == round_reward(2 / 3)  # stable: the status is written when it changes
