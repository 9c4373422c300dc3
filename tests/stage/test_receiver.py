"""The receiver program, run as the staging pod runs it (its command and environment from the pod
manifest, python3 -c), fed tar streams on stdin, with a temporary directory standing for /stage."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from grpo_stage import manifests as m
from grpo_stage.paths import Mapping
from grpo_stage.receiver import TRAILER
from grpo_stage.sources import collect
from grpo_stage.tarstream import trailer_bytes, write_tar


class Buffer:
    def __init__(self) -> None:
        self.data = io.BytesIO()

    def write(self, data: bytes) -> int:
        return self.data.write(data)


def pod_env() -> dict[str, str]:
    pod = m.build_pod(
        name="grpo-stage-t", namespace="ns", claim="c", image="i", image_pull_policy="Never", lifetime_seconds=60
    )
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def run_receiver(
    root: Path,
    dests: list[str],
    data: bytes,
    stage_id: str = "ab12cd34",
    close_stdin: bool = True,
    data_filter: bool = True,
) -> subprocess.CompletedProcess[str]:
    """The exec's command, with the claim's mount point replaced by root.

    close_stdin=False keeps stdin open after the stream, as the exec's may stay: the stream's own
    end must end the receiver. data_filter=False runs it as on a Python without tarfile.data_filter
    (before 3.11.4/3.12, e.g. Debian 12's 3.11.2): its own checks must suffice.
    """
    command = m.receiver_command(stage_id, dests, root=str(root))
    assert command[:2] == ["python3", "-c"]
    program = command[2] if data_filter else "import tarfile; tarfile.__dict__.pop('data_filter', None); " + command[2]
    # -S: no site-packages, only the standard library, as in whatever image the pod runs.
    args = [sys.executable, "-S", "-c", program, *command[3:]]
    env = {"PATH": os.environ.get("PATH", ""), **pod_env()}
    if close_stdin:
        done = subprocess.run(args, input=data, capture_output=True, env=env, timeout=30, check=False)
        return subprocess.CompletedProcess(args, done.returncode, done.stdout.decode(), done.stderr.decode())
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
        proc.wait(timeout=30)
        return subprocess.CompletedProcess(
            args, proc.returncode, proc.stdout.read().decode(), proc.stderr.read().decode()
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()


def stream_of(mappings: list[Mapping]) -> tuple[bytes, dict[str, dict[str, object]]]:
    sink = Buffer()
    digests = write_tar(collect(mappings), sink)
    return sink.data.getvalue(), {name: d.to_json() for name, d in digests.items()}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def raw_stream(members: list[tuple[tarfile.TarInfo, bytes | None]], trailer: dict[str, object] | None) -> bytes:
    """A hand-made stream (names and types the builder would never write)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        if trailer is not None:
            body = json.dumps(trailer).encode()
            info = tarfile.TarInfo(TRAILER)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def digest_of(data: bytes) -> dict[str, object]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ------------------------------------------------------------------------------------------ the good path


@pytest.mark.parametrize("data_filter", [True, False], ids=["data_filter", "own-checks-only"])
def test_receiver_writes_the_files_and_prints_their_manifest(
    model_dir: Path, dataset_file: Path, tmp_path: Path, data_filter: bool
) -> None:
    root = tmp_path / "stage"
    root.mkdir()
    mappings = [Mapping(model_dir, "models/my-model"), Mapping(dataset_file, "datasets/prompts.jsonl")]
    data, sent = stream_of(mappings)

    result = run_receiver(root, [mp.dest for mp in mappings], data, close_stdin=False, data_filter=data_filter)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == sent
    assert tree(root) == {
        "models/my-model/config.json": (model_dir / "config.json").read_bytes(),
        "models/my-model/model.safetensors": (model_dir / "model.safetensors").read_bytes(),
        "models/my-model/run.sh": (model_dir / "run.sh").read_bytes(),
        "models/my-model/tokenizer/tokenizer.json": (model_dir / "tokenizer" / "tokenizer.json").read_bytes(),
        "datasets/prompts.jsonl": dataset_file.read_bytes(),
    }
    assert (root / "models/my-model/empty").is_dir()
    assert os.access(root / "models/my-model/run.sh", os.X_OK)
    assert not os.access(root / "models/my-model/config.json", os.X_OK)
    # The staging directory is gone; the manifest as the client compares it matches.
    assert sorted(p.name for p in root.iterdir()) == ["datasets", "models"]
    digests = write_tar(collect(mappings), Buffer())
    assert m.compare_manifest(digests, result.stdout) == []


def test_receiver_replaces_an_existing_dest_whole(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "stage"
    old = root / "models" / "my-model"
    (old / "tokenizer").mkdir(parents=True)
    (old / "config.json").write_text("old")
    (old / "stale-shard.safetensors").write_text("old shard")
    (root / "models" / "other").mkdir()
    (root / "models" / "other" / "keep.txt").write_text("untouched")

    data, _ = stream_of([Mapping(model_dir, "models/my-model")])
    result = run_receiver(root, ["models/my-model"], data)

    assert result.returncode == 0, result.stderr
    assert not (old / "stale-shard.safetensors").exists()  # the old copy went away whole
    assert (old / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert (root / "models" / "other" / "keep.txt").read_text() == "untouched"
    assert not [p for p in root.iterdir() if p.name.startswith(".grpo-stage-")]


def test_receiver_replaces_a_file_dest(dataset_file: Path, tmp_path: Path) -> None:
    root = tmp_path / "stage"
    (root / "datasets").mkdir(parents=True)
    (root / "datasets" / "prompts.jsonl").write_text("old prompts\n")
    data, _ = stream_of([Mapping(dataset_file, "datasets/prompts.jsonl")])
    result = run_receiver(root, ["datasets/prompts.jsonl"], data)
    assert result.returncode == 0, result.stderr
    assert (root / "datasets" / "prompts.jsonl").read_bytes() == dataset_file.read_bytes()


# ------------------------------------------------------------------------------------------ refusals


@pytest.fixture
def stage_root(tmp_path: Path) -> Path:
    root = tmp_path / "stage"
    (root / "models" / "m").mkdir(parents=True)
    (root / "models" / "m" / "config.json").write_text("old")
    return root


def assert_untouched(root: Path) -> None:
    assert tree(root) == {"models/m/config.json": b"old"}
    assert not [p for p in root.iterdir() if p.name.startswith(".grpo-stage-")]


@pytest.mark.parametrize("data_filter", [True, False], ids=["data_filter", "own-checks-only"])
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("/etc/evil", "is not a relative path"),
        ("models/m/../../evil", "'..' part"),
        ("../evil", "'..' part"),
        ("models/other/x", "is not under a destination"),
    ],
)
def test_receiver_refuses_names_outside_the_destinations(
    stage_root: Path, tmp_path: Path, name: str, message: str, data_filter: bool
) -> None:
    data = b"evil"
    stream = raw_stream([file_member(name, data)], {name: digest_of(data)})
    result = run_receiver(stage_root, ["models/m"], stream, data_filter=data_filter)
    assert result.returncode == 2
    assert "refused" in result.stderr and message in result.stderr, result.stderr
    assert_untouched(stage_root)
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()


def test_receiver_refuses_links(stage_root: Path) -> None:
    link = tarfile.TarInfo("models/m/link")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    result = run_receiver(stage_root, ["models/m"], raw_stream([(link, None)], {}))
    assert result.returncode == 2
    assert "neither a regular file nor a directory" in result.stderr
    assert_untouched(stage_root)


def member_offsets(data: bytes) -> dict[str, int]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return {member.name: member.offset for member in tar}


@pytest.mark.parametrize("where", ["before the trailer", "inside a file"])
def test_receiver_installs_nothing_from_a_stream_cut_short(model_dir: Path, stage_root: Path, where: str) -> None:
    data, _ = stream_of([Mapping(model_dir, "models/m")])
    offsets = member_offsets(data)
    # At a member boundary, tarfile alone would take the cut stream for a whole archive.
    cut = offsets[TRAILER] if where == "before the trailer" else offsets["models/m/model.safetensors"] + 100_000
    result = run_receiver(stage_root, ["models/m"], data[:cut])
    assert result.returncode != 0
    assert "ended before its trailer" in result.stderr or "failed" in result.stderr, result.stderr
    assert_untouched(stage_root)


def test_receiver_installs_nothing_when_the_checksums_differ(stage_root: Path) -> None:
    data = b"new config"
    wrong = {"models/m/config.json": {"size": len(data), "sha256": "0" * 64}}
    result = run_receiver(stage_root, ["models/m"], raw_stream([file_member("models/m/config.json", data)], wrong))
    assert result.returncode == 2
    assert "differ from what was sent" in result.stderr
    assert_untouched(stage_root)


def test_receiver_refuses_a_stream_without_trailer(stage_root: Path) -> None:
    data = b"new config"
    result = run_receiver(stage_root, ["models/m"], raw_stream([file_member("models/m/config.json", data)], None))
    assert result.returncode == 2
    assert "ended before its trailer" in result.stderr
    assert_untouched(stage_root)


def test_receiver_refuses_bad_destinations(stage_root: Path) -> None:
    empty = raw_stream([], {})
    for dests in (["/abs"], ["models/../x"], ["models", "models/m"], [".grpo-stage-x"]):
        result = run_receiver(stage_root, dests, empty)
        assert result.returncode == 2, dests
        assert "refused" in result.stderr
    assert_untouched(stage_root)


def test_receiver_names_what_the_stream_lacked(stage_root: Path) -> None:
    data = b"x"
    stream = raw_stream([file_member("models/m/a", data)], {"models/m/a": digest_of(data)})
    result = run_receiver(stage_root, ["models/m", "datasets/p.jsonl"], stream)
    assert result.returncode == 2
    assert "nothing for destination 'datasets/p.jsonl'" in result.stderr
    assert_untouched(stage_root)


def test_receiver_refuses_a_dest_under_a_file_before_installing_anything(stage_root: Path) -> None:
    (stage_root / "datasets").write_text("a file, not a directory")
    a, b = b"new config", b"prompts"
    stream = raw_stream(
        [file_member("models/m/config.json", a), file_member("datasets/p.jsonl", b)],
        {"models/m/config.json": digest_of(a), "datasets/p.jsonl": digest_of(b)},
    )
    result = run_receiver(stage_root, ["models/m", "datasets/p.jsonl"], stream)
    assert result.returncode == 2
    assert "datasets on the volume is not a directory: 'datasets/p.jsonl' cannot go under it" in result.stderr
    (stage_root / "datasets").unlink()
    assert_untouched(stage_root)  # models/m was not replaced either


def test_receiver_refuses_a_parent_that_leads_off_the_volume(stage_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (stage_root / "datasets").symlink_to(outside)
    data = b"prompts"
    stream = raw_stream([file_member("datasets/p.jsonl", data)], {"datasets/p.jsonl": digest_of(data)})
    result = run_receiver(stage_root, ["datasets/p.jsonl"], stream)
    assert result.returncode == 2
    assert "leads outside the volume" in result.stderr
    assert list(outside.iterdir()) == []


def test_trailer_bytes_are_what_the_receiver_compares() -> None:
    from grpo_stage.tarstream import FileDigest

    assert json.loads(trailer_bytes({"a": FileDigest(1, "ff")})) == {"a": {"size": 1, "sha256": "ff"}}
