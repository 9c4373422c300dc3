"""GenerationService in-process (real transformers engine) and the adapter registry's rules."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest

from grpo_api.models import ServerSpec
from grpo_api.protocol import ActiveAdapter, SetAdapterRequest
from grpo_server.engines.base import AdapterHandle
from grpo_server.registry import AdapterRegistry, LoadedAdapter, ModelNotFound
from grpo_server.service import GenerationService
from grpo_server.settings import ServerSettings
from tests.server.adapters import LoraMaker


def loaded(version: int) -> LoadedAdapter:
    info = ActiveAdapter(name=f"policy-v{version}", version=version, path=f"/a/v{version}",
                         loaded_at=dt.datetime.now(dt.UTC))
    return LoadedAdapter(handle=AdapterHandle(info.name, version, info.path), info=info, digest=None)


def version_of(registry: AdapterRegistry, model: str | None) -> int | None:
    adapter = registry.resolve(model)
    return adapter.version if adapter is not None else None


def test_registry_resolves_served_name_versions_and_base():
    registry = AdapterRegistry("m", max_loaded=2)
    assert registry.resolve(None) is None and registry.resolve("m") is None
    registry.add(loaded(1))
    registry.activate(1)
    assert version_of(registry, "m") == version_of(registry, None) == version_of(registry, "policy-v1") == 1
    assert registry.resolve("m:base") is None
    with pytest.raises(ModelNotFound):
        registry.resolve("policy-v2")
    with pytest.raises(ModelNotFound):
        registry.resolve("other")


def test_registry_never_evicts_the_active_or_a_leased_version():
    registry = AdapterRegistry("m", max_loaded=1)
    for v in (1, 2, 3):
        registry.add(loaded(v))
    registry.activate(3)
    with registry.lease("policy-v1") as lease:
        assert lease.version == 1
        assert [a.version for a in registry.evictable()] == [2]
        registry.forget(2)
        assert registry.evictable() == []  # v1 is leased, v3 active: over the limit until v1 is released
    assert [a.version for a in registry.evictable()] == [1]


def test_registry_lease_pins_the_version_active_at_admission():
    registry = AdapterRegistry("m", max_loaded=4)
    registry.add(loaded(1))
    registry.activate(1)
    with registry.lease(None) as lease:
        registry.add(loaded(2))
        registry.activate(2)
        assert lease.version == 1
    assert version_of(registry, None) == 2


def test_concurrent_triggers_wait_for_each_other_and_never_interleave(tiny_model_dir: Path, tmp_path: Path):
    root = tmp_path / "adapters"
    root.mkdir()
    settings = ServerSettings(
        served_model_name="tiny", model_dir=tiny_model_dir, adapter_root=root, progress_file=tmp_path / "p.json",
        token="t", engine="transformers", server=ServerSpec.model_validate({"maxLoraRank": 8}),
        host="127.0.0.1", port=0, max_body_bytes=1 << 20, run_name="t",
    )
    maker = LoraMaker(tiny_model_dir)
    published = [maker.publish(root, v, seed=v) for v in (1, 2, 3)]

    async def scenario() -> tuple[list[int], int]:
        service = GenerationService(settings, engine_kind="transformers")
        await service.start()
        assert service.engine is not None
        real_add = service.engine.add_adapter
        running, peak = 0, 0

        async def slow_add(handle: AdapterHandle) -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.3)  # widen the window in which a second trigger could interleave
            await real_add(handle)
            running -= 1

        service.engine.add_adapter = slow_add  # type: ignore[method-assign,assignment]
        answers = await asyncio.gather(*(
            service.set_adapter(SetAdapterRequest(path=str(path), version=v, sha256=digest))
            for v, (path, digest) in zip((1, 2, 3), published, strict=True)
        ))
        await service.shutdown()
        return [a.adapter.version for a in answers], peak

    versions, peak = asyncio.run(scenario())
    assert versions == [1, 2, 3]
    assert peak == 1


def test_the_transformers_path_never_imports_vllm():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from grpo_server.engines import choose_engine\n"
        "import grpo_server.app, grpo_server.service, grpo_server.engines.transformers_engine\n"
        "assert choose_engine('transformers') == 'transformers'\n"
        "print('vllm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_vllm_engine_without_vllm_or_a_gpu_says_which_is_missing_and_names_the_field(tmp_path: Path):
    """`grpo serve --engine vllm` where it cannot run stops before the engine starts, saying why in a line a
    person can act on (the GPU image's smoke test sees the same without a GPU: hack/gpu-image-smoke.sh)."""
    import importlib.util

    from grpo_server.engines import EngineUnavailable, create_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    refusal = r"^spec.server.engine vllm: this image has no vLLM .* engine transformers"
    with pytest.raises(EngineUnavailable, match=refusal):
        create_engine("vllm", tmp_path, "m", ServerSpec(), tokenizer=None)  # type: ignore[arg-type]


def test_where_the_vllm_engine_loads_adapters_is_gpu_unless_the_env_says_host_and_nothing_else_is_taken():
    from grpo_server.settings import ENV_ADAPTER_LOADS, adapter_loads_from

    assert adapter_loads_from(None) == adapter_loads_from("") == adapter_loads_from(" GPU ") == "gpu"
    assert adapter_loads_from("host") == "host"
    with pytest.raises(ValueError, match=rf"^\${ENV_ADAPTER_LOADS}='disk' must be one of gpu, host$"):
        adapter_loads_from("disk")


def test_the_vllm_engine_loads_pushed_weights_in_place_unless_the_env_says_layerwise():
    from grpo_server.settings import ENV_WEIGHT_LOADS, ServerSettings, weight_loads_from

    assert weight_loads_from(None) == weight_loads_from(" ") == weight_loads_from("In-Place") == "in-place"
    assert weight_loads_from("layerwise") == "layerwise"
    assert ServerSettings.__dataclass_fields__["weight_loads"].default == "in-place"
    with pytest.raises(ValueError, match=rf"^\${ENV_WEIGHT_LOADS}='inplace' must be one of in-place, layerwise$"):
        weight_loads_from("inplace")


def test_the_vllm_engine_hands_logprobs_compactly_unless_the_env_says_vllm():
    from grpo_server.settings import ENV_LOGPROB_TRANSPORT, ServerSettings, logprob_transport_from

    assert logprob_transport_from(None) == logprob_transport_from("") == "compact"
    assert logprob_transport_from(" Compact ") == "compact"
    assert logprob_transport_from("vllm") == "vllm"
    assert ServerSettings.__dataclass_fields__["logprob_transport"].default == "compact"
    with pytest.raises(ValueError, match=rf"^\${ENV_LOGPROB_TRANSPORT}='lists' must be one of compact, vllm$"):
        logprob_transport_from("lists")
