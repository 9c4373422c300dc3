"""Reward functions: built-ins, user functions by import path, and failures that name the function."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from grpo_api.models import RewardSpec
from grpo_trainer.errors import InvalidSpec, RewardFunctionFailed
from grpo_trainer.rewards import RewardConfigError, RewardContext, build_rewards

CTX = RewardContext(max_completion_length=10, dataset_columns=("prompt", "answer"))


def call(func, completions, completion_ids=None, **columns):
    completion_ids = completion_ids or [[] for _ in completions]
    return func(prompts=["p"] * len(completions), completions=completions, completion_ids=completion_ids,
                trainer_state=None, **columns)


def build(*specs: dict, paths: list[Path] | None = None):
    return build_rewards([RewardSpec.model_validate(s) for s in specs], CTX, paths or [])


def test_exact_match_compares_with_the_answer_column_plain_and_conversational():
    (func,), weights = build({"function": "exact_match", "weight": 2.0})
    assert weights == [2.0]
    assert call(func, [" cat ", "dog"], answer=["cat", "cat"]) == [1.0, 0.0]
    chat = [[{"role": "assistant", "content": "cat"}], [{"role": "assistant", "content": "x"}]]
    assert call(func, chat, answer=["cat", "cat"]) == [1.0, 0.0]
    assert func.__name__ == "exact_match"


def test_exact_match_without_the_column_is_refused_naming_the_field():
    with pytest.raises(RewardConfigError, match=r"rewards\[0\].*'label'"):
        build({"function": "exact_match", "args": {"column": "label"}})


def test_regex_match_searches_or_fullmatches():
    (search,), _ = build({"function": "regex_match", "args": {"pattern": r"\d+"}})
    (full,), _ = build({"function": "regex_match", "args": {"pattern": r"\d+", "fullmatch": True}})
    assert call(search, ["a 12", "none"]) == [1.0, 0.0]
    assert call(full, ["a 12", "12"]) == [0.0, 1.0]


def test_bad_regex_and_unknown_args_are_refused_naming_the_field():
    with pytest.raises(RewardConfigError, match=r"rewards\[0\]\.args\.pattern"):
        build({"function": "regex_match", "args": {"pattern": "("}})
    with pytest.raises(RewardConfigError, match=r"rewards\[1\]\.args: unknown argument\(s\) \['colour'\]"):
        build({"function": "length_penalty"}, {"function": "token_fraction", "args": {"low": 1, "high": 3,
                                                                                       "colour": 1}})


def test_length_penalty_and_token_fraction_use_the_max_completion_length():
    (length,), _ = build({"function": "length_penalty"})
    assert call(length, ["a", "b"], completion_ids=[[1] * 5, [1] * 10]) == [-0.5, -1.0]
    (frac,), _ = build({"function": "token_fraction", "args": {"low": 3, "high": 5}})
    # 2 of 3 tokens in range, but divided by max length 10: a short completion cannot score high.
    assert call(frac, ["a"], completion_ids=[[3, 4, 9]]) == [pytest.approx(0.2)]


def test_user_function_is_imported_from_the_dataset_directory_with_args(tmp_path: Path):
    (tmp_path / "my_rewards.py").write_text(
        "def bonus(prompts, completions, scale=1.0, **kwargs):\n"
        "    return [scale * len(c) for c in completions]\n"
    )
    (func,), _ = build({"function": "my_rewards:bonus", "args": {"scale": 2.0}}, paths=[tmp_path])
    assert func.__name__ == "my_rewards:bonus"
    assert call(func, ["ab", "abc"]) == [4.0, 6.0]


def test_a_reward_function_that_raises_fails_naming_it(tmp_path: Path):
    (tmp_path / "bad_rewards.py").write_text("def explode(**kwargs):\n    raise KeyError('missing')\n")
    (func,), _ = build({"function": "bad_rewards:explode"}, paths=[tmp_path])
    with pytest.raises(RewardFunctionFailed, match=r"reward function 'bad_rewards:explode' raised KeyError"):
        call(func, ["x"])


def test_a_reward_function_with_the_wrong_count_fails_naming_it(tmp_path: Path):
    (tmp_path / "short_rewards.py").write_text("def short(completions, **kwargs):\n    return [1.0]\n")
    (func,), _ = build({"function": "short_rewards:short"}, paths=[tmp_path])
    with pytest.raises(RewardFunctionFailed, match=r"'short_rewards:short' returned 1 rewards for 3 completions"):
        call(func, ["a", "b", "c"])


def test_async_user_functions_stay_async_for_trl(tmp_path: Path):
    import asyncio
    import inspect

    (tmp_path / "async_rewards.py").write_text(
        "async def score(completions, **kwargs):\n    return [0.5 for _ in completions]\n"
    )
    (func,), _ = build({"function": "async_rewards:score"}, paths=[tmp_path])
    assert inspect.iscoroutinefunction(func)
    assert asyncio.run(func(prompts=["p"], completions=["a"])) == [0.5]


def test_missing_module_is_refused_naming_the_reward(tmp_path: Path):
    with pytest.raises(RewardConfigError, match=r"^spec\.rewards\[0\]\.function 'nowhere_to_be_found:f': cannot "
                                                r"import module 'nowhere_to_be_found': no such module in "):
        build({"function": "nowhere_to_be_found:f"}, paths=[tmp_path])


def unique_module() -> str:
    return f"rewards_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize(
    ("source", "error", "line"),
    [
        ("import math\n\nSCALE = undefined_name * 2\n", "NameError: name 'undefined_name' is not defined", 3),
        ("def score(completions, **kw):\n    return [0.0 for c in completions\n", "SyntaxError: ", 2),
        ("import math\nimport no_such_dependency_xyz\n", "ModuleNotFoundError: No module named "
                                                       "'no_such_dependency_xyz'", 2),
    ],
    ids=["raises at import", "syntax error", "missing dependency"],
)
def test_a_module_that_fails_to_import_is_refused_naming_its_file_and_line(
    tmp_path: Path, source: str, error: str, line: int
):
    module = unique_module()
    (tmp_path / f"{module}.py").write_text(source)
    with pytest.raises(RewardConfigError) as info:
        build({"function": "exact_match"}, {"function": f"{module}:score"}, paths=[tmp_path])
    message = str(info.value)
    assert message.startswith(f"spec.rewards[1].function '{module}:score': cannot import module '{module}': {error}")
    assert message.endswith(f"({tmp_path / module}.py line {line})"), message


def test_a_missing_function_is_refused_naming_the_module_file_and_what_it_has(tmp_path: Path):
    module = unique_module()
    (tmp_path / f"{module}.py").write_text(
        "THRESHOLD = 0.5\n\ndef share(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    with pytest.raises(RewardConfigError) as info:
        build({"function": f"{module}:score"}, paths=[tmp_path])
    assert str(info.value) == (f"spec.rewards[0].function '{module}:score': module '{module}' "
                               f"({tmp_path / module}.py) has no callable 'score'; its functions: share")
    with pytest.raises(RewardConfigError, match=r"has no callable 'THRESHOLD'"):
        build({"function": f"{module}:THRESHOLD"}, paths=[tmp_path])


def test_reward_config_errors_are_invalid_spec_and_call_failures_are_not():
    assert issubclass(RewardConfigError, InvalidSpec)
    assert not issubclass(RewardFunctionFailed, InvalidSpec)


DEADLINE_SCRIPT = """
import asyncio, sys, time
from grpo_api.models import RewardSpec
from grpo_trainer.rewards import RewardContext, build_rewards

