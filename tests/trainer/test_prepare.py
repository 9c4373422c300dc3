"""`grpo prepare`: inline rewards, hf:// fetches through the real huggingface_hub against a fake hub, the
source checks, and the output protocol the operator reads."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import Result

from grpo_api.models import GRPORun
from grpo_api.prepare_protocol import (
    ENV_TERMINATION_LOG,
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    MAX_PROGRESS_CHARS,
    PrepareEvent,
    format_event,
    latest_event,
    latest_progress,
    parse_event,
)
from grpo_api.runconfig import RunConfig, RunConfigError, load_run_config, run_config_for
from grpo_api.sources import (
    DATASET_TOKEN_ENV,
    MODEL_TOKEN_ENV,
    HubFetch,
    ResolvedSources,
    hub_snapshot_dir,
    local_sources,
)
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.hub import selected_files
from grpo_trainer.prepare.inline_rewards import write_inline_rewards
from grpo_trainer.prepare.reporting import FetchProgress, Reporter
from tests.fixtures.hub import FakeHub, repo_files, running_hub, sharded_dataset_files
from tests.fixtures.prepare_cli import invoke, spec_with, write_config

TOKEN = "hf_secret_TOKEN_0123456789"

@pytest.fixture(autouse=True)
def online_to_the_fake_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """hack/test.sh sets HF_HUB_OFFLINE=1 for the whole suite (nothing may reach the real hub); these
    tests reach only the local fake hub, so the library is online here, as in an initializer pod."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with running_hub() as fake:
        yield fake


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])




# ------------------------------------------------------------------------------------------------ helpers


def events(result: Result) -> list[PrepareEvent]:
    parsed = [parse_event(line) for line in result.stdout.splitlines()]
    return [e for e in parsed if e is not None]


def final(result: Result) -> PrepareEvent:
    event = latest_event(result.stdout)
    assert event is not None and event.kind in ("done", "failed"), result.stdout
    return event


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(path))
    return path


