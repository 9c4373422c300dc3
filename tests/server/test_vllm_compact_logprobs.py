"""The compact logprob transport (engines/vllm_compact_logprobs.py) against vLLM 0.26's own, through vLLM's real
engine-core output classes, msgpack encoder and decoder and output processor, on the CPU.

vLLM is not installed in CI's environment, where these are skipped: the GPU server image's smoke test
(hack/gpu-image-smoke.sh, run by CI whenever the image's inputs change) runs the same self-check with the image's
vLLM, and on the development machine `PYTHONPATH=<vllm 0.26 unpacked> pytest tests/server/test_vllm_compact_logprobs.py`
runs these."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (the GPU server image's smoke test runs the check)")

from types import SimpleNamespace

import numpy as np
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.logprobs import LogprobsProcessor
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
    assert LogprobsProcessor._update_sample_logprobs is compact._extend_rows
    assert os.environ[compact.ENV_ENGINE_SIDE] == str(os.getpid())
    # the server's own process keeps vLLM's engine side
    assert LogprobsLists.slice_request is not compact._slice_rows
    assert Scheduler.update_from_output is not compact._update_from_output_holding
    for case, want in zip(cases, expected, strict=True):
        # rows held until each request's last step (every other request ends a step early), and rows each step
        assert compact.run_outputs(*case, seed=7, slice_request=compact._slice_rows, hold=True) == want
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


def test_an_engine_side_that_loses_held_rows_is_caught_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    original = compact.hold_rows

    def loses_the_last_step(outputs, holds, held):
        for output in outputs:
            if output.finish_reason is not None:
                output.new_logprobs = None
        original(outputs, holds, held)

    monkeypatch.setattr(compact, "hold_rows", loses_the_last_step)

    assert not compact.enable()
    assert LogprobsProcessor._update_sample_logprobs is compact._originals["update_sample_logprobs"]


def step_output(request_id: str, token: int, finished: bool = False, wide: bool = False) -> EngineCoreOutput:
    """One token's output; `wide`: its step's batch asked for a top-1 alternative too, so its row has two columns."""
    rows = LogprobsLists([[token, 99] if wide else [token]], [[-0.5 * token, -9.0] if wide else [-0.5 * token]],
                         [token], None)
    return EngineCoreOutput(request_id=request_id, new_token_ids=[token], new_logprobs=rows,
                            finish_reason=FinishReason.LENGTH if finished else None)


def test_the_scheduler_holds_rows_only_of_final_only_top_k_requests_cut_to_their_width_and_forgets_aborted_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scheduler.update_from_output as the engine core's plugin replaces it: vLLM's method gives each step's outputs
    (here, three steps given in turn; in the second, another request of the batch asked for an alternative, so
    every row has two columns). The rows of a request that streams, has stop strings, or asks for all or chosen
    tokens' logprobs are never held back; held rows keep the columns their request reads."""
    final = RequestOutputKind.FINAL_ONLY
    kinds = {
        "final": SamplingParams(max_tokens=3, logprobs=0, output_kind=final),
        "stream": SamplingParams(max_tokens=3, logprobs=0, output_kind=RequestOutputKind.DELTA),
        "stop": SamplingParams(max_tokens=3, logprobs=0, output_kind=final, stop=["x"]),
        "all": SamplingParams(max_tokens=3, logprobs=-1, output_kind=final),
        "chosen": SamplingParams(max_tokens=3, logprob_token_ids=[5], output_kind=final),
        "aborted": SamplingParams(max_tokens=3, logprobs=0, output_kind=final),
    }
    passed_on = ("stream", "stop", "all", "chosen")
    scheduler = SimpleNamespace(requests={k: SimpleNamespace(sampling_params=p) for k, p in kinds.items()})
    steps = [
        [step_output(k, 1) for k in kinds],
        [step_output(k, 2, wide=True) for k in ("final", *passed_on)],
        [step_output(k, 3, finished=True) for k in ("final", *passed_on)],
    ]
    given = iter(steps)
    monkeypatch.setitem(compact._originals, "update_from_output",
                        lambda self, scheduler_output, runner_output: {0: EngineCoreOutputs(outputs=next(given))})
    monkeypatch.setattr(compact, "_held", {})

    sent, aborted_held = [], []
    for step in range(3):
        finished_before: set[str] = set()
        if step == 1:
            del scheduler.requests["aborted"]  # aborted by its client after its first step: no more outputs
        if step == 2:
            finished_before = {"aborted"}  # what the scheduler tells its workers to free at the next step
            for finished in ("final", *passed_on):
                del scheduler.requests[finished]  # vLLM frees a request in the step that finishes it
        scheduler_output = SimpleNamespace(finished_req_ids=finished_before)
        sent.append({o.request_id: o.new_logprobs for o in
                     compact._update_from_output_holding(scheduler, scheduler_output, None)[0].outputs})
        aborted_held.append("aborted" in compact._held)

    assert sent[0]["final"] is None and sent[1]["final"] is None
    final_rows = sent[2]["final"]  # vLLM's arrays, with vLLM's dtypes; the wide step's row cut to the one column
    assert final_rows.logprob_token_ids.dtype == np.int32 and final_rows.logprobs.dtype == np.float32
    assert final_rows.logprob_token_ids.tolist() == [[1], [2], [3]]
    assert final_rows.logprobs.tolist() == [[-0.5], [-1.0], [-1.5]]
    assert final_rows.sampled_token_ranks.tolist() == [1, 2, 3]
    for kept in passed_on:
        assert [s[kept].logprob_token_ids for s in sent] == [[[1]], [[2, 99]], [[3]]], kept
    assert sent[0]["aborted"] is None  # held, then its request went away: nothing of it is kept
    assert aborted_held == [True, True, False]
    assert compact._held == {}


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
from vllm.v1.core.sched.scheduler import Scheduler
compact.engine_plugin()
print(LogprobsLists.slice_request is compact._slice_rows,
      Scheduler.update_from_output is compact._update_from_output_holding)
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
    assert done.stdout.strip().splitlines()[-1] == f"{patched} {patched}"


@pytest.mark.parametrize("columns", [1, 3])
def test_held_rows_keep_no_object_a_position_for_the_garbage_collector_to_walk(columns: int) -> None:
    """The engine core holds a request's rows for as long as it runs: kept as a list per position (as `_slice_rows`
    gives them) they were half a million objects for the gen-weights workload, walked by every full collection
    pass. Held flat, a request keeps three lists whatever its length, and hands over vLLM's arrays."""
    width = columns + 1  # a step whose batch asked for one more alternative than this request
    held = compact.HeldRows(columns)
    for position in range(1000):
        step = LogprobsLists(np.full((4, width), position, dtype=np.int32), np.full((4, width), -0.5, np.float32),
                             np.arange(4, dtype=np.int32) + 1, None)
        held.add(compact._slice_rows(step, 2, 1))
    assert not any(gc.is_tracked(value) for value in (*held.token_ids, *held.logprobs, *held.ranks))
    rows = held.lists()
    assert rows.logprob_token_ids.shape == rows.logprobs.shape == (1000, columns)
    assert rows.logprob_token_ids[:, 0].tolist() == list(range(1000))
    assert rows.sampled_token_ranks.tolist() == [3] * 1000
