"""The generated GRPORun CRD against a real kube-apiserver: accepted, defaulted, and strict.

The invalid manifests (INVALID_SPECS, tests/fixtures/run_specs.py) are the ones tests/unit/test_api_models.py
feeds to the pydantic models: the API server must refuse each one too, naming the field.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from grpo_api.models import GROUP, PLURAL, VERSION
from grpo_api.runconfig import parse_grporun
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.grporun_objects import create, refused
from tests.fixtures.run_specs import INVALID_SPECS, Invalid, run_with, valid_run

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

pytestmark = pytest.mark.controlplane


#: Every kind of source and pod setting at once: admitted, and defaulted as the models default it.
SOURCES_AND_POD_SETTINGS: dict[str, Any] = {
    "model": {"name": "tiny", "source": "pvc://models/tiny", "dtype": "float32"},
    "dataset": {"source": "configmap://prompts", "path": "prompts.jsonl"},
    "rewards": [{"function": "target_tokens:share"}, {"function": "token_fraction", "args": {"low": 1, "high": 9}}],
    "rewardCode": {"inline": {
        "target_tokens.py": "def share(completions, **kw):\n    return [0.0] * len(completions)\n"}},
    "server": {"env": [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api"}}},
                       {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
               "podLabels": {"team": "a"}, "podAnnotations": {"sidecar.istio.io/inject": "false"},
               "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
               "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}]},
    "trainer": {"env": [{"name": "WANDB_API_KEY",
                         "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "wandb", "optional": True}}},
                        {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ml", "key": "t"}}},
                        {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.tracking:5000"}],
                "reportTo": ["tensorboard", "mlflow", "wandb", "trackio"],
                "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
    "scheduling": {"imagePullSecrets": ["registry-creds"]},
    "storage": {"size": "1Gi", "accessModes": ["ReadWriteMany"]},
    "initializer": {"backoffLimit": 1, "activeDeadlineSeconds": 600},
}


def test_generated_crd_is_established_with_structural_schema_and_printer_columns(
    grporun_crd: dict[str, Any],
) -> None:
    conditions = {c["type"]: c["status"] for c in grporun_crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"
    (version,) = grporun_crd["spec"]["versions"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Step", "Reward", "Attempt", "Reason", "Adapter", "Preemptions", "Age"]
    assert grporun_crd["status"]["acceptedNames"]["shortNames"] == ["grpo"]


def test_kubectl_get_shows_the_printer_columns(control_plane: ControlPlane, grporun_crd: dict[str, Any],
                                               namespace: str) -> None:
    applied = control_plane.kubectl("apply", "-n", namespace, "--validate=strict", "-f", "-",
                                    input=yaml.safe_dump(valid_run("shown")))
    assert applied.returncode == 0, applied.stderr
    table = control_plane.kubectl("get", "grpo", "-n", namespace, "-o", "wide", check=True).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STEP", "REWARD", "ATTEMPT", "REASON", "ADAPTER", "PREEMPTIONS", "AGE"]
    assert table.splitlines()[1].startswith("shown ")


@pytest.mark.parametrize(
    "spec_patch",
    [{}, {"server": {}}, {"mode": "colocate", "trainer": {"lora": {"r": 128}}},
     {"server": {"maxLoraRank": 128, "port": 8100}, "trainer": {"lora": {"r": 128}, "numGenerations": 4}},
     {"storage": {"existingClaim": "shared"}}, SOURCES_AND_POD_SETTINGS,
     {"model": {"name": "qwen", "source": "hf://Qwen/Qwen2.5-0.5B@7ae557604adf67be50417f59c2c2f167def9a775",
                "hub": {"tokenSecretRef": {"name": "hf-token", "key": "token"}, "endpoint": "https://hf-mirror.corp"}},
      "dataset": {"source": "oci://registry.corp:5000/data/gsm8k:v1", "path": "train.parquet"},
      "rewardCode": {"source": "oci://registry.corp/rewards/math@sha256:" + "a" * 64, "path": "rewards"}}],
    ids=["minimal", "server-section", "colocate", "custom", "existing-claim", "sources-and-pod-settings",
         "hub-and-image-sources"],
)
def test_valid_run_is_accepted_and_defaulted_like_the_models(
    objects: CustomObjectsApi, namespace: str, spec_patch: dict[str, Any]
) -> None:
    doc = run_with(spec_patch, name="ok")
    stored = create(objects, namespace, doc)
    # The API server's defaults are the models' defaults, field for field.
    assert stored["spec"] == parse_grporun(doc, "ok.yaml").spec.to_wire()


def test_defaults_are_filled_in_by_the_api_server(objects: CustomObjectsApi, namespace: str) -> None:
    stored = create(objects, namespace, run_with({"server": {}}, name="defaults"))
    spec = stored["spec"]
    assert spec["mode"] == "server"
    assert spec["trainer"]["numGenerations"] == 8
    assert spec["trainer"]["lora"] == {"r": 16, "alpha": 32, "dropout": 0, "targetModules": ["all-linear"],
                                       "quantizeBase": False}
    assert spec["runPolicy"]["backoffLimit"] == 2
    assert spec["server"]["port"] == 8000
    assert spec["server"]["maxLoraRank"] == 64
    assert spec["server"]["healthPath"] == "/health/"
    assert spec["storage"]["size"] == "20Gi"
    assert spec["rewards"][0]["weight"] == 1


@pytest.mark.parametrize("case", INVALID_SPECS, ids=lambda c: c.id)
def test_api_server_refuses_invalid_spec_naming_the_field(
    objects: CustomObjectsApi, namespace: str, case: Invalid
) -> None:
    status, body = refused(objects, namespace, run_with(case.patch, name="bad"))
    message = body["message"]
    assert case.field in message and case.api_text in message, message
    if status == 422:  # Invalid: the causes name the field one by one
        causes = body["details"]["causes"]
        named = [c for c in causes if c.get("field") == case.field and case.api_text in c.get("message", "")]
        assert named, causes
    else:  # strict decoding of an unknown field is a 400 BadRequest
        assert status == 400 and body["reason"] == "BadRequest", body


def test_kubectl_strict_validation_refuses_an_unknown_field(
    control_plane: ControlPlane, grporun_crd: dict[str, Any], namespace: str
) -> None:
    doc = run_with({"trainer": {"numGeneration": 4}}, name="typo")
    result = control_plane.kubectl("apply", "-n", namespace, "--validate=strict", "-f", "-",
                                   input=yaml.safe_dump(doc))
    assert result.returncode != 0
    assert 'unknown field "spec.trainer.numGeneration"' in result.stderr, result.stderr


def test_spec_model_cannot_change_but_run_policy_can(objects: CustomObjectsApi, namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    create(objects, namespace, valid_run("immutable"))
    patched = objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "immutable", {"spec": {"runPolicy": {"suspend": True}}}
    )
    assert patched["spec"]["runPolicy"]["suspend"] is True
    with pytest.raises(ApiException) as info:
        objects.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "immutable", {"spec": {"model": {"name": "other"}}}
        )
    assert info.value.status == 422
    body = json.loads(info.value.body)
    assert "spec.model" in body["message"]
    assert "model cannot change after the run is created" in body["message"], body["message"]
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "immutable")
    assert stored["spec"]["model"]["name"] == "tiny"
