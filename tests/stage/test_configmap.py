"""`grpo stage --configmap`: the pure part (SRC[:KEY], files, keys, sizes, manifest), its argument
checks, and the command against a real kube-apiserver (tests/fixtures/controlplane.py)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from grpo_stage import cli as stage_cli
from grpo_stage import configmap as cm
from grpo_stage import kube
from grpo_stage.errors import StageError
from tests.fixtures.controlplane import ControlPlane

BINARY = bytes(range(256)) * 3 + b"\xff\xfe\x00"  # not UTF-8


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A directory of small files: text, a reward module and a binary one."""
    root = tmp_path / "files"
    root.mkdir()
    (root / "prompts.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2=\u00e9"}\n', encoding="utf-8")
    (root / "my_rewards.py").write_text("def reward(completion: str) -> float:\n    return 1.0\n")
    (root / "table.bin").write_bytes(BINARY)
    return root


def sources(*texts: str) -> list[cm.Source]:
    return [cm.parse_source(t) for t in texts]


# ----------------------------------------------------------------------------------- SRC[:KEY], names


def test_parse_source_splits_at_the_last_colon() -> None:
    assert cm.parse_source("./a/prompts.jsonl") == cm.Source(Path("./a/prompts.jsonl"), None)
    assert cm.parse_source("./a/p.jsonl:prompts.jsonl") == cm.Source(Path("./a/p.jsonl"), "prompts.jsonl")
    assert cm.parse_source("/x/run:1/p.jsonl:p.jsonl") == cm.Source(Path("/x/run:1/p.jsonl"), "p.jsonl")
    assert str(cm.parse_source("a:b")) == "a:b" and str(cm.parse_source("a")) == "a"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("./p.jsonl:", "only letters, digits"),
        ("./p.jsonl:a/b", "only letters, digits"),
        ("./p.jsonl:my key", "only letters, digits"),
        ("./p.jsonl:.", "may not be '.' or '..'"),
        ("./p.jsonl:..", "may not be '.' or '..'"),
        ("./p.jsonl:" + "k" * 254, "at most 253 characters"),
        (":key", "empty SRC"),
    ],
)
def test_parse_source_refuses_bad_keys(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cm.parse_source(text)


def test_keys_and_names() -> None:
    assert cm.key_problem("a-b_c.D9") is None
    assert cm.key_problem("k" * 253) is None
    assert cm.key_problem(".hidden") is None
    assert cm.validate_name("my-rewards.v2") == "my-rewards.v2"
    for bad in ("My-Rewards", "-x", "x-", "a_b", "", "a" * 254):
        with pytest.raises(ValueError, match="is not a ConfigMap name"):
            cm.validate_name(bad)


# ---------------------------------------------------------------------------------------- the files


def test_collect_files_default_and_explicit_keys(files: Path) -> None:
    got = cm.collect_files(sources(str(files / "prompts.jsonl"), f"{files / 'my_rewards.py'}:rewards.py"))
    assert [(f.key, f.path) for f in got] == [
        ("prompts.jsonl", files / "prompts.jsonl"),
        ("rewards.py", files / "my_rewards.py"),
    ]
    assert got[1].size == (files / "my_rewards.py").stat().st_size


def test_collect_files_takes_a_directorys_top_level_files(files: Path) -> None:
    got = cm.collect_files(sources(str(files)))
    assert [f.key for f in got] == ["my_rewards.py", "prompts.jsonl", "table.bin"]
    assert cm.read_payload(got).data["my_rewards.py"] == (files / "my_rewards.py").read_text()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A stand-in private key outside the folder being staged."""
    path = tmp_path / "home" / ".ssh" / "id_ed25519"
    path.parent.mkdir(parents=True)
    path.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    return path


def test_collect_files_refuses_a_link_out_of_the_folder_naming_it(files: Path, secret: Path) -> None:
    (files / "notes.txt").symlink_to(secret)
    with pytest.raises(StageError, match=rf"{files}/notes\.txt is a symbolic link to {secret}: grpo stage reads only "
                       r"regular files .* -L/--dereference"):
        cm.collect_files(sources(str(files)))


@pytest.mark.parametrize(
    ("make", "args"),
    [
        (lambda d, s: (d / "alias.py").symlink_to("my_rewards.py"), lambda d: [str(d)]),
        (lambda d, s: (d / "notes.txt").symlink_to(s), lambda d: [f"{d}/notes.txt"]),
        (lambda d, s: (d / "notes.txt").symlink_to(s), lambda d: [f"{d}/notes.txt:notes.txt"]),
        (lambda d, s: (d.parent / "linked-dir").symlink_to(d), lambda d: [str(d.parent / "linked-dir")]),
    ],
    ids=["inside-the-folder", "as-src", "as-src-with-key", "directory-as-src"],
)
def test_collect_files_refuses_every_link_unless_dereference(files: Path, secret: Path, make: Any, args: Any) -> None:
    make(files, secret)
    with pytest.raises(StageError, match=r"is a symbolic link to .*-L/--dereference"):
        cm.collect_files(sources(*args(files)))
    payload = cm.read_payload(cm.collect_files(sources(*args(files)), dereference=True))
    assert payload.items


def test_collect_files_dereference_reads_what_the_link_points_to(files: Path, secret: Path) -> None:
    (files / "notes.txt").symlink_to(secret)
    got = cm.collect_files(sources(str(files)), dereference=True)
    assert [f.key for f in got] == ["my_rewards.py", "notes.txt", "prompts.jsonl", "table.bin"]
    assert cm.read_payload(got).data["notes.txt"] == secret.read_text()


def test_collect_files_refuses_a_src_directory_swapped_for_a_link_before_it_is_listed(
    files: Path, secret: Path, swap_for_link_when_read: Callable[[Path, Path], list[Path]],
) -> None:
    """The SRC directory passes as a directory, then becomes a link to ~/.ssh before its files are listed: nothing
    there is listed or read."""
    (secret.parent / "prompts.jsonl").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    swapped = swap_for_link_when_read(files, secret.parent)

    with pytest.raises(StageError, match=rf"cannot read directory {files} \(did it become a symbolic link\?\)"):
        cm.read_payload(cm.collect_files(sources(str(files))))

    assert swapped == [files]


@pytest.mark.parametrize("swap", ["link", "file"])
def test_read_payload_refuses_a_file_swapped_after_it_was_listed(
    files: Path, secret: Path, tmp_path: Path, swap: str
) -> None:
    listed = cm.collect_files(sources(str(files)))
    replacement = tmp_path / "replacement"
    if swap == "link":
        replacement.symlink_to(secret)
        message = r"prompts\.jsonl became a symbolic link \(to .*id_ed25519\) after it was listed"
    else:
        replacement.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
        message = r"prompts\.jsonl is no longer the file that was listed"
    replacement.replace(files / "prompts.jsonl")  # made before the old one goes: not its inode
    with pytest.raises(StageError, match=message):
        cm.read_payload(listed)


def test_read_payload_refuses_a_file_that_grew_past_the_limit_after_listing(files: Path) -> None:
    listed = cm.collect_files(sources(f"{files}/prompts.jsonl"))
    with (files / "prompts.jsonl").open("ab") as f:
        f.write(b"x" * (cm.SIZE_LIMIT + 10))
    with pytest.raises(StageError, match="more than the 1,000,000 bytes"):
        cm.read_payload(listed)


def test_collect_files_refuses_subdirectories_naming_them(files: Path) -> None:
    (files / "sub").mkdir()
    (files / "more").mkdir()
    with pytest.raises(StageError, match=rf"SRC directory {files} has subdirectories \(more, sub\).*top level"):
        cm.collect_files(sources(str(files)))


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: None, lambda d: [f"{d}:k"], "is a directory: give KEY only for a file"),
        (lambda d: None, lambda d: [f"{d}/nope.txt"], "nope.txt does not exist"),
        (lambda d: (d / "empty").mkdir(), lambda d: [f"{d}/empty"], "empty holds no files"),
        (
            lambda d: (d / "my file.py").write_text("x"),
            lambda d: [f"{d}/my file.py"],
            "my file.py is not a ConfigMap key",
        ),
        (
            lambda d: (d / "my file.py").write_text("x"),
            lambda d: [str(d)],
            "my file.py: its name is not a ConfigMap key",
        ),
        (lambda d: os.symlink(d / "gone", d / "dangling"), lambda d: [str(d)], "dangling is a symbolic link to"),
        (lambda d: os.mkfifo(d / "pipe"), lambda d: [f"{d}/pipe"], "is neither a regular file nor a directory"),
        (lambda d: os.mkfifo(d / "pipe"), lambda d: [str(d)], "pipe is not a regular file"),
        (
            lambda d: None,
            lambda d: [f"{d}/prompts.jsonl", f"{d}/my_rewards.py:prompts.jsonl"],
            "key prompts.jsonl is given twice: by .*prompts.jsonl and by .*my_rewards.py",
        ),
        (lambda d: None, lambda d: [str(d), f"{d}/table.bin"], "key table.bin is given twice"),
    ],
)
def test_collect_files_errors_name_the_file(files: Path, make: Any, args: Any, message: str) -> None:
    make(files)
    with pytest.raises(StageError, match=message):
        cm.collect_files(sources(*args(files)))


def test_read_payload_sorts_text_and_binary(files: Path) -> None:
    payload = cm.read_payload(cm.collect_files(sources(str(files))))
    assert set(payload.data) == {"my_rewards.py", "prompts.jsonl"}
    assert payload.data["prompts.jsonl"] == (files / "prompts.jsonl").read_text(encoding="utf-8")
    assert set(payload.binary_data) == {"table.bin"}
    assert base64.b64decode(payload.binary_data["table.bin"]) == BINARY
    assert [(i.key, i.binary) for i in payload.items] == [
        ("my_rewards.py", False),
        ("prompts.jsonl", False),
        ("table.bin", True),
    ]
    assert payload.file_bytes == sum(p.stat().st_size for p in files.iterdir())
    text = sum(len(k) + len(v.encode()) for k, v in payload.data.items())
    assert payload.stored_size == text + len("table.bin") + len(payload.binary_data["table.bin"])


def test_size_limit_counts_keys_and_values(tmp_path: Path) -> None:
    exact = tmp_path / "k"
    exact.write_bytes(b"x" * (cm.SIZE_LIMIT - 1))  # key "k" + value: exactly the limit
    assert cm.read_payload(cm.collect_files(sources(str(exact)))).stored_size == cm.SIZE_LIMIT
    with pytest.raises(StageError, match=r"1,000,001 bytes \(976.6 KiB\).*--claim"):
        cm.collect_files(sources(f"{exact}:kk"))  # refused from the sizes alone, before reading


def test_size_limit_counts_binary_data_base64_encoded(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff" * 800_000)  # fits as bytes, not once encoded (1,066,668)
    files = cm.collect_files(sources(str(blob)))
    with pytest.raises(StageError, match=r"1,066,676 bytes .*binaryData counted base64-encoded.*with --claim"):
        cm.read_payload(files)


def test_manifest_and_replacement() -> None:
    payload = cm.Payload(data={"a.txt": "A"}, binary_data={"b.bin": "/w=="}, items=[])
    manifest = cm.build_configmap(name="r", namespace="ns", payload=payload)
    assert manifest == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "r",
            "namespace": "ns",
            "labels": {"app.kubernetes.io/managed-by": "grpo-stage", "app.kubernetes.io/part-of": "grpo-operator"},
        },
        "data": {"a.txt": "A"},
        "binaryData": {"b.bin": "/w=="},
    }
    existing = {
        "metadata": {
            "name": "r",
            "namespace": "ns",
            "resourceVersion": "42",
            "labels": {"team": "a", "app.kubernetes.io/managed-by": "someone"},
            "annotations": {"note": "kept"},
            "managedFields": [{"manager": "kubectl"}],
        },
        "data": {"old.txt": "gone"},
        "binaryData": {"old.bin": "AA=="},
    }
    assert not cm.is_managed(existing) and cm.is_managed(manifest)
    replaced = cm.replacement(existing, manifest)
    assert replaced["data"] == {"a.txt": "A"} and replaced["binaryData"] == {"b.bin": "/w=="}
    assert replaced["metadata"] == {
        "name": "r",
        "namespace": "ns",
        "resourceVersion": "42",
        "labels": {"team": "a", **cm.LABELS},
        "annotations": {"note": "kept"},
    }
    text_only = cm.build_configmap(name="r", namespace="ns", payload=cm.Payload({"a": "A"}, {}, []))
    assert "binaryData" not in cm.replacement(existing, text_only)


# ------------------------------------------------------------------ create or replace (a fake API)


class FakeConfigMaps:
    """read/create/replace_configmap with scripted conflicts."""

    def __init__(self, existing: dict[str, Any] | None, conflicts: int = 0) -> None:
        self.existing = existing
        self.conflicts = conflicts
        self.replaced: list[dict[str, Any]] = []

    def create_configmap(self, manifest: dict[str, Any]) -> bool:
        if self.existing is not None:
            return False
        self.existing = manifest
        return True

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.existing

    def replace_configmap(self, manifest: dict[str, Any]) -> bool:
        if self.conflicts:
            self.conflicts -= 1
            return False
        self.replaced.append(manifest)
        return True


MANIFEST = cm.build_configmap(name="r", namespace="ns", payload=cm.Payload({"a": "A"}, {}, []))
OURS = {"metadata": {"name": "r", "resourceVersion": "7", "labels": dict(cm.LABELS)}, "data": {"old": "x"}}


def test_put_configmap_creates_or_replaces_retrying_conflicts() -> None:
    assert kube.put_configmap(FakeConfigMaps(None), MANIFEST, force=False) == "created"  # type: ignore[arg-type]
    api = FakeConfigMaps(OURS, conflicts=2)
    assert kube.put_configmap(api, MANIFEST, force=False) == "replaced"  # type: ignore[arg-type]
    assert api.replaced[0]["data"] == {"a": "A"} and api.replaced[0]["metadata"]["resourceVersion"] == "7"
    api = FakeConfigMaps(OURS, conflicts=10)
    with pytest.raises(StageError, match=r"ConfigMap r in namespace ns kept changing .*\(5 attempts\)"):
        kube.put_configmap(api, MANIFEST, force=False)  # type: ignore[arg-type]


def test_put_configmap_refuses_foreign_and_immutable_ones() -> None:
    foreign = {"metadata": {"name": "r", "resourceVersion": "7"}, "data": {}}
    with pytest.raises(StageError, match="ConfigMap r in namespace ns exists and was not made by grpo stage"):
        kube.put_configmap(FakeConfigMaps(foreign), MANIFEST, force=False)  # type: ignore[arg-type]
    assert kube.put_configmap(FakeConfigMaps(foreign), MANIFEST, force=True) == "replaced"  # type: ignore[arg-type]
    with pytest.raises(StageError, match="ConfigMap r in namespace ns is immutable"):
        kube.put_configmap(FakeConfigMaps({**OURS, "immutable": True}), MANIFEST, force=True)  # type: ignore[arg-type]


def test_configmap_api_errors_name_namespace_configmap_and_rbac() -> None:
    exc = kube.ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"message": 'configmaps is forbidden: User "me" cannot create resource "configmaps"'})
    message = str(kube._configmap_error("create", "team-a", "r", exc))
    assert message.startswith("cannot create ConfigMap r in namespace team-a: 403 configmaps is forbidden")
    assert message.endswith("(grpo stage needs: get/create/update configmaps)")
    exc = kube.ApiException(status=422, reason="Unprocessable Entity")
    assert "refused ConfigMap r in namespace team-a as invalid: 422" in str(
        kube._configmap_error("create", "team-a", "r", exc)
    )


# ------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x"], "give one of --claim CLAIM"),
        (["--claim", "c", "--configmap", "r", "x:y"], "not both"),
        (["--configmap", "r", "--image", "busybox", "x"], "--image only applies with --claim"),
        (["--configmap", "r", "--image", "busybox", "--start-timeout", "5", "x"], "--image, --start-timeout only"),
        (["--configmap", "r", "--create", "1Gi", "x"], "--create only applies with --claim"),
        (["--configmap", "r", "--image-pull-policy", "IfNotPresent", "x"], "--image-pull-policy only applies"),
        (["--claim", "c", "--force", "x:y"], "--force only applies with --configmap"),
        (["--configmap", "Rewards", "x"], "'Rewards' is not a ConfigMap name"),
        (["--configmap", "r", "x:a/b"], "Invalid value for 'SRC[:KEY]...': KEY 'a/b'"),
    ],
)
def test_configmap_argument_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(stage_cli.stage, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_configmap_refuses_a_link_before_any_api_call(files: Path, secret: Path) -> None:
    (files / "notes.txt").symlink_to(secret)
    result = CliRunner().invoke(stage_cli.stage, ["--configmap", "r", "--kubeconfig", "/nonexistent", str(files)])
    assert result.exit_code == 1, result.output
    assert f"{files}/notes.txt is a symbolic link to {secret}" in result.output
    assert "-L/--dereference" in result.output


def test_configmap_defaults_of_claim_options_are_not_refused(tmp_path: Path) -> None:
    # Past the argument checks: it fails on the missing file, before any API call.
    result = CliRunner().invoke(stage_cli.stage, ["--configmap", "r", "--timeout", "60", f"{tmp_path}/nope"])
    assert result.exit_code == 1
    assert f"SRC {tmp_path}/nope does not exist" in result.output


# ---------------------------------------------------------------------- against a real API server


def stage(control_plane: ControlPlane, *args: str) -> Result:
    return CliRunner().invoke(stage_cli.stage, ["--kubeconfig", str(control_plane.kubeconfig), *args])


@pytest.fixture
def core(control_plane: ControlPlane) -> Iterator[Any]:
    from kubernetes import client

    with control_plane.api_client() as api:
        yield client.CoreV1Api(api)


def read(core: Any, namespace: str, name: str) -> dict[str, Any]:
    response = core.read_namespaced_config_map(name, namespace, _preload_content=False)
    body: dict[str, Any] = json.loads(response.data)
    return body


@pytest.mark.controlplane
def test_creates_then_replaces_the_configmap(
    control_plane: ControlPlane, namespace: str, core: Any, files: Path
) -> None:
    result = stage(control_plane, "-n", namespace, "--configmap", "rewards", str(files), f"{files}/my_rewards.py:r.py")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"grpo stage: staged 4 files (917 B) into ConfigMap rewards in namespace {namespace} (created)\n"
    )
    assert "grpo stage: prompts.jsonl  40 B\n" in result.output
    assert "grpo stage: table.bin  771 B  (binaryData)\n" in result.output
    got = read(core, namespace, "rewards")
    assert got["metadata"]["labels"] == cm.LABELS
    assert set(got["data"]) == {"my_rewards.py", "prompts.jsonl", "r.py"}
    assert got["data"]["prompts.jsonl"] == (files / "prompts.jsonl").read_text(encoding="utf-8")
    assert base64.b64decode(got["binaryData"]["table.bin"]) == BINARY  # exact bytes back

    (files / "prompts.jsonl").write_text('{"prompt": "3+3="}\n')
    result = stage(control_plane, "-n", namespace, "--configmap", "rewards", "-q", f"{files}/prompts.jsonl")
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"grpo stage: staged 1 file (19 B) into ConfigMap rewards in namespace {namespace} (replaced)\n"
    )
    got = read(core, namespace, "rewards")
    assert got["data"] == {"prompts.jsonl": '{"prompt": "3+3="}\n'}  # the other keys are gone
    assert "binaryData" not in got


@pytest.mark.controlplane
def test_refuses_a_foreign_configmap_unless_forced(
    control_plane: ControlPlane, namespace: str, core: Any, files: Path
) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "theirs", "labels": {"team": "a"}},
        "data": {"keep.txt": "mine"},
    }
    core.create_namespaced_config_map(namespace, foreign)
    result = stage(control_plane, "-n", namespace, "--configmap", "theirs", f"{files}/prompts.jsonl")
    assert result.exit_code == 1
    assert f"ConfigMap theirs in namespace {namespace} exists and was not made by grpo stage" in result.output
    assert "delete it" in result.output and "choose another name" in result.output
    assert read(core, namespace, "theirs")["data"] == {"keep.txt": "mine"}

    result = stage(control_plane, "-n", namespace, "--configmap", "theirs", "--force", f"{files}/prompts.jsonl")
    assert result.exit_code == 0, result.output
    assert "(replaced)" in result.output
    got = read(core, namespace, "theirs")
    assert set(got["data"]) == {"prompts.jsonl"}
    assert got["metadata"]["labels"] == {"team": "a", **cm.LABELS}


@pytest.mark.controlplane
def test_refuses_too_much_data_before_sending(
    control_plane: ControlPlane, namespace: str, core: Any, tmp_path: Path
) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(b"\x00\xff" * 400_000)  # 800 kB: 1,066,668 bytes once base64-encoded
    result = stage(control_plane, "-n", namespace, "--configmap", "big", str(big))
    assert result.exit_code == 1
    assert "the files come to 1,066,675 bytes" in result.output and "--claim" in result.output
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("big", namespace)
    assert exc.value.status == 404


@pytest.mark.controlplane
def test_names_a_missing_namespace(control_plane: ControlPlane, files: Path) -> None:
    result = stage(control_plane, "-n", "no-such-ns", "--configmap", "rewards", f"{files}/prompts.jsonl")
    assert result.exit_code == 1
    assert "cannot create ConfigMap rewards in namespace no-such-ns: namespace no-such-ns not found" in result.output


@pytest.mark.controlplane
def test_a_link_out_of_the_folder_is_refused_and_only_sent_with_dereference(
    control_plane: ControlPlane, namespace: str, core: Any, files: Path, secret: Path
) -> None:
    (files / "notes.txt").symlink_to(secret)
    result = stage(control_plane, "-n", namespace, "--configmap", "leaky", str(files))
    assert result.exit_code == 1
    assert f"{files}/notes.txt is a symbolic link to {secret}" in result.output and "-L" in result.output
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("leaky", namespace)
    assert exc.value.status == 404

    result = stage(control_plane, "-n", namespace, "--configmap", "leaky", "-L", str(files))
    assert result.exit_code == 0, result.output
    assert read(core, namespace, "leaky")["data"]["notes.txt"] == secret.read_text()
