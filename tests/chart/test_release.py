"""The release workflow (.github/workflows/release.yml): it passes a real linter (actionlint, built from the Go
module proxy by hack/build-testbin.sh), pushes every image and chart the code and the chart name by default, at
the version they name, and the Python package it builds gives the CLI's cluster commands without torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_api.models import DEFAULT_SERVER_IMAGE, DEFAULT_TRAINER_IMAGE
from tests.fixtures.installs import install

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def actionlint_dir() -> Path:
    found = os.environ.get("GRPO_TESTBIN_DIR")
    if found and (Path(found) / "actionlint").is_file():
        return Path(found)
    out = subprocess.run(["bash", "hack/build-testbin.sh", "actionlint"], cwd=REPO, capture_output=True, text=True,
                         timeout=1800, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def workflow() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text())
    return doc


def actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(actionlint_dir() / "actionlint"), "-no-color", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_release_workflow_passes_actionlint() -> None:
    done = actionlint(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_is_a_real_linter_here(tmp_path: Path) -> None:
    """The same binary refuses a workflow with a mistake in it, so the test above can fail."""
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    steps:\n"
                      "      - run: echo ${{ matrix.nothing }}\n")
    done = actionlint(broken)
    assert done.returncode != 0 and "matrix" in done.stdout, done.stdout


def pushed_images() -> set[str]:
    """Every image reference the images job pushes, with the version of this checkout."""
    doc = workflow()
    registry = doc["env"]["REGISTRY"]
    job = doc["jobs"]["images"]
    (build,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action@")]
    assert build["with"]["push"] is True
    refs = set()
    for entry in job["strategy"]["matrix"]["include"]:
        tag = (build["with"]["tags"].replace("${{ env.REGISTRY }}", registry)
               .replace("${{ matrix.name }}", entry["name"])
               .replace("${{ needs.version.outputs.version }}", VERSION)
               .replace("${{ matrix.suffix }}", entry["suffix"]))
        refs.add(tag)
        # the default GPU images are the Dockerfiles' default engine, the -cpu ones ENGINE=cpu
        assert entry["engine"] == ("cpu" if entry["suffix"] == "-cpu" else ("vllm" if entry["name"] != "grpo-operator"
                                                                              else ""))
        assert (REPO / entry["dockerfile"]).is_file()
    return refs


def test_the_workflow_pushes_every_image_the_defaults_name() -> None:
    values = yaml.safe_load((REPO / "charts" / "grpo-operator" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "grpo-operator" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION
    operator_image = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    pushed = pushed_images()
    for default in (DEFAULT_SERVER_IMAGE, DEFAULT_TRAINER_IMAGE, operator_image):
        assert default in pushed, f"{default} is a default nobody pushes: {sorted(pushed)}"
    for cpu in ("grpo-server", "grpo-trainer"):
        assert f"ghcr.io/grpo-dev/{cpu}:{VERSION}-cpu" in pushed, sorted(pushed)


def test_the_chart_is_pushed_as_an_oci_artifact_where_the_readme_installs_it_from() -> None:
    doc = workflow()
    script = "\n".join(s.get("run", "") for s in doc["jobs"]["chart"]["steps"])
    assert 'helm push "dist/grpo-operator-$VERSION.tgz" "oci://$REGISTRY/charts"' in script
    readme = (REPO / "README.md").read_text()
    assert f"helm install grpo oci://{doc['env']['REGISTRY']}/charts/grpo-operator --version {VERSION}" in readme


def test_the_tag_must_equal_every_version_in_the_tree() -> None:
    """The version job's own shell, run here against this checkout: the matching tag passes, another fails."""
    (check,) = [s for s in workflow()["jobs"]["version"]["steps"] if s.get("id") == "check"]
    for tag, ok in ((f"v{VERSION}", True), ("v9.9.9", False)):
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gh-output-{os.getpid()}"
        out.unlink(missing_ok=True)
        done = subprocess.run(["bash", "-e", "-c", check["run"]], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TAG": tag, "GITHUB_OUTPUT": str(out)})
        assert (done.returncode == 0) == ok, done.stdout + done.stderr
        if ok:
            assert out.read_text().strip() == f"version={VERSION}"
        out.unlink(missing_ok=True)


@pytest.mark.timeout(900)
def test_the_wheel_gives_the_cli_for_a_cluster_without_torch(tmp_path: Path) -> None:
    """What the python job does, for real: the wheel of this checkout in a fresh environment with the cli
    extra only (the index's wheels, as a user installs it; from uv's cache where it holds them: installs.py):
    `grpo stage --help`, the cluster commands, `kubectl-grpo` and `grpo crd` work, and torch is not there."""
    # A copy of what the wheel is built from (the images' build context): setuptools writes build/ beside it.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for tree in ("services", "operator"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    # The build backend of this environment (pyproject's build-system: setuptools, wheel; hack/venv.sh installs
    # both): an isolated build would download them again.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(source)], check=True, timeout=600, capture_output=True)
    (wheel,) = dist.glob("grpo_operator-*.whl")
    env_dir = tmp_path / "cli"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / "bin"
    install(bin_dir / "python", f"{wheel}[cli]")
    stage = subprocess.run([str(bin_dir / "grpo"), "stage", "--help"], capture_output=True, text=True, timeout=120)
    assert stage.returncode == 0 and "Usage: grpo stage" in stage.stdout, stage.stdout + stage.stderr
    for command in ("get", "status", "logs", "wait", "pull", "suspend", "resume", "cancel"):
        shown = subprocess.run([str(bin_dir / "grpo"), command, "--help"], capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and f"Usage: grpo {command}" in shown.stdout, shown.stdout + shown.stderr
    plugin = subprocess.run([str(bin_dir / "kubectl-grpo"), "wait", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert plugin.returncode == 0 and "Usage: kubectl grpo wait" in plugin.stdout, plugin.stdout + plugin.stderr
    crd = subprocess.run([str(bin_dir / "grpo"), "crd"], capture_output=True, text=True, timeout=120)
    assert crd.returncode == 0 and "kind: CustomResourceDefinition" in crd.stdout, crd.stderr
    torch = subprocess.run([str(bin_dir / "python"), "-c", "import torch"], capture_output=True, timeout=60)
    assert torch.returncode != 0, "torch came with the CLI"
