"""Generation through the server, with the guarantees the loss depends on.

No generation from the wrong policy reaches the loss: every answer's boot id
and adapter version are checked before TRL sees it. An answer from a restarted
server replica (new boot id) is thrown away by the pool (transport/replicas.py), which
loads the current adapter on that replica and generates the batch again; an
answer from an adapter older than the staleness bound is generated again too.

With async prefetch, the batches of the next `depth` steps are requested in
background threads while the current step trains, up to `depth` at once so the
server decodes them together; each request's seed is drawn when it is submitted,
in schedule order, so concurrency does not change what a seeded run samples.
Which prompts come next is known from the sampler's schedule (see trl_overrides.ScheduleRecordingSampler);
a prefetched answer is used only if it is for exactly the prompts requested.
Every request first waits for a background adapter sync in flight, so a batch is
generated from the adapter of the latest step whose sync was started before it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_api.models import MAX_DRIFT_OFF, ImportanceSamplingSpec
from grpo_trainer.errors import TrainingFailed
from grpo_trainer.metrics import DiscardReason, TrainerMetrics
from grpo_trainer.transport.policy_sync import PolicySync
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions

#: Times one batch may be discarded and generated again before the run fails.
MAX_REGENERATIONS = 4
#: Most generation batches prefetching stays paused after batches drifted too far (DriftGuard).
MAX_PREFETCH_HOLD = 32
#: The share of the run's time that prefetched batches the policy moved too far from may waste: after one is
#: discarded, prefetching stays paused until the time it cost is at most this share of the steps since (within
#: MAX_PREFETCH_HOLD). A policy that moves too fast for prefetching (the H100's depth-1 run at lr 2e-2 discarded
#: every prefetched batch, 1.9-45 nats a token against a 0.3 bound) then costs about this much over no prefetch.
PROBE_BUDGET = 0.02

PromptIds = list[list[int]]


def staleness_bound(sync_interval: int, prefetch_depth: int) -> int:
    """Largest accepted staleness in steps.

    Without prefetch a batch is generated right after the latest sync, so it is at
    most sync_interval - 1 steps behind; each prefetched step adds one. This stays
    within the documented bound of syncInterval + prefetchDepth.
    """
    return sync_interval - 1 + prefetch_depth


@dataclass(frozen=True)
class StalenessBound:
    """How far behind the step training on it a batch's policy may be.

    A batch's age in policy versions is the number of adapter versions the trainer publishes (one every
    syncInterval steps) between the version that generated it and the step that trains on it. With
    `max_versions` (spec.trainer.maxStaleness) that age is the bound; without it, the staleness the
    pipeline produces by construction (staleness_bound, in steps) is.
    """

    sync_interval: int
    prefetch_depth: int
    max_versions: int | None = None

    @property
    def steps(self) -> int:
        return staleness_bound(self.sync_interval, self.prefetch_depth)

    def versions(self, steps_behind: int) -> int:
        return max(steps_behind, 0) // self.sync_interval

    @property
    def versions_allowed(self) -> int:
        return self.max_versions if self.max_versions is not None else self.versions(self.steps)

    def accepts(self, steps_behind: int) -> bool:
        if self.max_versions is None:
            return steps_behind <= self.steps
        return self.versions(steps_behind) <= self.max_versions


def generation_batches(indices: Sequence[int], chunk: int, mini_repeat: int, repeat: int) -> list[list[int]]:
    """Unique dataset rows of each generation batch in a RepeatSampler stream.

    The stream repeats each chunk of `chunk` rows `repeat` times, each row `mini_repeat` times
    in a row; TRL generates once per chunk, for its unique rows in order.
    """
    block = chunk * mini_repeat * repeat
    return [list(indices[start : start + chunk * mini_repeat : mini_repeat]) for start in range(0, len(indices), block)]


@dataclass
class _Pending:
    position: int
    prompt_ids: PromptIds
    future: concurrent.futures.Future[Completions]


@dataclass
class Prefetcher:
    """Requests the next `depth` generation batches ahead, in order, up to `depth` in flight at once."""

    depth: int
    #: Sends one request: (prompt ids, request number); the number is drawn at submission, in order.
    request: Callable[[PromptIds, int], Completions]
    tokenize_rows: Callable[[list[int]], PromptIds]
    numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    schedule: list[list[int]] = field(default_factory=list)
    cursor: int = 0
    _queue: deque[_Pending] = field(default_factory=deque)
    _tokenized: dict[int, PromptIds] = field(default_factory=dict)
    _pool: concurrent.futures.ThreadPoolExecutor = field(init=False)
    #: Batches still to take before prefetching resumes, and back-offs in a row (see back_off).
    _hold: int = 0
    _back_offs: int = 0
    #: When the last batch was taken, and the seconds between the last takes (steps), for back_off's budget.
    _taken_at: float | None = None
    _step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max(self.depth, 1), thread_name_prefix="grpo-prefetch")

    def _submit(self, prompt_ids: PromptIds) -> concurrent.futures.Future[Completions]:
        return self._pool.submit(self.request, prompt_ids, next(self.numbers))

    def set_schedule(self, batches: list[list[int]]) -> None:
        """A new epoch's generation batches (unique dataset rows per batch)."""
        self.schedule = batches
        self.cursor = 0
        self._tokenized.clear()

    def _prompts_at(self, position: int) -> PromptIds:
        if position not in self._tokenized:
            self._tokenized[position] = self.tokenize_rows(self.schedule[position])
        return self._tokenized[position]

    def _locate(self, prompt_ids: PromptIds) -> int | None:
        """Schedule position of this batch: normally the cursor; after a resume, further on."""
        for position in range(self.cursor, len(self.schedule)):
            if self._prompts_at(position) == prompt_ids:
                return position
        return None

    def take(self, prompt_ids: PromptIds) -> concurrent.futures.Future[Completions]:
        """The answer for these prompts (prefetched, or requested now), then prefetch what follows."""
        self._time_step()
        position = self._locate(prompt_ids)
        current: concurrent.futures.Future[Completions] | None = None
        while self._queue:
            pending = self._queue.popleft()
            if position is not None and pending.position == position and pending.prompt_ids == prompt_ids:
                current = pending.future
                break
            pending.future.cancel()
        if current is None:
            current = self._submit(prompt_ids)
        if self._hold > 0:
            self._hold -= 1
            if position is not None:
                self.cursor = position + 1
            return current
        if position is not None:
            self.cursor = position + 1
            queued = {p.position for p in self._queue}
            for ahead in range(self.cursor, min(self.cursor + self.depth, len(self.schedule))):
                if ahead not in queued:
                    ids = self._prompts_at(ahead)
                    self._queue.append(_Pending(ahead, ids, self._submit(ids)))
        return current

    def pending_positions(self) -> list[int]:
        """Schedule positions requested ahead and not yet taken."""
        return [p.position for p in self._queue]

    def _time_step(self) -> None:
        now = self.clock()
        if self._taken_at is not None:
            self._step_seconds.append(now - self._taken_at)
        self._taken_at = now

    def back_off(self, wasted_seconds: float = 0.0) -> None:
        """A prefetched batch drifted too far from the policy that trained on it, and it cost `wasted_seconds`: the
        others are older still, so drop them, and generate the next batches on demand. The pause is the longer of
        two: depth batches after the first back-off, twice as many after each one in a row; and as many steps as
        keep the waste within PROBE_BUDGET of the run's time. Both stop at MAX_PREFETCH_HOLD. While the policy
        moves faster per step than the bound allows, prefetching is mostly paused (what it would generate could
        not be used); once a prefetched batch is accepted again (`steady`), the pause starts short again."""
        self.discard()
        self._back_offs += 1
        hold = self.depth * 2 ** (self._back_offs - 1)
        if wasted_seconds > 0 and self._step_seconds:
            # against the quickest recent step: the first steps (compilation, warm-up) would shorten the pause
            hold = max(hold, math.ceil(wasted_seconds / (PROBE_BUDGET * min(self._step_seconds))))
        self._hold = min(hold, MAX_PREFETCH_HOLD)

    @property
    def held_batches(self) -> int:
        """Batches still to take before prefetching resumes."""
        return self._hold

    def steady(self) -> None:
        """A prefetched batch was close enough to the training policy: the next back-off starts short."""
        self._back_offs = 0

    def discard(self) -> int:
        """Drop every prefetched batch (after a server restart); returns how many."""
        dropped = len(self._queue)
        while self._queue:
            self._queue.popleft().future.cancel()
        return dropped

    def close(self) -> None:
        self.discard()
        self._pool.shutdown(wait=False, cancel_futures=True)