def hub_run_file(tmp_path: Path, endpoint: str, dataset: Path, *, repo: str = "org/tiny", revision: str = "main",
                 token: bool = True, patterns: dict[str, list[str]] | None = None) -> Path:
    """A GRPORun file whose model is hf://REPO@REV on the fake hub (`grpo run`'s way: local_sources); `patterns`:
    its hub's allowPatterns and ignorePatterns."""
    hub_access: dict[str, Any] = {"endpoint": endpoint, **(patterns or {})}
    if token:
        hub_access["tokenSecretRef"] = {"name": "hf", "key": "token"}
    run = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": "prep"},
        "spec": {
            "model": {"name": "tiny", "source": f"hf://{repo}@{revision}", "hub": hub_access},
            "dataset": {"path": str(dataset)},
            "rewards": [{"function": "exact_match"}],
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def local_sources_of(run_file: Path) -> ResolvedSources:
    """Where `grpo run` puts the run's hf:// sources (its volume root is .grpo/NAME beside the run file)."""
    run = GRPORun.model_validate(yaml.safe_load(run_file.read_text()))
    return local_sources(run.spec, run_file.parent / ".grpo" / run.metadata.name)


def local_model_dir(run_file: Path) -> Path:
    """The model directory the run's server and trainer read: the folder of the commit its initializer fetched."""
    return load_run_config(run_file).model_dir()


def commit_dir(run_file: Path, commit: str) -> Path:
    """The folder of one commit of the run's hf:// model."""
    (fetch,) = local_sources_of(run_file).fetches
    return Path(hub_snapshot_dir(fetch.local_dir, commit))


def unique_module() -> str:
    return f"prep_rewards_{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------------- hub fetch


def test_fetch_lands_byte_identical_with_the_token_sent_and_never_printed(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    local = local_model_dir(run_file)
    fetched = {k: v for k, v in repo_files(local).items() if not k.startswith(".cache/")}
    assert fetched == repo_files(tiny_model_dir)
    assert hub.requests and all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)
    outputs = result.stdout + result.stderr + termination_log.read_text()
    assert TOKEN not in outputs
    done = final(result)
    assert done.kind == "done"
    assert done.message == (f"sources ready: model {local}, dataset {tiny_dataset} (64 prompts), 1 reward function")
    assert latest_progress(termination_log.read_text()) == done.message
    progress = [e.message for e in events(result) if e.kind == "progress"]
    assert all(len(m) <= MAX_PROGRESS_CHARS for m in progress)
    assert any(m.startswith("spec.model.source hf://org/tiny@main: 6/6 files,") for m in progress), progress
    # Every line on stdout is a protocol line: the operator's parser sees everything.
    assert all(parse_event(line) for line in result.stdout.splitlines())


def test_a_second_prepare_downloads_nothing_again(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)
    assert invoke(run_file).exit_code == 0
    assert len(hub.file_gets()) == 6
    hub.requests.clear()

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    assert hub.file_requests() == []  # neither HEAD nor GET of a file
    assert [r.method for r in hub.api_requests()] == ["GET"]  # one repo_info


def test_an_interrupted_fetch_is_transient_and_the_next_run_fetches_only_what_is_missing(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = hub.add("org/tiny", repo_files(tiny_model_dir))
    hub.fail_get["model.safetensors"] = 1
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)
    local = commit_dir(run_file, repo.commit)
    others = [name for name in repo_files(tiny_model_dir) if name != "model.safetensors"]
    # the 500 comes once the other files are complete, as on a hub that fails the largest file late
    hub.fail_when = lambda: all((local / name).is_file() for name in others)

    first = invoke(run_file)

    assert first.exit_code == EXIT_TRANSIENT, first.output
    failed = final(first)
    assert failed.kind == "failed" and failed.permanent is False
    assert failed.message == (f"spec.model.source hf://org/tiny@main: model.safetensors: the endpoint is busy or "
                              f"failing at {hub.url} (HTTP 500)")
    assert json.loads(termination_log.read_text()) == {"grpoPrepare": "failed", "message": failed.message,
                                                       "permanent": False}
    missing = {name for name in repo_files(tiny_model_dir) if not (local / name).is_file()}
    assert missing == {"model.safetensors"}  # the others were kept
    assert not list(local.rglob("*.incomplete"))
    hub.requests.clear()

    second = invoke(run_file)

    assert second.exit_code == 0, second.output
    assert set(hub.file_gets()) == missing
    assert len(hub.file_gets()) == len(missing)
    assert {k: v for k, v in repo_files(local).items() if not k.startswith(".cache/")} == repo_files(tiny_model_dir)


def test_a_connection_dropped_mid_file_is_resumed_within_the_run(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    hub.drop_get["model.safetensors"] = 1
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    assert hub.file_gets().count("model.safetensors") == 2
    local = local_model_dir(run_file)
    assert (local / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


def test_an_unknown_repository_is_permanent_naming_field_and_endpoint(
    hub: FakeHub, tiny_dataset: Path, tmp_path: Path, termination_log: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset, repo="org/nope", revision="v1")

    result = invoke(run_file)

    assert result.exit_code == EXIT_PERMANENT, result.output
    failed = final(result)
    assert failed.permanent is True
    assert failed.message == f"spec.model.source hf://org/nope@v1: repository not found at {hub.url} (HTTP 404)"
    assert latest_progress(termination_log.read_text()) == failed.message
    assert TOKEN not in result.output


def test_an_unknown_revision_is_permanent(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    result = invoke(hub_run_file(tmp_path, hub.url, tiny_dataset, revision="no-such-branch", token=False))
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert "hf://org/tiny@no-such-branch: revision not found" in final(result).message
    assert all(r.authorization is None for r in hub.requests)  # a mirror never gets the ambient hub login


@pytest.mark.parametrize(
    ("status", "code", "message", "exit_code", "reason"),
    [
        (500, None, None, EXIT_TRANSIENT, "the endpoint is busy or failing"),
        (503, None, None, EXIT_TRANSIENT, "the endpoint is busy or failing"),
        (429, None, None, EXIT_TRANSIENT, "the endpoint is busy or failing"),
        (403, None, "Forbidden", EXIT_PERMANENT, "access denied"),
        (403, "GatedRepo", "Access to model org/tiny is restricted", EXIT_PERMANENT, "gated repository"),
        (401, None, "Invalid credentials in Authorization header", EXIT_PERMANENT, "access denied"),
        (401, "RepoNotFound", None, EXIT_PERMANENT, "repository not found, or private"),
        (400, None, "Invalid rev id", EXIT_PERMANENT, "request refused"),
    ],
)
def test_api_errors_are_classified(
    hub: FakeHub, tiny_dataset: Path, tmp_path: Path, termination_log: Path, monkeypatch: pytest.MonkeyPatch,
    status: int, code: str | None, message: str | None, exit_code: int, reason: str,
) -> None:
    hub.api_status, hub.api_error_code, hub.api_error_message = status, code, message
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    result = invoke(hub_run_file(tmp_path, hub.url, tiny_dataset))
    assert result.exit_code == exit_code, result.output
    failed = final(result)
    assert failed.permanent is (exit_code == EXIT_PERMANENT)
    assert failed.message.startswith(f"spec.model.source hf://org/tiny@main: {reason}")
    assert failed.message.endswith(f"at {hub.url} (HTTP {status})")


def test_an_unreachable_endpoint_is_transient(
    tiny_dataset: Path, tmp_path: Path, termination_log: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = invoke(hub_run_file(tmp_path, endpoint, tiny_dataset))
    assert result.exit_code == EXIT_TRANSIENT, result.output
    failed = final(result)
    assert failed.permanent is False
    assert failed.message.startswith("spec.model.source hf://org/tiny@main: cannot connect")
    assert endpoint in failed.message


def test_an_empty_token_is_a_permanent_error_naming_the_secret(
    hub: FakeHub, tiny_dataset: Path, tmp_path: Path, termination_log: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MODEL_TOKEN_ENV, raising=False)
    result = invoke(hub_run_file(tmp_path, hub.url, tiny_dataset))
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message.startswith("spec.model.hub.tokenSecretRef: the token is empty")
    assert hub.requests == []


def test_a_complete_earlier_fetch_is_used_when_the_hub_is_unreachable(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)
    assert invoke(run_file).exit_code == 0
    hub.api_status = 503

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    assert any("hub unreachable; using the complete copy fetched before" in e.message for e in events(result))
    assert final(result).kind == "done"
    # Another endpoint is another source: the copy fetched from this one does not stand in for it.
    other = invoke(hub_run_file(tmp_path, f"http://127.0.0.1:{closed_port()}", tiny_dataset))
    assert other.exit_code == EXIT_TRANSIENT, other.output


def test_a_listed_file_outside_the_repository_is_refused(
    hub: FakeHub, tiny_dataset: Path, tmp_path: Path, termination_log: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", {"config.json": b"{}", "../../escape.txt": b"x"})
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    result = invoke(hub_run_file(tmp_path, hub.url, tiny_dataset))
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert "lists a file outside the repository: '../../escape.txt'" in final(result).message
    assert hub.file_requests() == []


def claim_run_config(tmp_path: Path, name: str, endpoint: str, dataset: Path) -> Path:
    """The run-config of run NAME whose model is hf://org/tiny@main, on a volume every such run shares (a claim)."""
    run = GRPORun.model_validate({"metadata": {"name": name}, "spec": {
        "model": {"name": "tiny", "source": "hf://org/tiny@main",
                  "hub": {"endpoint": endpoint, "tokenSecretRef": {"name": "hf", "key": "token"}}},
        "dataset": {"path": str(dataset)},
        "rewards": [{"function": "exact_match"}],
    }})
    volume = tmp_path / "claim"
    cfg = run_config_for(run, volume_root=volume, server_url="http://127.0.0.1:1", token_file=None,
                         base_dir=tmp_path, sources=local_sources(run.spec, volume))
    path = tmp_path / f"{name}-run-config.yaml"
    path.write_text(cfg.to_yaml())
    return path


def file_states(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    """Each file's bytes, inode and modification time: a file replaced in place changes one of them."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_moved_branch_is_fetched_into_a_folder_of_its_own_and_a_run_reading_the_old_commit_sees_no_change(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs of one claim name hf://org/tiny@main; main moves between their initializers. The second run's
    fetch, interrupted and then complete, changes nothing in the files the first run's server and trainer read
    (or will read when they restart): each run reads the commit its own initializer fetched."""
    files = repo_files(tiny_model_dir)
    old_commit = hub.add("org/tiny", files).commit
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    first, second = (claim_run_config(tmp_path, name, hub.url, tiny_dataset) for name in ("first", "second"))
    assert invoke(first).exit_code == 0
    first_dir = load_run_config(first).model_dir()
    assert first_dir.name == old_commit
    before = file_states(first_dir)
    config = json.loads(files["config.json"])
    config["max_position_embeddings"] = config["max_position_embeddings"] * 2
    moved = {**files, "config.json": json.dumps(config).encode()}
    new_commit = hub.add("org/tiny", moved).commit  # main now points at a new commit
    hub.fail_get["config.json"] = 1

    assert invoke(second).exit_code == EXIT_TRANSIENT
    assert file_states(first_dir) == before
    assert invoke(second).exit_code == 0

    second_dir = load_run_config(second).model_dir()
    assert (second_dir.name, second_dir.parent) == (new_commit, first_dir.parent)
    assert (second_dir / "config.json").read_bytes() == moved["config.json"]
    assert file_states(first_dir) == before
    assert load_run_config(first).model_dir() == first_dir  # a restarted server or trainer of the first run


def test_a_run_whose_initializer_has_not_fetched_its_hub_model_is_refused_naming_the_source(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run does not read another run's commit of the same source: without its own record it stops, naming it."""
    hub.add("org/tiny", repo_files(tiny_model_dir))
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    first, second = (claim_run_config(tmp_path, name, hub.url, tiny_dataset) for name in ("first", "second"))
    assert invoke(first).exit_code == 0

    with pytest.raises(RunConfigError, match=r"^spec\.model\.source hf://org/tiny@main: the initializer has not "):
        load_run_config(second).model_dir()


def test_a_folder_of_the_old_layout_is_never_taken_for_a_fetched_copy_and_is_left_as_it_was(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Releases before the hub folders were escaped fetched hf://org/tiny@main into hub/models/org/tiny/main, with a
    record of a complete copy in it. That folder is not this source's (no new folder lies in an old one): while the
    hub is unreachable it does not stand in for a fetch, and fetching the source leaves it as it was."""
    files = repo_files(tiny_model_dir)
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_config = claim_run_config(tmp_path, "first", hub.url, tiny_dataset)
    old = tmp_path / "claim" / "hub" / "models" / "org" / "tiny" / "main"
    for name, content in files.items():
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        (old / name).write_bytes(content)
    (old / ".cache").mkdir()
    (old / ".cache" / "grpo-fetch.json").write_text(json.dumps(
        {"repoId": "org/tiny", "repoType": "model", "revision": "main", "commit": "a" * 40, "files": sorted(files)}))
    before = file_states(old)
    hub.add("org/tiny", files)
    hub.api_status = 503

    unreachable = invoke(run_config)

    assert unreachable.exit_code == EXIT_TRANSIENT, unreachable.output
    assert "the endpoint is busy or failing" in final(unreachable).message
    hub.api_status = None
    assert invoke(run_config).exit_code == 0
    model_dir = load_run_config(run_config).model_dir()
    assert old not in model_dir.parents and model_dir.parents[2] == old.parents[2]  # hub/models/<new folder>
    assert file_states(old) == before


def test_hub_sources_whose_paths_collided_are_fetched_into_folders_of_their_own(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hf://org/tiny@main and hf://org@tiny/main (both were hub/models/org/tiny/main), two runs of one volume
    (here `grpo run`'s .grpo/prep): each gets its own files, and fetching the second leaves the first's folder as
    it was."""
    first, second = ("org/tiny", "main"), ("org", "tiny/main")
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    files = repo_files(tiny_model_dir)
    config = json.loads(files["config.json"])
    config["max_position_embeddings"] = config["max_position_embeddings"] * 2
    other_files = {**files, "config.json": json.dumps(config).encode()}
    for (repo_id, revision), content in ((first, files), (second, other_files)):
        hub.add(repo_id, content).branches = (revision,)
    run_files = []
    for name, (repo_id, revision) in (("a", first), ("b", second)):
        run_file = hub_run_file(tmp_path, hub.url, tiny_dataset, repo=repo_id, revision=revision)
        run_files.append(run_file.rename(tmp_path / f"run-{name}.yaml"))  # one run name: one volume root

    assert invoke(run_files[0]).exit_code == 0
    first_dir = local_model_dir(run_files[0])
    before = repo_files(first_dir)
    result = invoke(run_files[1])

    assert result.exit_code == 0, result.output
    second_dir = local_model_dir(run_files[1])
    assert first_dir != second_dir and first_dir.parents[2] == second_dir.parents[2]  # hub/models/<source>/snapshots
    assert repo_files(first_dir) == before
    assert (first_dir / "config.json").read_bytes() == files["config.json"]
    assert (second_dir / "config.json").read_bytes() == other_files["config.json"]


def test_a_dataset_repository_is_fetched_and_checked(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/prompts", {"data/train.jsonl": tiny_dataset.read_bytes(), "README.md": b"# prompts\n"},
            repo_type="dataset")
    monkeypatch.setenv(DATASET_TOKEN_ENV, TOKEN)
    run = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": "prep"},
        "spec": {
            "model": {"name": "tiny", "path": str(tiny_model_dir)},
            "dataset": {"source": "hf://org/prompts@main", "path": "data/train.jsonl",
                        "hub": {"endpoint": hub.url, "tokenSecretRef": {"name": "hf", "key": "token"}}},
            "rewards": [{"function": "exact_match"}],
        },
    }
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run))

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    local = load_run_config(run_file).dataset_path()
    assert "/.grpo/prep/hub/datasets/org--prompts@main-" in str(local)
    assert local.parts[-4] == "snapshots" and local.parts[-3] == hub.repos[("dataset", "org/prompts")].commit
    assert local.read_bytes() == tiny_dataset.read_bytes()
    assert sorted(hub.file_gets()) == ["README.md", "data/train.jsonl"]
    assert all(r.path.startswith(("/api/datasets/org/prompts/", "/datasets/org/prompts/resolve/"))
               for r in hub.requests)
    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)
    assert final(result).message.endswith(f"dataset {local} (64 prompts), 1 reward function")


# ------------------------------------------------------------------------------- hub data by name (issue 31)


def model_fetch(**patterns: Any) -> HubFetch:
    run = GRPORun.model_validate({"metadata": {"name": "r"}, "spec": {
        "model": {"name": "m", "source": "hf://org/m@main", **({"hub": patterns} if patterns else {})},
        "dataset": {"path": "/d.jsonl"}, "rewards": [{"function": "exact_match"}]}})
    (fetch,) = local_sources(run.spec, Path("/v")).fetches
    return fetch


TRANSFORMERS_FOLDER = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                       "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                       "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                       "tokenizer.model", "chat_template.jinja"]
OTHER_FORMATS = ["pytorch_model.bin", "model.onnx", "onnx/model_quantized.onnx", "model.gguf", "flax_model.msgpack",
                 "tf_model.h5", "original/consolidated.00.pth", "README.md", ".gitattributes", "LICENSE"]


def test_a_hub_model_fetches_its_weights_config_and_tokenizer_by_default() -> None:
    assert selected_files(model_fetch(), TRANSFORMERS_FOLDER + OTHER_FORMATS) == TRANSFORMERS_FOLDER


def test_a_hub_model_without_safetensors_fetches_its_pytorch_weights() -> None:
    names = ["config.json", "pytorch_model.bin", "tokenizer.json", "model.onnx"]
    assert selected_files(model_fetch(), names) == ["config.json", "pytorch_model.bin", "tokenizer.json"]
    # the fallback is the default's: patterns the spec names are taken as they are
    assert selected_files(model_fetch(allowPatterns=["*.json"], ignorePatterns=["tokenizer*"]),
                          ["config.json", "tokenizer.json"]) == ["config.json"]


def test_allow_and_ignore_patterns_select_as_snapshot_download_does() -> None:
    fetch = model_fetch(allowPatterns=["*.safetensors", "*.json", "onnx/"], ignorePatterns=["*quantized*"])
    assert selected_files(fetch, TRANSFORMERS_FOLDER + OTHER_FORMATS) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "vocab.json"]


@pytest.mark.parametrize(("patterns", "why"), [
    ({"allowPatterns": ["*.json", "*.txt"]}, "select no weight file (*.safetensors, *.bin) of the repository's 3, "
                                             "e.g. model-00001-of-00002.safetensors"),
    ({"ignorePatterns": ["model*"]}, "select no weight file"),
    ({"allowPatterns": ["weights/*"]}, "select none of the repository's 22 files"),
])
def test_patterns_that_leave_out_every_weight_file_are_refused_naming_the_fields_and_the_source(
    patterns: dict[str, list[str]], why: str,
) -> None:
    with pytest.raises(PrepareFailed) as failed:
        selected_files(model_fetch(**patterns), TRANSFORMERS_FOLDER + OTHER_FORMATS)
    assert failed.value.permanent
    assert str(failed.value).startswith("spec.model.hub.allowPatterns/ignorePatterns: hf://org/m@main: the patterns ")
    assert why in str(failed.value)


def test_a_hub_model_fetch_skips_what_is_not_weights_config_or_tokenizer_and_the_model_loads(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    model_files = repo_files(tiny_model_dir)
    hub.add("org/tiny", {**model_files, "model.onnx": b"\0" * (4 << 20), "pytorch_model.bin": b"\1" * (4 << 20),
                         "README.md": b"# tiny\n"})
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)
    run_file = hub_run_file(tmp_path, hub.url, tiny_dataset)

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    assert sorted(hub.file_gets()) == sorted(model_files)
    assert not [r for r in hub.file_requests() if r.path.endswith(("model.onnx", "pytorch_model.bin", "README.md"))]
    model_dir = local_model_dir(run_file)
    assert sorted(p.name for p in model_dir.iterdir() if p.is_file()) == sorted(model_files)
    AutoModelForCausalLM.from_pretrained(str(model_dir))  # a transformers model folder, whole


def test_hub_patterns_that_leave_out_every_weight_file_fail_the_prepare_for_good_before_any_download(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/tiny", repo_files(tiny_model_dir))
    monkeypatch.setenv(MODEL_TOKEN_ENV, TOKEN)

    result = invoke(hub_run_file(tmp_path, hub.url, tiny_dataset, patterns={"ignorePatterns": ["*.safetensors"]}))

    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message.startswith("spec.model.hub.allowPatterns/ignorePatterns: hf://org/tiny@main: the "
                                            "patterns select no weight file")
    assert hub.file_gets() == []


def test_a_dataset_repository_fetched_by_config_and_split_loads_the_rows_load_dataset_loads(
    hub: FakeHub, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    from datasets import load_dataset

    from grpo_trainer.data import read_dataset

    rows = [json.loads(line) for line in tiny_dataset.read_text().splitlines()]
    files = sharded_dataset_files({"main": {"train": rows, "test": rows[:8]},
                                   "socratic": {"train": [{**r, "prompt": "Think. " + r["prompt"]} for r in rows]}})
    hub.add("openai/gsm8k", {**files, "images/big.bin": b"\0" * (1 << 20)}, repo_type="dataset")
    run = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": "prep"},
        "spec": {
            "model": {"name": "tiny", "path": str(tiny_model_dir)},
            "dataset": {"source": "hf://openai/gsm8k", "config": "socratic", "split": "train",
                        "hub": {"endpoint": hub.url, "ignorePatterns": ["images/"]}},
            "rewards": [{"function": "exact_match"}],
        },
    }
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run))

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    assert sorted(hub.file_gets()) == sorted(files)
    cfg = load_run_config(run_file)
    local = cfg.dataset_path()
    assert local.parts[-2] == "snapshots" and local.parts[-1] == hub.repos[("dataset", "openai/gsm8k")].commit
    same_files = tmp_path / "same-files"
    for name, data in files.items():
        (same_files / name).parent.mkdir(parents=True, exist_ok=True)
        (same_files / name).write_bytes(data)
    expected = load_dataset(str(same_files), "socratic", split="train", cache_dir=str(tmp_path / "cache"))
    assert read_dataset(local, cfg.spec.dataset).to_list() == expected.to_list()
    assert final(result).message.endswith(f"dataset {local} ({len(rows)} prompts), 1 reward function")

    # a split the config lacks fails for good, naming the field and the source
    run["spec"]["dataset"]["split"] = "test"
    run_file.write_text(yaml.safe_dump(run))
    result = invoke(run_file)
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message.startswith("spec.dataset.split: hf://openai/gsm8k (")
    assert "has no split 'test' in config 'socratic'; splits: train" in final(result).message


def test_progress_is_throttled_but_every_finished_file_is_reported() -> None:
    now = [0.0]
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.extend(text.splitlines())

        def flush(self) -> None:
            pass

    progress = FetchProgress("spec.model.source hf://o/m@main", {"a": 2048, "b": 1024 * 1024}, Reporter(out=Out()),
                             clock=lambda: now[0])
    bar = progress.bar("b")(total=1024 * 1024, initial=0, desc="b")
    for _ in range(11):  # one update a second, at 0..10 s
        bar.update(1024)
        now[0] += 1.0
    assert len(lines) == 2  # at 5 s and 10 s, not at each update
    progress.finish("a")
    assert latest_progress("\n".join(lines)) == "spec.model.source hf://o/m@main: 1/2 files, 13.0 KiB / 1.0 MiB"


# -------------------------------------------------------------------------------------------------- checks


def test_a_good_setup_is_ready(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    config = write_config(tmp_path, spec_with(), ResolvedSources(model_dir=str(tiny_model_dir),
                                                                   dataset_path=str(tiny_dataset)))
    result = invoke(config)
    assert result.exit_code == 0, result.output
    done = final(result)
    assert done.message == (f"sources ready: model {tiny_model_dir}, dataset {tiny_dataset} (64 prompts), "
                            "1 reward function")
    assert json.loads(termination_log.read_text()) == {"grpoPrepare": "done", "message": done.message}
    assert [e.message for e in events(result)][:3] == [
        f"checking the model in {tiny_model_dir}",
        f"checking the dataset {tiny_dataset}",
        "checking 1 reward function(s)",
    ]


def test_a_model_without_config_json_is_permanent_naming_spec_model(
    tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    config = write_config(tmp_path, spec_with(), ResolvedSources(model_dir=str(empty), dataset_path=str(tiny_dataset)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    failed = final(result)
    assert failed.permanent is True
    assert failed.message.startswith("spec.model.source pvc://models/tiny: ")
    assert "no config.json" in failed.message
    assert latest_progress(termination_log.read_text()) == failed.message


def test_a_tokenizer_that_does_not_load_is_permanent(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    config = write_config(tmp_path, spec_with(), ResolvedSources(model_dir=str(broken), dataset_path=str(tiny_dataset)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    message = final(result).message
    assert message.startswith(f"spec.model.source pvc://models/tiny: the tokenizer in {broken}"), message


def test_an_empty_dataset_is_permanent_and_called_empty(
    tiny_model_dir: Path, tmp_path: Path, termination_log: Path,
) -> None:
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    config = write_config(tmp_path, spec_with(), ResolvedSources(model_dir=str(tiny_model_dir),
                                                                   dataset_path=str(empty)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message == f"spec.dataset: {empty} is empty: no rows to train on"
    assert latest_progress(termination_log.read_text()) == final(result).message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "spec.dataset: {path} line 3: not valid JSON: "),
        ('["a", "list"]', "spec.dataset: {path} line 3: expected a JSON object, got list"),
        ('{"question": "where is the prompt?"}',
         "spec.dataset.promptField: {path} line 3 has no field 'prompt'; its fields: question"),
        ('{"prompt": 42}', "spec.dataset.promptField: {path} line 3: prompt must be a string or a list of "
                           "{{role, content}} messages, got int"),
    ],
    ids=["not json", "not an object", "no prompt field", "prompt not text"],
)
def test_a_broken_dataset_line_is_permanent_naming_the_file_and_line(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path, line: str, expected: str,
) -> None:
    rows = tiny_dataset.read_text().splitlines()
    broken = tmp_path / "prompts.jsonl"
    broken.write_text("\n".join([*rows[:2], line, *rows[2:]]) + "\n")
    config = write_config(tmp_path, spec_with(), ResolvedSources(model_dir=str(tiny_model_dir),
                                                                   dataset_path=str(broken)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    failed = final(result)
    assert failed.permanent is True
    assert failed.message.startswith(expected.format(path=broken)), failed.message


def test_a_dataset_without_the_named_prompt_column_is_permanent_naming_the_field(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    spec = {**spec_with(), "dataset": {"source": "pvc://data/prompts", "path": "prompts.jsonl",
                                       "promptField": "question"}}
    config = write_config(tmp_path, spec, ResolvedSources(model_dir=str(tiny_model_dir),
                                                           dataset_path=str(tiny_dataset)))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message == (f"spec.dataset.promptField: {tiny_dataset} line 1 has no field 'question'; "
                                     "its fields: prompt, answer")


def test_a_missing_reward_module_is_permanent_naming_it(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    module = unique_module()
    rewards_dir = tmp_path / "rewards"
    rewards_dir.mkdir()
    config = write_config(tmp_path, spec_with([{"function": f"{module}:score"}]),
                          ResolvedSources(model_dir=str(tiny_model_dir), dataset_path=str(tiny_dataset),
                                          reward_paths=[str(rewards_dir)]))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    message = final(result).message
    assert message.startswith(f"spec.rewards[0].function '{module}:score': cannot import module {module!r}: no "
                              f"such module in {rewards_dir}, ")
    assert message.endswith(" or the installed packages")


def test_a_missing_reward_function_is_permanent_naming_it(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    module = unique_module()
    rewards_dir = tmp_path / "rewards"
    rewards_dir.mkdir()
    (rewards_dir / f"{module}.py").write_text("def other(completions, **kw):\n    return [0.0] * len(completions)\n")
    config = write_config(tmp_path, spec_with([{"function": "exact_match"}, {"function": f"{module}:score"}]),
                          ResolvedSources(model_dir=str(tiny_model_dir), dataset_path=str(tiny_dataset),
                                          reward_paths=[str(rewards_dir)]))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message == (f"spec.rewards[1].function '{module}:score': module {module!r} "
                                     f"({rewards_dir / module}.py) has no callable 'score'; its functions: other")


def test_a_reward_module_that_fails_to_import_is_permanent_naming_its_file_and_line(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    module = unique_module()
    rewards_dir = tmp_path / "rewards"
    rewards_dir.mkdir()
    (rewards_dir / f"{module}.py").write_text("import math\n\nWEIGHTS = {'a': 1}['b']\n")
    config = write_config(tmp_path, spec_with([{"function": f"{module}:score"}]),
                          ResolvedSources(model_dir=str(tiny_model_dir), dataset_path=str(tiny_dataset),
                                          reward_paths=[str(rewards_dir)]))
    result = invoke(config)
    assert result.exit_code == EXIT_PERMANENT, result.output
    assert final(result).message == (f"spec.rewards[0].function '{module}:score': cannot import module {module!r}: "
                                     f"KeyError: 'b' ({rewards_dir / module}.py line 3)")
    assert latest_progress(termination_log.read_text()) == final(result).message


def test_inline_reward_modules_are_written_and_importable(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, termination_log: Path,
) -> None:
    module = unique_module()
    source = "def score(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    run = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": "prep"},
        "spec": {
            "model": {"name": "tiny", "path": str(tiny_model_dir)},
            "dataset": {"path": str(tiny_dataset)},
            "rewards": [{"function": "exact_match"}, {"function": f"{module}:score", "weight": 0.5}],
            "rewardCode": {"inline": {f"{module}.py": source}},
        },
    }
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run))

    result = invoke(run_file)

    assert result.exit_code == 0, result.output
    written = tmp_path / ".grpo" / "prep" / "rewards" / f"{module}.py"
    assert written.read_text() == source
    assert [p.name for p in written.parent.iterdir() if p.name != "__pycache__"] == [written.name]  # no temp left
    assert final(result).message.endswith("2 reward functions")


def test_an_inline_name_that_is_not_a_module_file_is_refused(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate(yaml.safe_load(write_config(
        tmp_path, spec_with(), ResolvedSources(inline_rewards_dir=str(tmp_path / "rewards"))).read_text()))
    from grpo_api.models import RewardCodeSpec

    for name in ("../evil.py", "sub/mod.py", "mod.txt"):
        code = RewardCodeSpec.model_construct(source=None, path=None, inline={name: "x = 1\n"})
        bad = cfg.model_copy(update={"spec": cfg.spec.model_copy(update={"reward_code": code})})
        with pytest.raises(PrepareFailed, match=r"spec\.rewardCode\.inline: .* is not a module file name") as info:
            write_inline_rewards(bad, Reporter())
        assert info.value.permanent
    assert not (tmp_path / "evil.py").exists()
    assert not (tmp_path / "rewards").exists()


def test_a_bad_config_file_is_permanent(tmp_path: Path, termination_log: Path) -> None:
    result = invoke(tmp_path / "missing.yaml")
    assert result.exit_code == EXIT_PERMANENT
    assert final(result).message.endswith("missing.yaml: file not found")
    assert termination_log.is_file()


# ------------------------------------------------------------------------------------------------ protocol


def test_latest_progress_reads_the_last_protocol_line_and_ignores_the_rest() -> None:
    log = "\n".join([
        "Downloading...",
        format_event("progress", "first"),
        '{"not": "ours"}',
        format_event("progress", "second"),
        "{broken json",
        "[1, 2]",
        '{"grpoPrepare": "progress", "message": 3}',
        '{"grpoPrepare": "other", "message": "x"}',
        "WARNING something",
    ])
    assert latest_progress(log) == "second"
    assert latest_progress(log + "\n" + format_event("failed", "boom", permanent=True)) == "boom"
    assert latest_progress(format_event("done", "ready") + "\n") == "ready"
    assert latest_progress("") is None
    assert latest_progress("plain\ntext\n") is None


def test_events_carry_permanence_and_progress_is_clipped() -> None:
    assert parse_event(format_event("failed", "x", permanent=False)) == PrepareEvent("failed", "x", False)
    assert parse_event(format_event("failed", "x", permanent=True)) == PrepareEvent("failed", "x", True)
    assert parse_event(format_event("done", "ok")) == PrepareEvent("done", "ok", None)
    long = format_event("progress", "a\nb " + "x" * 500)
    event = parse_event(long)
    assert event is not None and len(event.message) == MAX_PROGRESS_CHARS and "\n" not in event.message
    assert json.loads(long) == {"grpoPrepare": "progress", "message": event.message}
