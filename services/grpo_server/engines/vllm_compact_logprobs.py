"""The sampled tokens' logprobs from vLLM's engine core to this server as msgpack's own lists
(`GRPO_SERVER_LOGPROB_TRANSPORT=compact`, the default), not three small numpy arrays per request per decoding step.

In vLLM 0.26 a step that returns logprobs costs the engine core, per request, three numpy views of the step's arrays
(`LogprobsLists.slice_request`) and three calls into vLLM's array encoder, and costs the server's front end three
calls into its ext and array decoders (`bench/vllm_logprobs_transport.py` measures each). On the H100, generation
with `logprobs=0` ran at 0.46x of plain in-process, its front end busy 100% of the time (BENCHMARKS.md); GRPO needs
the sampled token's logprob at every position.

`compact` replaces two of vLLM 0.26.0's methods with ones that give the same logprobs:

- engine core: `LogprobsLists.slice_request` converts the step's arrays to lists once per step and gives each
  request its rows as list slices, which msgpack encodes natively (`engine_plugin`, a `vllm.general_plugins` entry
  point, which vLLM loads in every process of the engine; it acts only in a process the server started after
  asking for it, `ENV_ENGINE_SIDE`, never in the server's own, where an engine core without multiprocessing would
  hand the rows to the front end undecoded);
- front end: `MsgpackDecoder._decode_ndarray` makes an array of rows (vLLM's own inline form,
  `[dtype, shape, data]`, begins with the dtype's string; rows never hold one), which vLLM's output processor reads
  as before.

`enable()`, in the server before the engine starts, first runs vLLM's own path and the compact one on the same
outputs (`self_check`: several requests, top-k and multi-token steps, through vLLM's encoder, decoder and output
processor) and turns nothing on unless every logprob, rank and cumulative logprob is equal. Where the engine core
does not load the entry point (the package not installed), its side stays vLLM's and the front end decodes it as
vLLM does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import vllm
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger("grpo_server.engines.vllm_compact_logprobs")

#: The vLLM releases whose internals these replacements were written against (and checked by self_check).
SUPPORTED_VLLM = ("0.26.0",)
#: Set by `enable()` to the server's process id for the engine core it is about to start: `engine_plugin` acts
#: only in another process (the engine core, its workers).
ENV_ENGINE_SIDE = "GRPO_VLLM_COMPACT_LOGPROBS"

_originals: dict[str, Callable[..., Any]] = {}


# ------------------------------------------------------------------------------------------------ the engine core


#: The step whose rows were made last, and its rows (the engine core's scheduler runs on one thread).
_step_rows: list[Any] = [None, None]


def _slice_rows(lists: Any, req_idx: int, num_positions: int) -> Any:
    """`LogprobsLists.slice_request`, rows as lists: the step's arrays become lists once (the scheduler slices one
    step's LogprobsLists for each of its requests in turn), each request takes a slice of them."""
    if lists.cu_num_generated_tokens is not None:
        req_idx = lists.cu_num_generated_tokens[req_idx]
    cached = _step_rows
    if cached[0] is not lists:
        cached[0] = lists
        cached[1] = (lists.logprob_token_ids.tolist(), lists.logprobs.tolist(), lists.sampled_token_ranks.tolist())
    token_ids, logprobs, ranks = cached[1]
    end = req_idx + num_positions
    return LogprobsLists(token_ids[req_idx:end], logprobs[req_idx:end], ranks[req_idx:end], None)


def _patch_engine_side() -> None:
    _originals.setdefault("slice_request", LogprobsLists.slice_request)
    LogprobsLists.slice_request = _slice_rows


