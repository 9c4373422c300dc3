"""Pure parts of generation: the prefetch schedule, the prefetch queue, and which answers may reach the loss."""

from __future__ import annotations

import threading
from pathlib import Path

from trl.trainer.utils import RepeatSampler

from grpo_trainer.generation import (
    MAX_PREFETCH_HOLD,
    PROBE_BUDGET,
    GenerationBackend,
    Prefetcher,
    StalenessBound,
    generation_batches,
    staleness_bound,
)
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.adapter_store import AdapterStore, PublishedAdapter
from grpo_trainer.transport.policy_sync import AdapterSync
from grpo_trainer.transport.replica_set import ReplicaSet, static_discovery
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions


def test_generation_batches_follow_trl_repeat_sampler_layout():
    # 3 prompts per generation batch, 2 generations each, each batch reused for 2 micro-steps.
    sampler = RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, repeat_count=2, seed=0)
    stream = list(sampler)
    batches = generation_batches(stream, chunk=3, mini_repeat=2, repeat=2)
    assert len(batches) == 2 and all(len(b) == 3 for b in batches)
    assert stream[:6] == [i for i in batches[0] for _ in range(2)]
    assert stream[12:18] == [i for i in batches[1] for _ in range(2)]


def test_staleness_bound_stays_within_sync_interval_plus_prefetch_depth():
    assert staleness_bound(1, 0) == 0
    assert staleness_bound(4, 2) == 5
    assert all(staleness_bound(k, d) <= k + d for k in range(1, 6) for d in range(0, 4))


def completions(tag: int) -> Completions:
    return Completions([[tag]], [[-0.1]], boot_id="b1", adapter_version=None, seconds=0.01)


def test_prefetcher_requests_the_next_batches_ahead_in_order():
    requested: list[tuple[int, list[list[int]]]] = []
    gate = threading.Event()

    def request(prompt_ids, number):
        gate.wait(5)
        requested.append((number, prompt_ids))
        return completions(prompt_ids[0][0])

    schedule = [[0], [1], [2], [3], [4]]
    prefetcher = Prefetcher(depth=2, request=request, tokenize_rows=lambda rows: [[r * 10] for r in rows])
    prefetcher.set_schedule(schedule)
    first = prefetcher.take([[0]])
    gate.set()
    assert first.result().completion_ids == [[0]]
    second = prefetcher.take([[10]])  # prefetched: no new request for it
    assert second.result().completion_ids == [[10]]
    assert prefetcher.pending_positions() == [2, 3]
    prefetcher.take([[20]]).result()
    assert prefetcher.pending_positions() == [3, 4]
    prefetcher.close()
    # numbered (and so seeded) in schedule order, whichever of the concurrent requests ran first
    assert sorted(requested)[:3] == [(1, [[0]]), (2, [[10]]), (3, [[20]])]


def test_prefetcher_keeps_depth_requests_in_flight_at_once():
    started: list[int] = []
    both_running = threading.Barrier(2, timeout=5)

    def request(prompt_ids, number):
        started.append(number)
        both_running.wait()  # a single worker would never get here with two requests: BrokenBarrierError
        return completions(prompt_ids[0][0])

    prefetcher = Prefetcher(depth=2, request=request, tokenize_rows=lambda rows: [[r] for r in rows])
    prefetcher.set_schedule([[0], [1]])  # two requests: the one taken and the one ahead
    first = prefetcher.take([[0]])
    assert first.result(timeout=10).completion_ids == [[0]]
    assert prefetcher.take([[1]]).result(timeout=10).completion_ids == [[1]]
    prefetcher.close()
    assert sorted(started) == [1, 2]


def held_steps(prefetcher: Prefetcher, steps: int, *, step_seconds: float, clock: list[float]) -> list[int]:
    """Take the schedule's first `steps` batches (of more), `step_seconds` apart; the positions taken without a
    request ahead."""
    held = []
    for position in range(steps):
        clock[0] += step_seconds
        prefetcher.take([[position]]).result(timeout=10)
        if not prefetcher.pending_positions():
            held.append(position)
    return held


def test_after_a_discarded_prefetch_the_pause_keeps_its_cost_within_the_probe_budget():
    clock = [0.0]
    prefetcher = Prefetcher(depth=1, request=lambda ids, number: completions(ids[0][0]),
                            tokenize_rows=lambda rows: [[r] for r in rows], clock=lambda: clock[0])
    prefetcher.set_schedule([[p] for p in range(200)])
    for position, seconds in enumerate((0.8, 5.0, 0.8, 0.8)):  # a slow first step (warm-up), then 0.8 s steps
        clock[0] += seconds
        prefetcher.take([[position]]).result(timeout=10)
    assert prefetcher.pending_positions() == [4]
    # the batch at 4 drifted too far and cost 0.41 s: a pause of 0.41 / (2% of the quickest step, 0.8 s) steps
    prefetcher.back_off(wasted_seconds=0.41)
    assert prefetcher.pending_positions() == []
    expected = 26
    assert PROBE_BUDGET == 0.02 and expected < MAX_PREFETCH_HOLD
    prefetcher.set_schedule([[p] for p in range(60)])
    held = held_steps(prefetcher, 50, step_seconds=0.8, clock=clock)
    assert held == list(range(expected)), held
    # one more in a row that cost nothing measurable still doubles the depth-based pause; a costly one is capped
    prefetcher.back_off()
    assert prefetcher.held_batches == 2
    prefetcher.back_off(wasted_seconds=100.0)
    assert prefetcher.held_batches == MAX_PREFETCH_HOLD
    # an accepted batch starts the count again, and a cheap discard then pauses for depth batches only
    prefetcher.steady()
    prefetcher.back_off(wasted_seconds=0.001)
    assert prefetcher.held_batches == 1
    prefetcher.close()


