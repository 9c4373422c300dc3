"""The export step (`grpo export`, spec.output) against real destinations: a folder on a claim, the CNCF
distribution registry (oci://), the Versity S3 gateway (s3://), and huggingface_hub's own client against a
local endpoint that records its requests (hf://: no hub is reachable here). The adapter is a real PEFT LoRA of
the tiny model; the merged form is checked to compute what the adapter on its base computes."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from grpo_api.adapters import build_manifest, write_manifest
from grpo_api.export_protocol import ENV_EXPORT_CLAIM_ROOT, ENV_EXPORT_TOKEN, ExportResult, parse_result
from grpo_api.runconfig import RunConfig, parse_grporun, run_config_for
from grpo_trainer.export.artifact import ExportError
from grpo_trainer.export.main import export, run_export
from tests.fixtures.object_stores import S3_ACCESS_KEY, S3_SECRET_KEY, oci_registry, s3_server  # noqa: F401
from tests.fixtures.run_specs import run_with


@pytest.fixture(scope="module")
def trained_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A volume whose adapter root holds v1 and v2 as the trainer publishes them (v2 the final one)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    volume = tmp_path_factory.mktemp("volume")
    root = volume / "adapters" / "run"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    for version in (1, 2):
        directory = root / f"v{version}"
        peft.save_pretrained(str(directory))
        write_manifest(directory, build_manifest(directory, version=version, step=2 * version,
                                                 base_model_fingerprint="tiny"))
    return volume


def config_for(volume: Path, model_dir: Path, output: dict[str, Any]) -> RunConfig:
    run = parse_grporun(run_with({"model": {"name": str(model_dir)}, "output": output}), "run.yaml")
    return run_config_for(run, volume_root=volume, server_url="http://127.0.0.1:1", token_file=None)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ pvc://


def test_adapter_goes_to_the_claim_whole_with_its_manifest_and_digest(
    trained_adapter: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_EXPORT_CLAIM_ROOT, str(tmp_path))
    cfg = config_for(trained_adapter, tiny_model_dir, {"destination": "pvc://results/team/run-1"})
    result = export(cfg)
    target = tmp_path / "team" / "run-1"
    final = trained_adapter / "adapters" / "run" / "v2"
    published = json.loads((final / "grpo-manifest.json").read_text())["files"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(published)
    assert sorted(p.name for p in target.iterdir()) == sorted([*published, "grpo-export.json"])
    manifest = json.loads((target / "grpo-export.json").read_text())
    assert manifest["source"] == "v2" and manifest["form"] == "adapter"
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256(target / name) == sha256(final / name)
    assert result.uri == "pvc://results/team/run-1"
    assert result.digest == "sha256:" + sha256(target / "grpo-export.json")
    assert result.size == sum(p.stat().st_size for p in target.iterdir())
    assert result.files == len(published) + 1
    assert result.source == str(final)
    # The same export again (a retried Job) succeeds; the adapters stay where they were.
    assert export(cfg) == result
    assert (final / "grpo-manifest.json").is_file()


def test_a_claim_folder_holding_something_else_is_not_overwritten(
    trained_adapter: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_EXPORT_CLAIM_ROOT, str(tmp_path))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="already exists and holds something else") as info:
        export(config_for(trained_adapter, tiny_model_dir, {"destination": "pvc://results/taken"}))
    assert info.value.permanent
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


def test_a_symbolic_link_on_the_claim_is_not_followed(
    trained_adapter: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim, outside = tmp_path / "claim", tmp_path / "outside"
    claim.mkdir()
    outside.mkdir()
    (claim / "escape").symlink_to(outside)
    monkeypatch.setenv(ENV_EXPORT_CLAIM_ROOT, str(claim))
    with pytest.raises(ExportError, match="symbolic link") as info:
        export(config_for(trained_adapter, tiny_model_dir, {"destination": "pvc://results/escape/run"}))
    assert info.value.permanent and list(outside.iterdir()) == []


def test_an_adapter_that_differs_from_its_manifest_is_not_exported(
    trained_adapter: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    volume = tmp_path / "volume"
    shutil.copytree(trained_adapter, volume)
    (volume / "adapters" / "run" / "v2" / "adapter_config.json").write_text("{}")
    monkeypatch.setenv(ENV_EXPORT_CLAIM_ROOT, str(tmp_path))
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("GRPO_TERMINATION_LOG", str(termination))
    cfg = config_for(volume, tiny_model_dir, {"destination": "pvc://results/out"})
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    assert run_export(tmp_path / "run.yaml") == 2
    assert "does not match its manifest" in termination.read_text()
    assert not (tmp_path / "out").exists()


def test_merged_model_computes_what_the_adapter_on_its_base_computes(
    trained_adapter: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv(ENV_EXPORT_CLAIM_ROOT, str(tmp_path))
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("GRPO_TERMINATION_LOG", str(termination))
    cfg = config_for(trained_adapter, tiny_model_dir, {"destination": "pvc://results/merged", "form": "merged"})
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    assert run_export(tmp_path / "run.yaml") == 0
    result = parse_result(termination.read_text())
    assert result is not None and result.form == "merged" and result.uri == "pvc://results/merged"
    target = tmp_path / "merged"
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "grpo-export.json"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(target))("hello world")["input_ids"]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, str(trained_adapter / "adapters" / "run" / "v2"))(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(target))(ids).logits
    assert not torch.allclose(plain, expected, atol=1e-4)  # the adapter changes something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ oci://


def test_adapter_is_pushed_as_an_oci_artifact_pinned_by_its_manifest_digest(
    trained_adapter: Path, tiny_model_dir: Path, oci_registry: str  # noqa: F811
) -> None:
    import httpx

    cfg = config_for(trained_adapter, tiny_model_dir,
                     {"destination": f"oci://{oci_registry}/grpo/adapter:v2", "plainHttp": True})
    result = export(cfg)
    digest = result.digest
    assert result.uri == f"oci://{oci_registry}/grpo/adapter@{digest}"
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    tagged = httpx.get(f"http://{oci_registry}/v2/grpo/adapter/manifests/v2", headers=accept)
    assert tagged.status_code == 200
    assert "sha256:" + hashlib.sha256(tagged.content).hexdigest() == digest
    manifest = tagged.json()
    final = trained_adapter / "adapters" / "run" / "v2"
    layers = {layer["annotations"]["org.opencontainers.image.title"]: layer for layer in manifest["layers"]}
    published = json.loads((final / "grpo-manifest.json").read_text())["files"]
    assert set(layers) == {*published, "grpo-export.json"}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert layers[name]["digest"] == "sha256:" + sha256(final / name)
        blob = httpx.get(f"http://{oci_registry}/v2/grpo/adapter/blobs/{layers[name]['digest']}",
                         follow_redirects=True)
        assert blob.content == (final / name).read_bytes()
    assert manifest["annotations"]["dev.grpo.form"] == "adapter"
    assert result.size == sum(layer["size"] for layer in manifest["layers"])


def test_an_unreachable_registry_is_a_transient_failure(
    trained_adapter: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import oras.provider  # first: it imports oras.decorator, which cannot be imported alone

    from tests.fixtures.object_stores import free_port

    # oras-py retries a request 5 times over about 2 minutes before it gives up: not here.
    monkeypatch.setattr(oras.provider.decorator.time, "sleep", lambda _: None)

    cfg = config_for(trained_adapter, tiny_model_dir,
                     {"destination": f"oci://127.0.0.1:{free_port()}/grpo/adapter", "plainHttp": True})
    with pytest.raises(ExportError, match="cannot be reached") as info:
        export(cfg)
    assert not info.value.permanent


# ------------------------------------------------------------------------------------------------- s3://


def _s3(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_ACCESS_KEY,
                        aws_secret_access_key=S3_SECRET_KEY, region_name="us-east-1")


def test_adapter_goes_to_an_s3_bucket_with_signed_requests(
    trained_adapter: Path, tiny_model_dir: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    client = _s3(s3_server)
    client.create_bucket(Bucket="results")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    cfg = config_for(trained_adapter, tiny_model_dir,
                     {"destination": "s3://results/adapters/run-1", "endpoint": s3_server, "region": "us-east-1"})
    result = export(cfg)
    assert result.uri == "s3://results/adapters/run-1"
    listed = client.list_objects_v2(Bucket="results", Prefix="adapters/run-1/")["Contents"]
    final = trained_adapter / "adapters" / "run" / "v2"
    keys = {o["Key"]: o["Size"] for o in listed}
    published = json.loads((final / "grpo-manifest.json").read_text())["files"]
    assert set(keys) == {f"adapters/run-1/{n}" for n in (*published, "grpo-export.json")}
    body = client.get_object(Bucket="results", Key="adapters/run-1/adapter_model.safetensors")["Body"].read()
    assert body == (final / "adapter_model.safetensors").read_bytes()
    manifest = client.get_object(Bucket="results", Key="adapters/run-1/grpo-export.json")["Body"].read()
    assert result.digest == "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert result.size == sum(keys.values())


def test_s3_refusing_the_credentials_is_a_permanent_failure(
    trained_adapter: Path, tiny_model_dir: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    _s3(s3_server).create_bucket(Bucket="locked")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    cfg = config_for(trained_adapter, tiny_model_dir, {"destination": "s3://locked/x", "endpoint": s3_server})
    with pytest.raises(ExportError, match=r"access denied \(SignatureDoesNotMatch\).*\(HTTP 403\)") as info:
        export(cfg)
    assert info.value.permanent
    assert _s3(s3_server).list_objects_v2(Bucket="locked").get("KeyCount") == 0


# ------------------------------------------------------------------------------------------------- hf://


class _Hub(BaseHTTPRequestHandler):
    """The Hub endpoints create_repo and create_commit call, recording each request."""

    requests: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []

    def _answer(self, body: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self.requests.append(("POST", self.path, dict(self.headers), body))
        if self.path == "/api/repos/create":
            created = json.loads(body)
            self._answer({"url": f"http://{self.headers['Host']}/{created['organization']}/{created['name']}"})
        elif self.path == "/api/validate-yaml":  # the model card's metadata (README.md)
            self._answer({"errors": [], "warnings": []})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                    for f in files]})
        elif "/commit/" in self.path:
            oid = "0123abcd" * 5
            self._answer({"commitUrl": f"http://{self.headers['Host']}/team/tiny-grpo/commit/{oid}", "commitOid": oid})
        else:
            self._answer({"error": "not here"}, 404)

    def do_GET(self) -> None:
        self.requests.append(("GET", self.path, dict(self.headers), b""))
        self._answer({"error": "not here"}, 404)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[tuple[str, list[tuple[str, str, dict[str, str], bytes]]]]:
    _Hub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Hub.requests
    server.shutdown()


def test_hf_push_is_one_commit_of_every_file_to_a_private_repository_with_the_token(
    trained_adapter: Path, tiny_model_dir: Path, hub: tuple[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, seen = hub
    monkeypatch.setenv(ENV_EXPORT_TOKEN, "hf_secret_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cfg = config_for(trained_adapter, tiny_model_dir,
                     {"destination": "hf://team/tiny-grpo", "credentialsSecret": "hub", "endpoint": endpoint})
    result = export(cfg)
    assert result.uri == "hf://team/tiny-grpo@" + "0123abcd" * 5
    assert all(headers.get("authorization") == "Bearer hf_secret_token"
               for _, _, headers, _ in seen), [(m, p) for m, p, _, _ in seen]
    create = next(json.loads(body) for _, path, _, body in seen if path == "/api/repos/create")
    assert create["organization"] == "team" and create["name"] == "tiny-grpo"
    assert create["visibility"] == "private" and create.get("type", "model") == "model"
    commit = next(body for _, path, _, body in seen if path == "/api/models/team/tiny-grpo/commit/main")
    lines = [json.loads(line) for line in commit.decode().splitlines()]
    assert lines[0]["key"] == "header"
    files = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines[1:]
             if line["key"] == "file"}
    final = trained_adapter / "adapters" / "run" / "v2"
    published = json.loads((final / "grpo-manifest.json").read_text())["files"]
    assert set(files) == {*published, "grpo-export.json"}
    assert files["adapter_model.safetensors"] == (final / "adapter_model.safetensors").read_bytes()
    assert "sha256:" + hashlib.sha256(files["grpo-export.json"]).hexdigest() == result.digest


def test_result_line_round_trips() -> None:
    result = ExportResult(uri="s3://b/p", form="adapter", digest="sha256:" + "0" * 64, size=3, files=1)
    assert parse_result("noise\n" + result.line() + "\n") == result
    assert parse_result("no result here") is None


def test_the_initializer_refuses_an_image_without_the_destinations_client(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import importlib.util

    from grpo_trainer import image_capabilities
    from grpo_trainer.errors import UnsupportedSetting

    spec = config_for(tmp_path, tiny_model_dir, {"destination": "s3://results/x"}).spec
    assert image_capabilities.export_client_missing(spec) is None  # this image has boto3
    real = importlib.util.find_spec
    monkeypatch.setattr(image_capabilities.importlib.util, "find_spec",
                        lambda name, *a: None if name == "boto3" else real(name, *a))
    with pytest.raises(UnsupportedSetting, match=r"destination s3:// needs the boto3 package"):
        image_capabilities.check_trainer_image(spec, "ipc")
    pvc = config_for(tmp_path, tiny_model_dir, {"destination": "pvc://results/x"}).spec
    assert image_capabilities.export_client_missing(pvc) is None