class GenerationBackend:
    """Turns TRL's generate call into checked requests to the server."""

    def __init__(
        self,
        pool: ServerPool,
        sync: PolicySync[Any, Any],
        metrics: TrainerMetrics,
        *,
        model_name: str,
        num_generations: int,
        bound: StalenessBound,
        seed: int,
        current_step: Callable[[], int],
        log: Callable[[str], None] = print,
    ) -> None:
        self.pool = pool
        self.sync = sync
        self.metrics = metrics
        self.model_name = model_name
        #: Sampling fields of each request; ServerGeneration fills them from TRL's generation settings.
        self.sampling: dict[str, Any] = {}
        self.num_generations = num_generations
        self.bound = bound
        self.seed = seed
        self.current_step = current_step
        self.prefetcher: Prefetcher | None = None
        self._log = log
        self._request_ids = itertools.count(1)
        self.last_staleness: int | None = None
        #: Seconds the server took to generate the last batch recorded (regenerate_after_drift's cost).
        self.last_generation_seconds = 0.0
        #: The next batch is generated now, from the current policy, not taken from the prefetcher.
        self._fresh_next = False
        metrics.staleness_bound_steps.set(bound.steps)
        metrics.staleness_bound_versions.set(bound.versions_allowed)

    def enable_prefetch(self, depth: int, tokenize_rows: Callable[[list[int]], PromptIds]) -> Prefetcher:
        self.prefetcher = Prefetcher(depth=depth, request=self._request, tokenize_rows=tokenize_rows,
                                     numbers=self._request_ids)
        return self.prefetcher

    def _request(self, prompt_ids: PromptIds, request_id: int) -> Completions:
        # Sent only after a background sync is done (and raising its failure): never during a trigger.
        self.sync.wait()
        # A distinct, reproducible seed per request: the same run samples the same completions.
        sampling = {**self.sampling, "seed": (self.seed * 1_000_003 + request_id) % (2**31)}
        return self.pool.completions(
            model=self.model_name, prompts=prompt_ids, n=self.num_generations, sampling=sampling
        )

    def _fetch(self, prompt_ids: PromptIds, *, fresh: bool) -> Completions:
        if self.prefetcher is not None and not fresh:
            return self.prefetcher.take(prompt_ids).result()
        return self._request(prompt_ids, next(self._request_ids))

    def verdict(self, result: Completions) -> DiscardReason | None:
        """Why this answer must not reach the loss, or None if it may (a restarted replica's answers were
        thrown away by the pool already)."""
        latest = self.sync.active.version if self.sync.active is not None else None
        version = self.sync.version_of(result)
        if version is not None and (latest is None or version > latest):
            return "unknown_adapter"
        staleness = self.staleness_of(result)
        if staleness is None or not self.bound.accepts(staleness):
            return "stale_adapter"
        return None

    def staleness_of(self, result: Completions) -> int | None:
        """Steps between the policy version that generated the batch and the step training on it."""
        version = self.sync.version_of(result)
        adapter_step = 0 if version is None else self.sync.step_of(version)
        if adapter_step is None:
            return None
        return self.current_step() - adapter_step

    def generate(self, prompt_ids: PromptIds) -> Completions:
        """Completions for the unique prompts of one batch, from the policy TRL expects."""
        fresh, self._fresh_next = self._fresh_next, False
        for _ in range(MAX_REGENERATIONS + 1):
            result = self._fetch(prompt_ids, fresh=fresh)
            reason = self.verdict(result)
            if reason is None:
                self._record(result)
                return result
            self.metrics.discarded_batches.labels(reason).inc()
            self._log(
                f"discarded a generated batch ({reason}: boot {result.boot_id}, {self.sync.kind} "
                f"v{self.sync.version_of(result)}, step {self.current_step()})"
            )
            fresh = True
        raise TrainingFailed(
            f"could not get a batch generated by the current policy after {MAX_REGENERATIONS + 1} tries "
            "(see the discarded-batch messages above)"
        )

    def _record(self, result: Completions) -> None:
        staleness = self.staleness_of(result)
        if staleness is not None:
            self.last_staleness = staleness
            self.metrics.staleness_steps.observe(staleness)
            self.metrics.staleness_versions.observe(self.bound.versions(staleness))
        self.last_generation_seconds = result.seconds
        self._log(
            f"generated {result.num_tokens} tokens in {result.seconds:.2f}s ({self.sync.kind} "
            f"v{self.sync.version_of(result)}, "
            f"staleness {staleness})"
        )
        self.metrics.generation_seconds.observe(result.seconds)
        self.metrics.generated_tokens.inc(result.num_tokens)
        if result.seconds > 0:
            self.metrics.generation_tokens_per_second.set(result.num_tokens / result.seconds)

    def regenerate_after_drift(self, drift: float, bound: float, spent_seconds: float = 0.0) -> None:
        """The batch just generated drifted `drift` nats a token from the policy training on it, and taking and
        scoring it took `spent_seconds`: generate it again from the current policy, and let the prefetcher back
        off. What the batch cost is that time and its generation's: on one GPU the generation slowed the step
        it ran beside by about its own length (the H100, lr 2e-2: 0.26 and 0.43 s beside 0.40 and 0.45 s of
        generation); on a GPU of its own it cost nothing, and the pause is longer than it needs to be.
        """
        self.metrics.discarded_batches.labels("policy_drift").inc()
        paused = ""
        wasted_seconds = spent_seconds + self.last_generation_seconds
        if self.prefetcher is not None:
            self.prefetcher.back_off(wasted_seconds)
            paused = f"; prefetching paused for {self.prefetcher.held_batches} batches"
        self._log(
            f"discarded a generated batch (policy_drift: {drift:.3f} nats a token between its sampler and the "
            f"policy training on it, bound {bound:g}; staleness {self.last_staleness}; it cost "
            f"{wasted_seconds:.2f}s, {self.last_generation_seconds:.2f} of them generating): generating it again from "
            f"the current policy{paused}"
        )
        self._fresh_next = True

    def drift_accepted(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.steady()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


@dataclass(frozen=True)
class DriftGuard:
    """Keeps stale batches that the policy has moved too far from out of the loss (importanceSampling.maxDrift).

    A batch generated `staleness` steps ago was sampled by an older policy. The importance-sampling correction
    reweights its tokens by the ratio of the training policy's probability to the sampler's, which is sound
    while the two are close; when one optimizer step moves the policy far (a high learning rate), almost every
    token's ratio is near 0 or far above the clip, a handful of tokens carry the whole gradient, and training
    collapsed into one token on the H200 (BENCHMARKS.md, 2026-12-03). The drift is the mean |log-ratio| over the
    batch's completion tokens (TRL's sampling/sampling_logp_difference/mean); a stale batch above `max_drift`
    is generated again from the current policy (staleness 0), so no step trains on samples farther from its
    policy than the bound, and asynchronous training falls back to synchronous while the policy moves that fast.

    Every trainer process holds one; rank 0's has the backend and decides (the others follow its decision).
    """

    max_drift: float
    backend: GenerationBackend | None

    @classmethod
    def for_spec(
        cls, importance_sampling: ImportanceSamplingSpec, backend: GenerationBackend | None
    ) -> DriftGuard | None:
        """The guard of spec.trainer.importanceSampling; None without the correction (whose logprobs it reads)."""
        if not importance_sampling.enabled:
            return None
        return cls(importance_sampling.max_drift, backend)

    @property
    def judges(self) -> bool:
        """Whether a stale batch can be refused at all (maxDrift at its ceiling trains on every one)."""
        return self.max_drift < MAX_DRIFT_OFF

    def rejects(self, drift: float) -> bool:
        backend = self.backend
        if backend is None or not backend.last_staleness or not self.judges:
            return False  # a batch of the current policy differs from it only by numerics
        if drift > self.max_drift:
            return True
        backend.drift_accepted()
        return False

    def regenerate(self, drift: float, spent_seconds: float = 0.0) -> None:
        if self.backend is not None:
            self.backend.regenerate_after_drift(drift, self.max_drift, spent_seconds)
