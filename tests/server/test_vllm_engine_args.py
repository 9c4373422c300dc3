"""The vllm engine's arguments, requests and start: it schedules what `vllm serve` would on the same GPU
(vllm_engine.USAGE_CONTEXT), asks vLLM for the sampler's logprobs only where the request asked for them, and
freezes its startup heap once up, as `vllm serve` does.

vLLM 0.26 sets a step's batch limits (sequences, tokens) by usage context and GPU; a context it has no defaults for
takes the generic 128 sequences and 2048 tokens, which halved the server's throughput on the H100 against
`LLM.generate` (BENCHMARKS.md, eighth lease). The GPU is the one an H100 node reports, stood in for the platform's
own query (no GPU here).
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (the GPU server image's smoke test imports the engine)")

from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext

from grpo_api.models import ServerSpec
from grpo_server.engines import vllm_engine
from grpo_server.engines.base import SamplingOptions

H100_BYTES = 80 * 1024**3


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(current_platform), "get_device_total_memory", classmethod(lambda cls, d=0: H100_BYTES))
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(type(current_platform), "get_device_name", classmethod(lambda cls, d=0: name))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)


def batch_defaults(context: UsageContext) -> tuple[int | None, int | None]:
    args = vllm_engine.engine_args(Path("/models/m"), "m", ServerSpec(), None)
    tokens, seqs = args.get_batch_defaults(world_size=1)
    return seqs.get(context), tokens.get(context)


def test_the_engine_is_built_in_vllm_serves_context(h100: None) -> None:
    assert vllm_engine.USAGE_CONTEXT is UsageContext.OPENAI_API_SERVER
    assert batch_defaults(vllm_engine.USAGE_CONTEXT) == (1024, 8192)


def test_the_default_context_has_no_batch_defaults(h100: None) -> None:
    """Why the context is named: AsyncLLM.from_engine_args' own default falls back to vLLM's generic limits."""
    assert batch_defaults(UsageContext.ENGINE_CONTEXT) == (None, None)


def test_extra_engine_args_set_the_limits() -> None:
    server = ServerSpec(extraEngineArgs={"max_num_seqs": 64, "max_num_batched_tokens": 4096})
    args = vllm_engine.engine_args(Path("/models/m"), "m", server, None)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (64, 4096)


@pytest.mark.parametrize(("asked", "top", "rescore", "expected"), [
    (True, 0, False, 0),      # GRPO's requests: the sampled token's logprob
    (True, 3, False, 3),      # and alternatives
    (False, 0, False, None),  # a request without logprobs: vLLM computes and hands over none
    (True, 0, True, None),    # logprobsSource auto: generated without, scored in a prefill pass
])
def test_the_sampler_gives_logprobs_only_where_asked(asked: bool, top: int, rescore: bool, expected: int | None):
    options = SamplingOptions(n=2, max_tokens=8, top_logprobs=top, logprobs=asked)
    assert vllm_engine.generation_params(options, rescore).logprobs == expected


def test_the_started_engine_freezes_the_startup_heap_as_vllm_serve_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm serve freezes its API server's heap once started (vLLM, torch and the tokenizer: the objects every full
    collection would walk again); this server's front end does the same once its engine is up. The engine itself is
    vLLM's `AsyncLLM`, which needs a GPU: stood in for by what `start` reads of it."""
    scheduler = SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=8192)
    built = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))
    monkeypatch.setattr(vllm_engine.AsyncLLM, "from_engine_args", lambda *a, **k: built)
    engine = vllm_engine.VllmEngine(Path("/models/m"), "m", ServerSpec(), None,  # type: ignore[arg-type]
                                    adapter_loads="host", logprob_transport="vllm")
    gc.unfreeze()
    try:
        asyncio.run(engine.start())
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
