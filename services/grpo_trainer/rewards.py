"""Reward functions: built-ins by name and user functions by `module:function`.

All follow TRL's contract: `fn(prompts, completions, completion_ids, **columns,
trainer_state, ...) -> list[float | None]`, one value per completion. Each is
wrapped so that a function that raises, or returns the wrong number of values or
a value that is not a number, fails the run with the function's name (as written
in the spec) in the error; a user function TRL could not call with the spec's args
is refused when it is built.

A call that does not return within `spec.trainer.rewardTimeoutSeconds` ends the attempt (exit code 1, its
last words naming the function), so one hung function (a judge that never answers, a sandbox stuck in C)
costs that long, not the whole run: the next attempt, with a fresh server, tries again. The deadline is a
timer thread that ends the process, not the call moved to another thread: a function keeps running on the
thread TRL calls it on (signal-based time limits in reward code, such as math-verify's, work only there),
and a call stuck outside Python cannot be interrupted anyway.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import math
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_api.exit_codes import EXIT_FAILED, clip_final_message, write_termination_message
from grpo_api.models import RewardSpec
from grpo_trainer.errors import InvalidSpec, RewardFunctionFailed

log = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]

#: What TRL (GRPOTrainer._calculate_rewards) passes to every reward function, by keyword, besides one argument per
#: dataset column; a column of one of these names would clash with it (TypeError) or be replaced by TRL's value.
REWARD_CALL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
#: Dataset columns TRL keeps from the reward functions.
COLUMNS_NOT_PASSED = ("prompt", "completion", "completion_ids")


class RewardConfigError(InvalidSpec):
    """A reward in the spec cannot be built; the message names `spec.rewards[i]`, and the module's file and line
    when importing it fails."""


@dataclass(frozen=True)
class RewardContext:
    """What built-ins may need to know about the run."""

    max_completion_length: int
    dataset_columns: tuple[str, ...]
    #: spec.trainer.rewardTimeoutSeconds: the longest one call may take (None: no limit, e.g. the initializer's checks).
    timeout_seconds: float | None = None


def completion_text(completion: Any) -> str:
    """Text of a plain completion (str) or a conversational one ([{role: assistant, content}])."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


# ------------------------------------------------------------------------------------------- built-ins


