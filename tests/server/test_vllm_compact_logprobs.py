"""The compact logprob transport (engines/vllm_compact_logprobs.py) against vLLM 0.26's own, through vLLM's real
engine-core output classes, msgpack encoder and decoder and output processor, on the CPU.

vLLM is not installed in CI's environment, where these are skipped: the GPU server image's smoke test
(hack/gpu-image-smoke.sh, run by CI whenever the image's inputs change) runs the same self-check with the image's
vLLM, and on the development machine `PYTHONPATH=<vllm 0.26 unpacked> pytest tests/server/test_vllm_compact_logprobs.py`
runs these."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (the GPU server image's smoke test runs the check)")

from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder

from grpo_server.engines import vllm_compact_logprobs as compact


@pytest.fixture(autouse=True)
def _vllm_as_shipped(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(compact.ENV_ENGINE_SIDE, raising=False)
    yield
    compact._restore()


def test_the_compact_transport_gives_every_request_vllm_s_own_logprobs_ranks_and_cumulative_logprob() -> None:
    cases = [(64, 6, 0, 1), (8, 5, 3, 1), (8, 4, 1, 3)]  # requests, steps, top-k, tokens per step (speculative)
    expected = [compact.run_outputs(*case, seed=7, slice_request=LogprobsLists.slice_request) for case in cases]

    assert compact.enable()

    assert MsgpackDecoder._decode_ndarray is compact._decode_rows
    assert os.environ[compact.ENV_ENGINE_SIDE] == str(os.getpid())
    assert LogprobsLists.slice_request is not compact._slice_rows  # the server's own process keeps vLLM's
    for case, want in zip(cases, expected, strict=True):
        assert compact.run_outputs(*case, seed=7, slice_request=compact._slice_rows) == want
        assert compact.run_outputs(*case, seed=7, slice_request=LogprobsLists.slice_request) == want
    tokens, logprobs, ranks, cumulative = expected[0][0]
    assert len(tokens) == len(logprobs) == len(ranks) == 6 and cumulative == pytest.approx(sum(logprobs))


def test_an_engine_side_that_differs_from_vllm_s_is_caught_at_start_and_nothing_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = compact._slice_rows

    def off_by_one(lists, req_idx, num_positions):  # the neighbouring request's rows
        return original(lists, (req_idx + 1) % (len(lists.sampled_token_ranks) // num_positions), num_positions)

    monkeypatch.setattr(compact, "_slice_rows", off_by_one)

    assert not compact.enable()

    assert MsgpackDecoder._decode_ndarray is compact._originals["decode_ndarray"]
    assert compact.ENV_ENGINE_SIDE not in os.environ


def test_another_vllm_release_keeps_vllm_s_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compact.vllm, "__version__", "0.27.0")

    assert not compact.enable()
    assert compact.ENV_ENGINE_SIDE not in os.environ
    assert "decode_ndarray" not in compact._originals or \
        MsgpackDecoder._decode_ndarray is compact._originals["decode_ndarray"]


PLUGIN = """
import os, sys
from vllm.v1.outputs import LogprobsLists
from grpo_server.engines import vllm_compact_logprobs as compact
compact.engine_plugin()
print(LogprobsLists.slice_request is compact._slice_rows)
"""


@pytest.mark.parametrize(("server", "patched"), [("parent", True), ("self", False), ("", False), ("x1", False)])
def test_the_engine_plugin_acts_only_in_a_process_the_asking_server_started(server: str, patched: bool) -> None:
    """vLLM loads the plugin in the server's own process too, where an engine core without multiprocessing would
    hand rows to the front end undecoded: only another process (the engine core) takes the rows."""
    env = dict(os.environ)
    env.pop(compact.ENV_ENGINE_SIDE, None)
    code = PLUGIN
    if server == "parent":
        env[compact.ENV_ENGINE_SIDE] = str(os.getpid())
    elif server == "self":
        code = f"import os; os.environ[{compact.ENV_ENGINE_SIDE!r}] = str(os.getpid())\n" + PLUGIN
    elif server:
        env[compact.ENV_ENGINE_SIDE] = server
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(patched)
