"""The checked-in CRD is exactly what the API models generate."""

import re
from pathlib import Path

from grpo_api.crd import CRD_FILE, build_crd, render_crd

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_crd_matches_the_models() -> None:
    assert (ROOT / CRD_FILE).read_text() == render_crd(), "run `grpo crd -o crds/grpo.dev_grporuns.yaml`"


def test_crd_has_status_subresource_and_printer_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:4] == ["Phase", "Step", "Reward", "Attempt"] and names[-1] == "Age"


def test_every_spec_field_has_a_description() -> None:
    missing: list[str] = []

    def walk(node: dict, path: str) -> None:
        for name, child in node.get("properties", {}).items():
            if "description" not in child:
                missing.append(f"{path}.{name}")
            walk(child, f"{path}.{name}")
            if isinstance(child.get("items"), dict):
                walk(child["items"], f"{path}.{name}[]")

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    walk(schema["properties"]["spec"], "spec")
    walk(schema["properties"]["status"], "status")
    assert not missing, missing


def test_descriptions_carry_no_measurements() -> None:
    """`kubectl explain` says what a field does; what it measured on which card lives in BENCHMARKS.md."""
    measured = re.compile(r"\b[AH]\d00\b|\d+(\.\d+)?x\b|tokens/s|\d s a step|ms a step")
    found: list[str] = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            text = node.get("description")
            match = measured.search(text) if isinstance(text, str) else None
            if match:
                found.append(f"{path}: {match.group(0)!r}")
            for key, child in node.items():
                walk(child, f"{path}.{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")

    walk(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert not found, found