def test_prefetcher_realigns_when_batches_were_skipped_on_resume():
    requested: list[list[list[int]]] = []

    def request(prompt_ids, number):
        requested.append(prompt_ids)
        return completions(prompt_ids[0][0])

    prefetcher = Prefetcher(depth=1, request=request, tokenize_rows=lambda rows: [[r] for r in rows])
    prefetcher.set_schedule([[0], [1], [2], [3]])
    assert prefetcher.take([[2]]).result().completion_ids == [[2]]
    assert prefetcher.cursor == 3
    prefetcher.take([[3]]).result()
    prefetcher.close()
    assert [[2]] in requested and [[3]] in requested and [[0]] not in requested


def backend(
    tmp_path: Path, step: int, bound: int | StalenessBound
) -> tuple[GenerationBackend, AdapterSync, AdapterStore]:
    metrics = TrainerMetrics()
    store = AdapterStore(tmp_path, "fp")
    sync = AdapterSync(store, None, metrics, retry_seconds=1)
    pool = ServerPool(ReplicaSet(static_discovery(["http://127.0.0.1:9"]), expected=1, describe="test", token=None,
                                 generation_timeout=1, metrics=metrics))
    gen = GenerationBackend(pool, sync, metrics, model_name="m", num_generations=1,
                            bound=bound if isinstance(bound, StalenessBound) else StalenessBound(1, bound),
                            seed=0, current_step=lambda: step)
    return gen, sync, store


def answer(boot: str, version: int | None) -> Completions:
    return Completions([[1]], [[-0.1]], boot_id=boot, adapter_version=version, seconds=0.01)


def test_answers_from_a_stale_or_unknown_adapter_are_refused(tmp_path: Path):
    gen, sync, store = backend(tmp_path, step=6, bound=1)
    store._steps.update({1: 2, 2: 4, 3: 6})
    sync.active = PublishedAdapter(version=3, step=6, path=tmp_path / "v3", sha256="x", size_bytes=1)
    assert gen.verdict(answer("b1", 3)) is None
    assert gen.verdict(answer("b1", 2)) == "stale_adapter"  # 2 steps behind, bound 1
    assert gen.verdict(answer("b1", None)) == "stale_adapter"  # the base model, 6 steps behind
    assert gen.verdict(answer("b1", 9)) == "unknown_adapter"
    gen_wide, sync_wide, store_wide = backend(tmp_path, step=6, bound=2)
    store_wide._steps.update({1: 2, 2: 4, 3: 6})
    sync_wide.active = sync.active
    assert gen_wide.verdict(answer("b1", 2)) is None


def test_max_staleness_bounds_a_batch_by_the_policy_versions_published_since_it_was_generated(tmp_path: Path):
    """syncInterval 2: versions at steps 2, 4, 6, 8; at step 9, v1 (step 2) is 3 versions behind."""
    bound = StalenessBound(sync_interval=2, prefetch_depth=1, max_versions=2)
    assert [bound.versions(s) for s in (0, 1, 2, 3, 7)] == [0, 0, 1, 1, 3]
    assert bound.accepts(5) and not bound.accepts(6)
    assert StalenessBound(2, 1).versions_allowed == 1 and StalenessBound(2, 1).accepts(2)
    assert not StalenessBound(2, 1).accepts(3)  # unset: the steps the pipeline produces (syncInterval - 1 + depth)
    gen, sync, store = backend(tmp_path, step=9, bound=bound)
    store._steps.update({1: 2, 2: 4, 3: 6, 4: 8})
    sync.active = PublishedAdapter(version=4, step=8, path=Path("/x/v4"), sha256="x", size_bytes=1)
    assert gen.verdict(answer("b1", 3)) is None  # step 6: 1 version behind
    assert gen.verdict(answer("b1", 2)) is None  # step 4: 2 versions behind
    assert gen.verdict(answer("b1", 1)) == "stale_adapter"  # step 2: 3 versions behind
    gen._record(answer("b1", 2))
    assert gen.metrics.staleness_versions._sum.get() == 2
    assert gen.metrics.staleness_bound_versions._value.get() == 2



def test_a_discarded_batch_costs_its_generation_and_its_scoring(tmp_path: Path):
    """On one GPU a prefetched batch's generation ran beside the step before it and slowed it by about as much:
    the pause after discarding it counts that with the time taking and scoring it took."""
    gen, _, _ = backend(tmp_path, step=3, bound=1)
    logged: list[str] = []
    gen._log = logged.append
    clock = [0.0]
    gen.prefetcher = Prefetcher(depth=1, request=lambda ids, number: completions(ids[0][0]),
                                tokenize_rows=lambda rows: [[r] for r in rows], clock=lambda: clock[0])
    gen.prefetcher.set_schedule([[p] for p in range(100)])
    for position in range(3):
        clock[0] += 1.0
        gen.prefetcher.take([[position]]).result(timeout=10)
    gen._record(Completions([[1]], [[-0.1]], boot_id="b1", adapter_version=None, seconds=0.25))

    gen.regenerate_after_drift(drift=5.0, bound=0.3, spent_seconds=0.1)

    assert gen.prefetcher.held_batches == 18  # (0.25 + 0.1) s / (2% of 1 s), rounded up
    assert "it cost 0.35s, 0.25 of them generating" in logged[-1] and "paused for 18 batches" in logged[-1]
    assert gen.metrics.discarded_batches.labels("policy_drift")._value.get() == 1
    gen.close()