def engine_plugin() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins`: grpo_compact_logprobs), loaded by every vLLM
    process where this package is installed: it changes the engine core's side only in a child of a server whose
    `enable()` asked for it."""
    server = os.environ.get(ENV_ENGINE_SIDE, "")
    if server.isdigit() and int(server) != os.getpid() and _vllm_supported():
        _patch_engine_side()


# ---------------------------------------------------------------------------------------------------- the front end


def _decode_rows(decoder: Any, arr: Any) -> Any:
    """`MsgpackDecoder._decode_ndarray` that also takes rows: vLLM's inline form is `[dtype str, shape, data]`."""
    if isinstance(arr, list) and not (arr and isinstance(arr[0], str)):
        return np.array(arr)
    return _originals["decode_ndarray"](decoder, arr)


def _patch_front_side() -> None:
    _originals.setdefault("decode_ndarray", MsgpackDecoder._decode_ndarray)
    MsgpackDecoder._decode_ndarray = _decode_rows


def _restore() -> None:
    if "slice_request" in _originals:
        LogprobsLists.slice_request = _originals["slice_request"]
    if "decode_ndarray" in _originals:
        MsgpackDecoder._decode_ndarray = _originals["decode_ndarray"]


# -------------------------------------------------------------------------------------------------- on, and checked


def _vllm_supported() -> bool:
    return vllm.__version__ in SUPPORTED_VLLM


def output_processor(requests: int, max_tokens: int, num_logprobs: int | None) -> OutputProcessor:
    """vLLM's front-end output processor with `requests` requests r0, r1, ... added, as this server asks (flat
    logprobs, no detokenization, the final output only)."""
    processor = OutputProcessor(None, log_stats=False)
    for i in range(requests):
        params = SamplingParams(max_tokens=max_tokens, logprobs=num_logprobs, flat_logprobs=True, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], mm_features=None,
                                    sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
                                    cache_salt=None, data_parallel_rank=None)
        request.external_req_id = f"r{i}"
        processor.add_request(request, None)
    return processor


def run_outputs(requests: int, steps: int, num_logprobs: int, positions: int, seed: int,
                slice_request: Callable[..., Any]) -> list[tuple[list[int], list[float], list[int | None], float]]:
    """Generate `steps` steps of `positions` tokens for `requests` requests through vLLM's own engine-core output
    classes, msgpack encoder and decoder and output processor (tokenizer off, flat logprobs, final output only),
    each request's logprobs sliced by `slice_request`; each request's final token ids, logprobs, ranks and
    cumulative logprob."""
    processor = output_processor(requests, steps * positions, num_logprobs)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    rng = np.random.default_rng(seed)
    columns = num_logprobs + 1
    finals: dict[str, Any] = {}
    for step in range(steps):
        rows = requests * positions
        lists = LogprobsLists(rng.integers(0, 32000, size=(rows, columns)).astype(np.int32),
                              (-rng.random((rows, columns), dtype=np.float32) * 8),
                              rng.integers(1, 50, size=rows).astype(np.int32),
                              [i * positions for i in range(requests + 1)])
        sampled = lists.logprob_token_ids[:, 0].tolist()
        outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=sampled[i * positions:(i + 1) * positions],
                                    new_logprobs=slice_request(lists, i, positions),
                                    finish_reason=FinishReason.LENGTH if step == steps - 1 else None)
                   for i in range(requests)]
        received = decoder.decode(encoder.encode(EngineCoreOutputs(outputs=outputs)))
        for output in processor.process_outputs(received.outputs).request_outputs:
            finals[output.request_id] = output
    result = []
    for i in range(requests):
        completion = finals[f"r{i}"].outputs[0]
        flat = completion.logprobs
        result.append((list(flat.token_ids), list(flat.logprobs), list(flat.ranks),
                       float(completion.cumulative_logprob)))
    return result


def self_check() -> str | None:
    """vLLM's path and the compact one on the same outputs (front-end replacements installed for the second):
    None when every request's logprobs agree, else what differed. Leaves the front end replaced when they agree."""
    _restore()
    original_slice = _originals.get("slice_request", LogprobsLists.slice_request)
    cases = [(5, 4, 0, 1), (3, 3, 2, 1), (3, 3, 1, 2)]  # requests, steps, top-k, tokens per step
    expected = [run_outputs(*case, seed=n, slice_request=original_slice) for n, case in enumerate(cases)]
    _patch_front_side()
    try:
        for n, case in enumerate(cases):
            # rows from an engine core that loaded the plugin, and vLLM's arrays from one that did not
            for engine, slice_request in (("compact", _slice_rows), ("vLLM's", original_slice)):
                got = run_outputs(*case, seed=n, slice_request=slice_request)
                if got != expected[n]:
                    _restore()
                    return (f"{engine} engine side, requests/steps/top-k/tokens per step {case}: "
                            f"{got[0]!r:.200} against vLLM's {expected[n][0]!r:.200}")
    finally:
        _step_rows[:] = [None, None]
    return None


def enable() -> bool:
    """Replace the front end's side in this process and ask the engine core about to start for its side; False (and
    nothing replaced) where this vLLM is not one these were written for or the self-check finds a difference."""
    if not _vllm_supported():
        log.warning("logprob transport compact: written for vLLM %s, this is %s; vLLM's own transport is used",
                    ", ".join(SUPPORTED_VLLM), vllm.__version__)
        return False
    try:
        problem = self_check()
    except Exception as exc:  # a vLLM whose internals moved: its own transport still works
        _restore()
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        log.warning("logprob transport compact: the self-check failed (%s); vLLM's own transport is used", problem)
        return False
    os.environ[ENV_ENGINE_SIDE] = str(os.getpid())
    return True
