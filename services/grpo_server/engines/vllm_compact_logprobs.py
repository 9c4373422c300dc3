"""The sampled tokens' logprobs from vLLM's engine core to this server as msgpack's own lists
(`GRPO_SERVER_LOGPROB_TRANSPORT=compact`, the default), not three small numpy arrays per request per decoding step.

In vLLM 0.26 a step that returns logprobs costs the engine core, per request, three numpy views of the step's arrays
(`LogprobsLists.slice_request`) and three calls into vLLM's array encoder, and costs the server's front end three
calls into its ext and array decoders (`bench/vllm_logprobs_transport.py` measures each). On the H100, generation
with `logprobs=0` ran at 0.46x of plain in-process, its front end busy 100% of the time (BENCHMARKS.md); GRPO needs
the sampled token's logprob at every position.

`compact` replaces four of vLLM 0.26.0's methods with ones that give the same logprobs:

- engine core (`engine_plugin`, a `vllm.general_plugins` entry point, which vLLM loads in every process of the
  engine; it acts only in a process the server started after asking for it, `ENV_ENGINE_SIDE`, never in the
  server's own, where an engine core without multiprocessing would hand the rows to the front end undecoded):
  - `LogprobsLists.slice_request` converts the step's arrays to lists once per step and gives each request its
    rows as list slices, which msgpack encodes natively;
  - `Scheduler.update_from_output` keeps the rows of a request that asked for its final output only and top-k
    logprobs (as this server's do; not with stop strings, which the front end checks) until its last step, each
    cut to the columns the request reads and kept flat (`HeldRows`: three lists a request, not a list a position,
    which the engine core's garbage collector would walk on every pass), and hands them over with that step as
    vLLM's arrays (`hold_rows`): one message field per request rather than one per request per step;
- front end:
  - `MsgpackDecoder._decode_ndarray` makes an array of rows (vLLM's own inline form, `[dtype, shape, data]`,
    begins with the dtype's string; rows never hold one);
  - `LogprobsProcessor._update_sample_logprobs` appends a request's rows to its flat logprobs in bulk, not one
    position at a time, where nothing is detokenized (`_extend_rows`; otherwise vLLM's own).

On the H100 (BENCHMARKS.md, seventh lease) holding the rows did not raise the server's throughput with logprobs
(0.469x of plain, 0.485x with rows each step), though it cuts the front end's cost of them 5x on the CPU. The
eighth lease's profile puts the engine core's time in vLLM's scheduler and KV-block bookkeeping (the held rows'
wrapper: 0.5% of its samples), the server at 0.91x of vLLM's own `LLM.generate` with logprobs.

`enable()`, in the server before the engine starts, first runs vLLM's own path and the compact one on the same
outputs (`self_check`: several requests, top-k and multi-token steps, through vLLM's encoder, decoder and output
processor) and turns nothing on unless every logprob, rank and cumulative logprob is equal. Where the engine core
does not load the entry point (the package not installed), its side stays vLLM's and the front end decodes it as
vLLM does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import vllm
from vllm import SamplingParams
from vllm.logprobs import FlatLogprobs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.logprobs import LogprobsProcessor
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


_first = itemgetter(0)


@dataclass
class HeldRows:
    """One request's logprob rows held back until its last step, each cut to the `columns` it reads (1 + its
    num_logprobs): a step whose batch asked for more alternatives gives every request wider rows.

    Held flat, `columns` values a row, in three lists a request: rows held as they arrive (a list per position)
    are objects the engine core's garbage collector walks on every full pass for as long as the request runs
    (on the CPU, flat cut the engine core's cost a token from 11.9 to 6.9 µs: BENCHMARKS.md). The last step
    hands them over as vLLM's own arrays (`lists`): one array per field and request, encoded as a buffer."""

    columns: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def add(self, rows: Any) -> None:
        """One step's rows of this request (`_slice_rows`' lists, as wide as their step's widest request)."""
        if self.columns == 1:
            self.token_ids.extend(map(_first, rows.logprob_token_ids))
            self.logprobs.extend(map(_first, rows.logprobs))
        else:
            cut = slice(self.columns)
            self.token_ids.extend(chain.from_iterable(row[cut] for row in rows.logprob_token_ids))
            self.logprobs.extend(chain.from_iterable(row[cut] for row in rows.logprobs))
        self.ranks.extend(rows.sampled_token_ranks)

    def lists(self) -> LogprobsLists:
        """The held rows as vLLM's LogprobsLists (the dtypes of vLLM's LogprobsTensors)."""
        return LogprobsLists(np.array(self.token_ids, dtype=np.int32).reshape(-1, self.columns),
                             np.array(self.logprobs, dtype=np.float32).reshape(-1, self.columns),
                             np.array(self.ranks, dtype=np.int32), None)


#: Rows held back, by request id (see hold_rows).
_held: dict[str, HeldRows] = {}


def hold_rows(outputs: Iterable[EngineCoreOutput], columns_of: Callable[[str], int | None],
              held: dict[str, HeldRows]) -> None:
    """One step's outputs: an unfinished one whose request may wait (`columns_of` gives the columns it reads, not
    None) gives its logprob rows to `held`; a finished one takes every row held for its request, in order, before
    its own. The rows are `_slice_rows`' lists."""
    for output in outputs:
        rows = output.new_logprobs
        if output.finish_reason is None:
            if rows is None:
                continue
            kept = held.get(output.request_id)
            if kept is None:
                columns = columns_of(output.request_id)
                if columns is None:
                    continue
                kept = held[output.request_id] = HeldRows(columns)
            kept.add(rows)
            output.new_logprobs = None
            continue
        kept = held.pop(output.request_id, None)
        if kept is None:
            continue
        if rows is not None:
            kept.add(rows)
        output.new_logprobs = kept.lists()


def _held_columns(params: SamplingParams | None) -> int | None:
    """The columns of each row a request reads, where its logprobs may wait for its last step: it wants its final
    output only, the top-k logprobs (not all, not chosen tokens'), and has no stop strings (the front end ends
    those, and would never see the held rows). None where they may not."""
    if params is None or params.output_kind != RequestOutputKind.FINAL_ONLY or params.stop:
        return None
    if params.logprobs is None or params.logprobs < 0 or params.logprob_token_ids:
        return None
    return params.logprobs + 1


def _update_from_output_holding(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
    """`Scheduler.update_from_output`, then `hold_rows` over each client's outputs. The rows of a request that ended
    without a last output (aborted by its client) go when the scheduler reports it finished."""
    for request_id in scheduler_output.finished_req_ids:
        _held.pop(request_id, None)
    engine_core_outputs = _originals["update_from_output"](self, scheduler_output, model_runner_output)
    requests = self.requests

    def columns_of(request_id: str) -> int | None:
        request = requests.get(request_id)
        return None if request is None else _held_columns(request.sampling_params)

    for client_outputs in engine_core_outputs.values():
        hold_rows(client_outputs.outputs, columns_of, _held)
    return engine_core_outputs


def _patch_engine_side() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler  # the engine core's: the server's process needs it not

    _originals.setdefault("slice_request", LogprobsLists.slice_request)
    _originals.setdefault("update_from_output", Scheduler.update_from_output)
    LogprobsLists.slice_request = _slice_rows
    Scheduler.update_from_output = _update_from_output_holding


def engine_plugin() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins`: grpo_compact_logprobs), loaded by every vLLM
    process where this package is installed: it changes the engine core's side only in a child of a server whose
    `enable()` asked for it."""
    server = os.environ.get(ENV_ENGINE_SIDE, "")
    if server.isdigit() and int(server) != os.getpid() and _vllm_supported():
        _patch_engine_side()
        # under vLLM's logger, which vLLM configures in the engine core (this module's own is not there)
        logging.getLogger("vllm.grpo_compact_logprobs").info(
            "logprob transport compact: the engine core's side is on in process %d (rows as lists, held until "
            "each final-only request's last step)", os.getpid())


# ---------------------------------------------------------------------------------------------------- the front end


def _decode_rows(decoder: Any, arr: Any) -> Any:
    """`MsgpackDecoder._decode_ndarray` that also takes rows: vLLM's inline form is `[dtype str, shape, data]`."""
    if isinstance(arr, list) and not (arr and isinstance(arr[0], str)):
        return np.array(arr)
    return _originals["decode_ndarray"](decoder, arr)


def _extend_rows(processor: Any, logprobs_lists: Any) -> None:
    """`LogprobsProcessor._update_sample_logprobs` for flat logprobs without detokenization: every row at once.
    vLLM's appends each row's first 1 + num_logprobs columns (all where num_logprobs is -1), the ranks being the
    sampled token's then 1, 2, ..., and adds the sampled token's logprob to the cumulative one row by row."""
    flat = processor.logprobs
    if processor.tokenizer is not None or type(flat) is not FlatLogprobs or processor.cumulative_logprob is None:
        _originals["update_sample_logprobs"](processor, logprobs_lists)
        return
    token_ids, logprobs, ranks, _ = logprobs_lists
    rows, columns = logprobs.shape
    if processor.num_logprobs != -1:
        columns = min(columns, processor.num_logprobs + 1)
    cumulative = processor.cumulative_logprob
    for sampled in logprobs[:, 0].tolist():  # one by one, as vLLM adds them
        cumulative += sampled
    processor.cumulative_logprob = cumulative
    base = len(flat.logprobs)
    flat.start_indices.extend(range(base, base + rows * columns, columns))
    flat.end_indices.extend(range(base + columns, base + rows * columns + 1, columns))
    flat.token_ids.extend(token_ids[:, :columns].ravel().tolist())
    flat.logprobs.extend(logprobs[:, :columns].ravel().tolist())
    if columns == 1:
        flat.ranks.extend(ranks.tolist())
    else:
        for rank in ranks.tolist():
            flat.ranks.append(rank)
            flat.ranks.extend(range(1, columns))
    flat.decoded_tokens.extend([None] * (rows * columns))


def _patch_front_side() -> None:
    _originals.setdefault("decode_ndarray", MsgpackDecoder._decode_ndarray)
    _originals.setdefault("update_sample_logprobs", LogprobsProcessor._update_sample_logprobs)
    MsgpackDecoder._decode_ndarray = _decode_rows
    LogprobsProcessor._update_sample_logprobs = _extend_rows


def _restore() -> None:
    if "slice_request" in _originals:
        LogprobsLists.slice_request = _originals["slice_request"]
    if "update_from_output" in _originals:
        from vllm.v1.core.sched.scheduler import Scheduler

        Scheduler.update_from_output = _originals["update_from_output"]
    if "decode_ndarray" in _originals:
        MsgpackDecoder._decode_ndarray = _originals["decode_ndarray"]
    if "update_sample_logprobs" in _originals:
        LogprobsProcessor._update_sample_logprobs = _originals["update_sample_logprobs"]


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
                slice_request: Callable[..., Any], hold: bool = False,
                ) -> list[tuple[list[int], list[float], list[int | None], float]]:
    """Generate up to `steps` steps of `positions` tokens for `requests` requests (every other one ends a step
    early) through vLLM's own engine-core output classes, msgpack encoder and decoder and output processor
    (tokenizer off, flat logprobs, final output only), each request's logprobs sliced by `slice_request` and, with
    `hold`, held back until its last step by `hold_rows`; each request's final token ids, logprobs, ranks and
    cumulative logprob."""
    processor = output_processor(requests, steps * positions, num_logprobs)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    rng = np.random.default_rng(seed)
    columns = num_logprobs + 1
    last_step = [steps - 1 - (i % 2 if steps > 1 else 0) for i in range(requests)]
    held: dict[str, HeldRows] = {}
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
                                    finish_reason=FinishReason.LENGTH if step == last_step[i] else None)
                   for i in range(requests) if step <= last_step[i]]
        if hold:
            hold_rows(outputs, lambda request_id: columns, held)
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
    cases = [(5, 4, 0, 1), (3, 3, 2, 1), (3, 3, 1, 2), (2, 1, 0, 1)]  # requests, steps, top-k, tokens per step
    expected = [run_outputs(*case, seed=n, slice_request=original_slice) for n, case in enumerate(cases)]
    _patch_front_side()
    try:
        for n, case in enumerate(cases):
            # rows from an engine core that loaded the plugin, and vLLM's arrays from one that did not
            for engine, slice_request, hold in (("compact", _slice_rows, True), ("vLLM's", original_slice, False)):
                got = run_outputs(*case, seed=n, slice_request=slice_request, hold=hold)
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
