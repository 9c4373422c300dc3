"""Admission against a real kube-apiserver: what the run's children cannot carry is refused at `kubectl apply`.

ADMISSION_CASES (tests/fixtures/admission_cases.py; tests/unit/test_admission_models.py has the models refuse
the same specs) pairs each spec the API server must refuse, naming the field, with the nearest spec it must
accept. Also here: the run name
its children are named after, the immutable sections (in presence as well as in value) and the Reward
printer column.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from grpo_api.models import GROUP, IMMUTABLE_FIELDS, PLURAL, VERSION, GRPORunStatus, ProgressStatus
from grpo_api.runconfig import parse_grporun
from tests.fixtures.admission_cases import ADMISSION_CASES, BAD_RUN_NAMES, GOOD_RUN_NAMES, Case
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.grporun_objects import create, refused
from tests.fixtures.run_specs import run_with, valid_run

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

pytestmark = pytest.mark.controlplane


def _named(body: dict[str, Any], field: str, text: str) -> None:
    """The Status body of a 422 names `field` in one of its causes, with `text` in that cause's message."""
    causes = body["details"]["causes"]
    assert any(c.get("field") == field and text in c.get("message", "") for c in causes), causes


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_api_server_refuses_what_no_child_can_carry_naming_the_field(
    objects: CustomObjectsApi, namespace: str, case: Case
) -> None:
    status, body = refused(objects, namespace, run_with(case.bad, name="bad"))
    assert status == 422, body
    assert case.field in body["message"] and case.api_text in body["message"], body["message"]
    _named(body, case.field, case.api_text)


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_api_server_accepts_the_nearest_valid_spec_as_the_models_do(
    objects: CustomObjectsApi, namespace: str, case: Case
) -> None:
    doc = run_with(case.good, name="good")
    stored = create(objects, namespace, doc)
    assert stored["spec"] == parse_grporun(doc, "good.yaml").spec.to_wire()


@pytest.mark.parametrize("name", BAD_RUN_NAMES)
def test_api_server_refuses_a_run_name_its_children_cannot_carry(
    objects: CustomObjectsApi, namespace: str, name: str
) -> None:
    status, body = refused(objects, namespace, valid_run(name))
    assert status == 422, body
    _named(body, "metadata.name", "the server Service and trainer Jobs are named after it")


@pytest.mark.parametrize("name", GOOD_RUN_NAMES)
def test_api_server_accepts_a_run_name_its_children_can_carry(
    objects: CustomObjectsApi, namespace: str, name: str
) -> None:
    assert create(objects, namespace, valid_run(name))["metadata"]["name"] == name


def test_a_generated_name_is_checked_once_generated(objects: CustomObjectsApi, namespace: str) -> None:
    """generateName adds 5 characters: a 44-character prefix makes a 49-character name."""
    doc = valid_run()
    doc["metadata"] = {"generateName": "g" * 44}
    status, body = refused(objects, namespace, doc)
    assert status == 422 and "metadata.name" in body["message"], body
    doc["metadata"] = {"generateName": "g" * 43}
    assert len(create(objects, namespace, doc)["metadata"]["name"]) == 48


# ------------------------------------------------------------------------------------------ immutability

#: One non-default value of each immutable section: set at creation, then removed; or added later.
SECTIONS: dict[str, Any] = {
    "server": {"port": 8100},
    "rewardCode": {"inline": {"mine.py": "def f(completions, **kw):\n    return [0.0] * len(completions)\n"}},
    "trainer": {"numGenerations": 4},
    "storage": {"size": "1Gi"},
    "scheduling": {"nodeSelector": {"pool": "gpu"}},
    "initializer": {"backoffLimit": 1},
    "mode": "colocate",
    "output": {"destination": "pvc://results/run", "form": "merged"},
}
#: Sections with no default: the API server stores them absent when a run leaves them out.
OPTIONAL_SECTIONS = ("server", "rewardCode", "output")


def test_every_immutable_section_is_covered() -> None:
    assert set(IMMUTABLE_FIELDS) - {"model", "dataset", "rewards"} == set(SECTIONS)


def _patch_refused(objects: CustomObjectsApi, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as info:
        objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
    assert info.value.status == 422, info.value.body
    body: dict[str, Any] = json.loads(info.value.body)
    return body


@pytest.mark.parametrize("section", list(SECTIONS))
def test_an_immutable_section_cannot_be_removed(
    objects: CustomObjectsApi, namespace: str, section: str
) -> None:
    patch: dict[str, Any] = {section: SECTIONS[section]}
    if section == "rewardCode":
        patch["rewards"] = [{"function": "mine:f"}]
    create(objects, namespace, run_with(patch, name="set"))
    body = _patch_refused(objects, namespace, "set", {"spec": {section: None}})  # a merge patch's null removes
    # An optional section is gone (presence rule); a defaulted one comes back as its default (value rule).
    text = "cannot be added or removed" if section in OPTIONAL_SECTIONS else "cannot change"
    _named(body, f"spec.{section}", f"spec.{section} {text} after the run is created")
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "set")
    assert stored["spec"][section] == parse_grporun(run_with(patch), "set.yaml").spec.to_wire()[section]


@pytest.mark.parametrize("section", OPTIONAL_SECTIONS)
def test_an_immutable_section_cannot_be_added(
    objects: CustomObjectsApi, namespace: str, section: str
) -> None:
    create(objects, namespace, valid_run("unset"))
    body = _patch_refused(objects, namespace, "unset", {"spec": {section: SECTIONS[section]}})
    _named(body, f"spec.{section}", f"spec.{section} cannot be added or removed after the run is created")
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "unset")
    assert section not in stored["spec"]


def test_run_policy_stays_mutable_in_presence_too(objects: CustomObjectsApi, namespace: str) -> None:
    create(objects, namespace, run_with({"runPolicy": {"suspend": True}}, name="policy"))
    patched = objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "policy", {"spec": {"runPolicy": None}}
    )
    assert patched["spec"]["runPolicy"]["suspend"] is False  # defaulted again


# ---------------------------------------------------------------------------------------- printer column


def test_the_reward_column_is_short(control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str) -> None:
    create(objects, namespace, valid_run("shown"))
    status = GRPORunStatus(progress=ProgressStatus(step=3, max_steps=10, reward_mean=0.8234567890123456))
    objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "shown", {"status": status.to_wire()}
    )
    table = control_plane.kubectl("get", "grporuns", "shown", "-n", namespace, check=True).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert row[header.index("REWARD")] == "0.8235", table