def exact_match(
    completions: list[Any], *, column: str = "answer", strip: bool = True, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion equals the row's answer column, else 0.0; None (no reward) for a row whose
    answer is null (a JSONL line without the field)."""
    answers = kwargs[column]

    def norm(text: str) -> str:
        return text.strip() if strip else text

    return [
        None if a is None else 1.0 if norm(completion_text(c)) == norm(str(a)) else 0.0
        for c, a in zip(completions, answers, strict=True)
    ]


def regex_match(completions: list[Any], *, pattern: re.Pattern[str], fullmatch: bool = False,
                **_: Any) -> list[float]:
    """1.0 when the completion matches the pattern (search, or fullmatch), else 0.0."""
    match = pattern.fullmatch if fullmatch else pattern.search
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


def length_penalty(completion_ids: list[list[int]], *, max_length: int, target: int = 0,
                   **_: Any) -> list[float]:
    """-|tokens - target| / max_length: 0 at the target length, -1 a full max_length away."""
    return [-abs(len(ids) - target) / max_length for ids in completion_ids]


def token_fraction(completion_ids: list[list[int]], *, low: int, high: int, max_length: int,
                   **_: Any) -> list[float]:
    """Number of completion tokens with id in [low, high), divided by the maximum completion length.

    Dividing by the maximum (not the completion's own length) keeps a short
    completion with one lucky token from scoring 1.
    """
    return [sum(1 for t in ids if low <= t < high) / max_length for ids in completion_ids]


def _require_int(args: dict[str, Any], key: str, where: str) -> int:
    if key not in args:
        raise RewardConfigError(f"{where}.args.{key} is required")
    value = args[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise RewardConfigError(f"{where}.args.{key} must be an integer, got {value!r}")
    return value


def _optional_bool(args: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A flag as written (YAML true/false): bool("false") would be True."""
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise RewardConfigError(f"{where}.args.{key} must be true or false, got {value!r}")
    return value


def _require_str(args: dict[str, Any], key: str, where: str) -> str:
    value = args[key]
    if not isinstance(value, str):
        raise RewardConfigError(f"{where}.args.{key} must be a string, got {value!r}")
    return value


def _check_args(args: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise RewardConfigError(f"{where}.args: unknown argument(s) {unknown}; allowed: {sorted(allowed)}")


def _build_exact_match(args: dict[str, Any], ctx: RewardContext, where: str) -> RewardFunc:
    _check_args(args, {"column", "strip"}, where)
    column = str(args.get("column", "answer"))
    if column not in ctx.dataset_columns:
        raise RewardConfigError(
            f"{where} exact_match compares with column {column!r}, which the dataset lacks "
            f"(columns: {', '.join(ctx.dataset_columns)}); set {where}.args.column"
        )
    return functools.partial(exact_match, column=column, strip=_optional_bool(args, "strip", True, where))


def _build_regex_match(args: dict[str, Any], ctx: RewardContext, where: str) -> RewardFunc:
    _check_args(args, {"pattern", "fullmatch"}, where)
    if "pattern" not in args:
        raise RewardConfigError(f"{where}.args.pattern is required for regex_match")
    try:
        pattern = re.compile(_require_str(args, "pattern", where))
    except re.error as exc:
        raise RewardConfigError(f"{where}.args.pattern is not a valid regular expression: {exc}") from exc
    return functools.partial(regex_match, pattern=pattern, fullmatch=_optional_bool(args, "fullmatch", False, where))


def _build_length_penalty(args: dict[str, Any], ctx: RewardContext, where: str) -> RewardFunc:
    _check_args(args, {"target", "max_length"}, where)
    target = _require_int(args, "target", where) if "target" in args else 0
    max_length = _require_int(args, "max_length", where) if "max_length" in args else ctx.max_completion_length
    if max_length < 1:
        raise RewardConfigError(f"{where}.args.max_length must be at least 1")
    return functools.partial(length_penalty, max_length=max_length, target=target)


def _build_token_fraction(args: dict[str, Any], ctx: RewardContext, where: str) -> RewardFunc:
    _check_args(args, {"low", "high"}, where)
    low, high = _require_int(args, "low", where), _require_int(args, "high", where)
    if not 0 <= low < high:
        raise RewardConfigError(f"{where}.args: need 0 <= low < high, got low={low} high={high}")
    return functools.partial(token_fraction, low=low, high=high, max_length=ctx.max_completion_length)


BUILTINS: dict[str, Callable[[dict[str, Any], RewardContext, str], RewardFunc]] = {
    "exact_match": _build_exact_match,
    "regex_match": _build_regex_match,
    "length_penalty": _build_length_penalty,
    "token_fraction": _build_token_fraction,
}


# ---------------------------------------------------------------------------------------- user functions


def _not_found(exc: Exception, module_name: str) -> bool:
    """The module (or a package on its path) does not exist, as opposed to existing and failing to import."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return False
    return module_name == exc.name or module_name.startswith(exc.name + ".")


def _where_it_failed(exc: BaseException) -> str:
    """` (FILE line N)`: the syntax error's, else the line of the user's module that raised (the first frame
    past the import machinery); "" when there is none."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename} line {exc.lineno})"
    machinery = (__file__, importlib.__file__)
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename not in machinery and not frame.filename.startswith("<frozen "):
            return f" ({frame.filename} line {frame.lineno})"
    return ""


def import_user_function(path: str, search_paths: Sequence[Path], where: str) -> RewardFunc:
    """Import `module:function`, looking in search_paths (dataset dir, volume) before installed packages."""
    module_name, _, func_name = path.partition(":")
    for directory in reversed(search_paths):
        if directory.is_dir() and str(directory) not in sys.path:
            sys.path.insert(0, str(directory))
    field = f"{where}.function {path!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        if _not_found(exc, module_name):
            searched = ", ".join(str(p) for p in search_paths) or "no reward directory"
            raise RewardConfigError(
                f"{field}: cannot import module {module_name!r}: no such module in {searched} "
                "or the installed packages"
            ) from exc
        raise RewardConfigError(
            f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}{_where_it_failed(exc)}"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        found = getattr(module, "__file__", None) or module_name
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        has = f"; its functions: {', '.join(names[:10])}" if names else ""
        raise RewardConfigError(f"{field}: module {module_name!r} ({found}) has no callable {func_name!r}{has}")
    return func


def check_callable(func: RewardFunc, args: dict[str, Any], ctx: RewardContext, where: str, path: str) -> None:
    """Refuse, before training, a user function TRL cannot call with the spec's args: TRL passes
    REWARD_CALL_ARGUMENTS and one keyword per dataset column, so a function without **kwargs, or one that needs
    an argument nobody passes, would fail at every call of the first step (a retried, not a configuration,
    failure); and an arg of a name TRL passes would be silently replaced on every call."""
    passed = [*REWARD_CALL_ARGUMENTS, *(c for c in ctx.dataset_columns if c not in COLUMNS_NOT_PASSED)]
    for key in args:
        if key in passed:
            raise RewardConfigError(
                f"{where}.args.{key}: the trainer passes {key!r} to the function on every call "
                f"({'a dataset column' if key not in REWARD_CALL_ARGUMENTS else 'an argument of TRL'}), which "
                "would replace this value; rename the argument"
            )
    try:
        signature = inspect.signature(func, follow_wrapped=False)  # a decorator may filter what it passes on
    except (TypeError, ValueError):  # no signature to check (some built-in callables)
        return
    try:
        signature.bind(**dict.fromkeys([*passed, *args]))
    except TypeError as exc:
        raise RewardConfigError(
            f"{where}.function {path!r}: cannot be called as the trainer calls reward functions ({exc}): by "
            f"keyword, with {', '.join(passed)}{', ' if args else ''}{', '.join(args)}; take **kwargs for "
            "those it does not use"
        ) from exc


# -------------------------------------------------------------------------------------------- wrapping


def _reward_value(name: str, index: int, value: Any) -> float | None:
    """None, or a real number that is not infinite (NaN, like None, is no reward to TRL)."""
    if value is None:
        return None
    number: float | None = None
    if not isinstance(value, str | bytes | complex):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    if number is None or math.isinf(number):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RewardFunctionFailed(
            f"reward function {name!r} returned {shown} ({type(value).__name__}) at {index}: each reward must be "
            "a number (not infinite), or None for no reward"
        )
    return number


def _check_output(name: str, output: Any, expected: int) -> list[float | None]:
    if not isinstance(output, list | tuple):
        raise RewardFunctionFailed(
            f"reward function {name!r} returned {type(output).__name__}, expected a list of {expected} floats"
        )
    if len(output) != expected:
        raise RewardFunctionFailed(
            f"reward function {name!r} returned {len(output)} rewards for {expected} completions"
        )
    return [_reward_value(name, index, value) for index, value in enumerate(output)]


def _is_async(func: RewardFunc) -> bool:
    """Async functions, partials of them, and instances with an async __call__ (TRL awaits all three)."""
    if inspect.iscoroutinefunction(func):
        return True
    return not inspect.isroutine(func) and not isinstance(func, functools.partial) and (
        inspect.iscoroutinefunction(type(func).__call__)
    )


def _out_of_time(name: str, timeout: float) -> None:
    """The deadline of a reward call passed: end the attempt, in words that name the function and the field."""
    message = (f"reward function {name!r} did not return within spec.trainer.rewardTimeoutSeconds ({timeout:g}s): "
               "the attempt ends; the next one tries again")
    log.error("%s", message)
    print(message, file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        write_termination_message(clip_final_message(message))
    os._exit(EXIT_FAILED)  # the stuck call cannot be unwound; every other thread goes with the process


@contextlib.contextmanager
def _deadline(name: str, timeout: float | None) -> Iterator[None]:
    if timeout is None:
        yield
        return
    timer = threading.Timer(timeout, _out_of_time, args=(name, timeout))
    timer.daemon = True
    timer.name = f"reward-deadline-{name}"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def named_reward(name: str, func: RewardFunc, timeout: float | None = None) -> RewardFunc:
    """Wrap func so TRL logs it under `name`, its failures name it, and a call past `timeout` seconds ends the
    attempt (see the module's doc)."""
    if _is_async(func):

        async def async_wrapper(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
            try:
                with _deadline(name, timeout):
                    output = await func(prompts=prompts, completions=completions, **kwargs)
            except RewardFunctionFailed:
                raise
            except Exception as exc:
                raise RewardFunctionFailed(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
            return _check_output(name, output, len(completions))

        async_wrapper.__name__ = async_wrapper.__qualname__ = name
        return async_wrapper

    def wrapper(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            with _deadline(name, timeout):
                output = func(prompts=prompts, completions=completions, **kwargs)
        except RewardFunctionFailed:
            raise
        except Exception as exc:
            raise RewardFunctionFailed(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
        return _check_output(name, output, len(completions))

    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


def build_rewards(
    specs: Sequence[RewardSpec], ctx: RewardContext, search_paths: Sequence[Path]
) -> tuple[list[RewardFunc], list[float]]:
    """The wrapped reward functions and their weights, in spec order."""
    funcs: list[RewardFunc] = []
    names: set[str] = set()
    for index, spec in enumerate(specs):
        where = f"spec.rewards[{index}]"
        if ":" in spec.function:
            func = import_user_function(spec.function, search_paths, where)
            check_callable(func, spec.args, ctx, where, spec.function)
            if spec.args:
                func = functools.partial(func, **spec.args)
        elif spec.function in BUILTINS:
            func = BUILTINS[spec.function](dict(spec.args), ctx, where)
        else:
            raise RewardConfigError(
                f"{where}.function {spec.function!r} is not a built-in ({', '.join(BUILTINS)}) "
                "nor a module:function path"
            )
        name = spec.function if spec.function not in names else f"{spec.function}#{index}"
        names.add(name)
        funcs.append(named_reward(name, func, ctx.timeout_seconds))
    return funcs, [spec.weight for spec in specs]
