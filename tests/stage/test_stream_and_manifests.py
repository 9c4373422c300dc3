"""The tar stream builder and the pure cluster-side parts: pod and claim manifests, pod states,
exec status and the manifest comparison."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from grpo_api.models import DEFAULT_TRAINER_IMAGE
from grpo_operator.builders import NON_ROOT_UID
from grpo_stage import manifests as m
from grpo_stage.errors import StageError
from grpo_stage.paths import Mapping
from grpo_stage.progress import Progress, human_bytes
from grpo_stage.receiver import TRAILER
from grpo_stage.sources import collect
from grpo_stage.tarstream import CHUNK, FileDigest, write_tar


class ChunkSink:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        assert isinstance(data, bytes)
        self.chunks.append(data)
        return len(data)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ tar stream


def test_stream_holds_exactly_the_files_under_dest_then_the_trailer(model_dir: Path, dataset_file: Path) -> None:
    entries = collect([Mapping(model_dir, "models/my-model"), Mapping(dataset_file, "datasets/prompts.jsonl")])
    sink = ChunkSink()
    seen: dict[str, int] = {}
    digests = write_tar(entries, sink, lambda name, n: seen.__setitem__(name, seen.get(name, 0) + n))

    files = {
        "models/my-model/config.json": model_dir / "config.json",
        "models/my-model/model.safetensors": model_dir / "model.safetensors",
        "models/my-model/run.sh": model_dir / "run.sh",
        "models/my-model/tokenizer/tokenizer.json": model_dir / "tokenizer" / "tokenizer.json",
        "datasets/prompts.jsonl": dataset_file,
    }
    assert digests == {name: FileDigest(path.stat().st_size, sha256(path)) for name, path in files.items()}
    assert seen == {name: path.stat().st_size for name, path in files.items()}

    # Chunked, never more than CHUNK per write, and padded to whole records (the receiver's reads end there).
    assert len(sink.chunks) > 3
    assert max(len(c) for c in sink.chunks) <= CHUNK
    assert len(sink.data) % tarfile.RECORDSIZE == 0

    with tarfile.open(fileobj=io.BytesIO(sink.data), mode="r|") as tar:
        members = []
        contents: dict[str, bytes] = {}
        for member in tar:
            members.append(member)
            if member.isreg():
                extracted = tar.extractfile(member)
                assert extracted is not None
                contents[member.name] = extracted.read()
    names = [mem.name for mem in members]
    assert names == [e.name for e in entries] + [TRAILER]
    for member in members[:-1]:
        assert member.isdir() or member.isreg()
        assert member.name.startswith(("models/my-model", "datasets/prompts.jsonl"))
        assert member.mode == (0o755 if member.isdir() or member.name.endswith("run.sh") else 0o644)
    for name, path in files.items():
        assert contents[name] == path.read_bytes()
    assert json.loads(contents[TRAILER]) == {name: d.to_json() for name, d in digests.items()}


def test_stream_of_a_file_that_changed_size_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "grows.bin"
    path.write_bytes(b"x" * 100)
    [listed] = collect([Mapping(path, "d/grows.bin")])
    with pytest.raises(StageError, match=r"grows\.bin changed size"):
        write_tar([dataclasses.replace(listed, size=50)], ChunkSink())
    with pytest.raises(StageError, match=r"grows\.bin: unexpected end of data"):
        write_tar([dataclasses.replace(listed, size=200)], ChunkSink())


@pytest.mark.parametrize("swap", ["link", "file"])
def test_stream_refuses_a_file_swapped_after_it_was_listed(model_dir: Path, tmp_path: Path, swap: str) -> None:
    secret = tmp_path / "id_ed25519"
    secret.write_bytes(b"PRIVATE KEY")
    entries = collect([Mapping(model_dir, "m")])
    replacement = tmp_path / "replacement"
    if swap == "link":  # listed as a regular file, a link to a file outside the folder when read
        replacement.symlink_to(secret)
        message = r"config\.json became a symbolic link \(to .*id_ed25519\) after it was listed: .*-L/--dereference"
    else:  # another file put in its place (its parent swapped for a link would read the same)
        replacement.write_bytes(b"PRIVATE KEY")
        message = r"config\.json is no longer the file that was listed"
    replacement.replace(model_dir / "config.json")  # made before the old one goes: not its inode
    sink = ChunkSink()
    with pytest.raises(StageError, match=message):
        write_tar(entries, sink)
    assert b"PRIVATE KEY" not in sink.data


def test_a_directory_swapped_for_a_link_while_it_is_listed_is_refused_and_nothing_beyond_it_is_read(
    model_dir: Path, tmp_path: Path, swap_for_link_when_read: Callable[[Path, Path], list[Path]],
) -> None:
    """tokenizer/ is listed as a directory, then swapped for a link to ~/.ssh before its files are listed: the walk
    must not list or send what the link leads to."""
    private = tmp_path / "home" / ".ssh"
    private.mkdir(parents=True)
    (private / "id_ed25519").write_bytes(b"PRIVATE KEY")
    swapped = swap_for_link_when_read(model_dir / "tokenizer", private)
    sink = ChunkSink()

    with pytest.raises(StageError, match=r"/my-model/tokenizer is no longer the directory that was listed \(swapped "
                                         r"for a symbolic link to .*/home/\.ssh\?\)"):
        write_tar(collect([Mapping(model_dir, "m")]), sink)

    assert swapped == [model_dir / "tokenizer"]
    assert b"PRIVATE KEY" not in sink.data


def test_stream_reads_nothing_through_a_directory_swapped_for_a_link_after_it_was_listed(
    model_dir: Path, tmp_path: Path,
) -> None:
    """After the listing, tokenizer/ becomes a link to a folder elsewhere that holds the very file listed (a hard
    link): the read goes through no link beneath the folder, so it is refused rather than read from there."""
    entries = collect([Mapping(model_dir, "m")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.link(model_dir / "tokenizer" / "tokenizer.json", elsewhere / "tokenizer.json")
    (model_dir / "tokenizer").rename(tmp_path / "tokenizer.moved")
    (model_dir / "tokenizer").symlink_to(elsewhere, target_is_directory=True)

    with pytest.raises(StageError, match=r"/my-model/tokenizer became a symbolic link \(to .*/elsewhere\) while "
                                         r"grpo stage ran: .*-L/--dereference"):
        write_tar(entries, ChunkSink())


def test_progress_lines_every_ten_percent() -> None:
    out = io.StringIO()
    ticks = iter(range(100))
    progress = Progress(1000, out, clock=lambda: float(next(ticks)))
    for _ in range(100):
        progress.advance("models/m/weights.bin", 10)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("grpo stage:  10%  100 B / 1000 B")
    assert lines[-1].startswith("grpo stage: 100%")
    assert all(line.endswith("models/m/weights.bin") for line in lines)
    quiet = Progress(1000, None)
    quiet.advance("x", 1000)
    assert quiet.done == 1000
    assert human_bytes(3 << 30) == "3.0 GiB"


# ------------------------------------------------------------------------------------------ manifests


def test_pod_manifest() -> None:
    pod = m.build_pod(
        name="grpo-stage-ab12cd34",
        namespace="team-a",
        claim="grpo-data",
        image="registry.local/grpo-trainer:0.1.0",
        image_pull_policy="IfNotPresent",
        lifetime_seconds=600,
    )
    assert pod["metadata"]["name"] == "grpo-stage-ab12cd34"
    assert pod["metadata"]["namespace"] == "team-a"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "grpo-stage"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["activeDeadlineSeconds"] > 600
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["volumes"] == [{"name": "claim", "persistentVolumeClaim": {"claimName": "grpo-data"}}]
    (container,) = spec["containers"]
    assert container["image"] == "registry.local/grpo-trainer:0.1.0"
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["volumeMounts"] == [{"name": "claim", "mountPath": "/stage"}]
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["command"][:2] == ["python3", "-c"]
    assert "time.sleep(600)" in container["command"][2]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {m.RECEIVER_ENV: m.receiver_source()}


def test_receiver_source_survives_the_env_var() -> None:
    source = m.receiver_source()
    assert "def main(" in source
    # Kubernetes expands $(VAR) and turns $$ into $ in env values: the source must hold no '$'.
    assert "$" not in source
    compile(source, "receiver", "exec")


def test_stage_uid_is_the_operators() -> None:
    assert m.STAGE_UID == NON_ROOT_UID


def test_default_image_is_the_trainers() -> None:
    from grpo_stage.cli import DEFAULT_IMAGE

    assert DEFAULT_TRAINER_IMAGE == DEFAULT_IMAGE


def test_receiver_command() -> None:
    assert m.receiver_command("ab12", ["models/m", "datasets/p.jsonl"]) == [
        "python3",
        "-c",
        m.BOOTSTRAP,
        "/stage",
        "ab12",
        "models/m",
        "datasets/p.jsonl",
    ]


def test_claim_manifest() -> None:
    claim = m.build_claim(
        name="grpo-data", namespace="team-a", size="10Gi", access_mode="ReadWriteOnce", storage_class=None
    )
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    claim = m.build_claim(
        name="grpo-data", namespace="team-a", size="1Ti", access_mode="ReadWriteMany", storage_class="nfs"
    )
    assert claim["spec"]["storageClassName"] == "nfs"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize(
    ("status", "running", "fatal", "reason"),
    [
        ({"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}, True, False, ""),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}
                ],
            },
            False,
            False,
            "Pending: ImagePullBackOff: Back-off pulling image",
        ),
        (
            {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "InvalidImageName"}}}]},
            False,
            True,
            "Pending: InvalidImageName",
        ),
        (
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": '0/3 nodes are available: persistentvolumeclaim "grpo-data" not found.',
                    }
                ],
            },
            False,
            False,
            'Pending: Unschedulable: 0/3 nodes are available: persistentvolumeclaim "grpo-data" not found.',
        ),
        (
            {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "state": {
                            "terminated": {
                                "exitCode": 128,
                                "reason": "StartError",
                                "message": 'exec: "python3": executable file not found in $PATH',
                            }
                        }
                    }
                ],
            },
            False,
            True,
            'Failed: the container ended with exit code 128 (StartError: exec: "python3": executable file not '
            "found in $PATH)",
        ),
        ({}, False, False, "Pending"),
    ],
)
def test_pod_state(status: dict, running: bool, fatal: bool, reason: str) -> None:
    assert m.pod_state({"status": status}) == m.PodState(running=running, fatal=fatal, reason=reason)


def test_exec_status() -> None:
    assert m.exec_status('{"metadata":{},"status":"Success"}') == (0, "")
    failure = {
        "metadata": {},
        "status": "Failure",
        "message": "command terminated with non-zero exit code: exit status 2",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "2"}]},
    }
    assert m.exec_status(json.dumps(failure)) == (2, failure["message"])
    assert m.exec_status("")[0] is None
    assert m.exec_status('{"status": "Failure", "message": "container not found"}') == (None, "container not found")
    assert m.exec_status("not json") == (None, "not json")


def test_compare_manifest() -> None:
    sent = {"a/x": FileDigest(3, "aa"), "a/y": FileDigest(4, "bb")}
    good = json.dumps({"a/x": {"size": 3, "sha256": "aa"}, "a/y": {"size": 4, "sha256": "bb"}})
    assert m.compare_manifest(sent, "some noise\n" + good + "\n") == []
    assert m.compare_manifest(sent, json.dumps({"a/x": {"size": 3, "sha256": "aa"}})) == ["a/y: missing on the claim"]
    bad = json.dumps(
        {"a/x": {"size": 2, "sha256": "aa"}, "a/y": {"size": 4, "sha256": "cc"}, "a/z": {"size": 1, "sha256": "d"}}
    )
    assert m.compare_manifest(sent, bad) == [
        "a/x: size on the claim 2, sent 3",
        "a/y: sha256 on the claim cc, sent bb",
        "a/z: on the claim but not sent",
    ]
    assert m.compare_manifest(sent, "") == ["the receiver printed no manifest"]
    assert "not JSON" in m.compare_manifest(sent, "{oops")[0]