sys.path.insert(0, sys.argv[1])
ctx = RewardContext(max_completion_length=10, dataset_columns=("prompt",), timeout_seconds=float(sys.argv[3]))
(quick, slow), _ = build_rewards([RewardSpec(function="judge:quick"), RewardSpec(function=f"judge:{sys.argv[2]}")],
                                 ctx, [])
kwargs = dict(prompts=["p"], completions=["c"], completion_ids=[[1]], trainer_state=None)
assert quick(**kwargs) == [1.0]  # a call within the deadline leaves nothing behind
time.sleep(float(sys.argv[3]) + 0.5)  # ... not even a timer that fires later
print("quick call done", flush=True)
result = slow(**kwargs)
if asyncio.iscoroutine(result):
    asyncio.run(result)
print("slow call returned", flush=True)
"""

JUDGE = """
import asyncio, time

def quick(completions, **kwargs):
    return [1.0] * len(completions)

def hangs(completions, **kwargs):
    time.sleep(3600)

async def hangs_async(completions, **kwargs):
    time.sleep(3600)  # blocks the event loop too: no asyncio timeout could fire
"""


@pytest.mark.parametrize("function", ["hangs", "hangs_async"])
def test_a_reward_call_past_its_deadline_ends_the_attempt_naming_the_function(function: str, tmp_path: Path):
    """A real process: the call that does not return within rewardTimeoutSeconds ends it with exit code 1 and last
    words (stderr, the termination log) that name the function and the field; one that returns in time leaves no
    timer behind."""
    import subprocess
    import sys
    import time

    (tmp_path / "judge.py").write_text(JUDGE)
    termination_log = tmp_path / "termination-log"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DEADLINE_SCRIPT, str(tmp_path), function, "1.5"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "GRPO_TERMINATION_LOG": str(termination_log)})
    took = time.monotonic() - started
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "quick call done" in done.stdout and "slow call returned" not in done.stdout
    said = f"reward function 'judge:{function}' did not return within spec.trainer.rewardTimeoutSeconds (1.5s)"
    assert said in done.stderr and said in termination_log.read_text()
    assert took < 60, took
