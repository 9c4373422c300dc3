"""The polling helpers every suite waits with (tests/fixtures/waiting.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.fixtures.waiting import consistently, wait_for


def counter(values: list[object]) -> Callable[[], object]:
    """A predicate answering `values` one call at a time (the last one from then on)."""
    calls = iter(values)
    last: list[object] = [None]

    def predicate() -> object:
        last[0] = next(calls, last[0])
        return last[0]

    return predicate


def test_wait_for_returns_the_first_truthy_value() -> None:
    assert wait_for(counter([None, 0, [], {"phase": "Done"}]), 5, interval=0.01) == {"phase": "Done"}


def test_wait_for_times_out_naming_what_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2s waiting for the job \(last value \[\]\)"):
        wait_for(lambda: [], 0.2, interval=0.05, what="the job")
    assert time.monotonic() - started < 5


def test_wait_for_retries_an_exception_and_names_the_last_one_on_timeout() -> None:
    def not_there() -> None:
        raise FileNotFoundError("progress.json")

    with pytest.raises(AssertionError, match=r"step 2 \(last raised FileNotFoundError\('progress.json'\)\)"):
        wait_for(not_there, 0.1, interval=0.02, what="step 2")

    flaky = counter([OSError("half written"), 7])

    def settles() -> object:
        value = flaky()
        if isinstance(value, Exception):
            raise value
        return value

    assert wait_for(settles, 5, interval=0.01) == 7


def test_an_assertion_in_the_predicate_ends_the_wait_at_once() -> None:
    def failed_run() -> None:
        raise AssertionError("run failed: BackoffLimitExceeded")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="run failed: BackoffLimitExceeded"):
        wait_for(failed_run, 30, interval=0.01)
    assert time.monotonic() - started < 5


def test_wait_for_fails_early_when_the_process_it_waits_for_has_exited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"process exited with 3 while waiting for a checkpoint"):
        wait_for(lambda: False, 30, interval=0.01, what="a checkpoint", proc=proc)
    assert time.monotonic() - started < 5


def test_consistently_holds_for_the_whole_period_and_returns_the_last_value() -> None:
    started = time.monotonic()
    assert consistently(lambda: "still pending", 0.3, what="no job", interval=0.05) == "still pending"
    assert time.monotonic() - started >= 0.3


def test_consistently_fails_as_soon_as_the_predicate_stops_holding() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"no trainer Job: stopped holding after .* of 30s \(got False\)"):
        consistently(counter([True, True, False]), 30, what="no trainer Job", interval=0.01)
    assert time.monotonic() - started < 5


def test_consistently_fails_at_once_on_an_exception_naming_it() -> None:
    def check() -> bool:
        raise AssertionError("two ChildRejected events")

    with pytest.raises(AssertionError, match=r"one event: stopped holding after .*: two ChildRejected events"):
        consistently(check, 30, what="one event")
