"""`spec.rewardCode.inline` written into `sources.inline_rewards_dir` (`grpo run` only)."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

from grpo_api.runconfig import RunConfig
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.reporting import Reporter

_MODULE_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,100}\.py")


def write_inline_rewards(cfg: RunConfig, reporter: Reporter) -> None:
    """spec.rewardCode.inline into sources.inline_rewards_dir, each file atomically."""
    target = cfg.sources.inline_rewards_dir
    code = cfg.spec.reward_code
    if target is None or code is None or not code.inline:
        return
    directory = Path(target)
    for name in code.inline:
        if "/" in name or "\\" in name or ".." in name or not _MODULE_FILE.fullmatch(name):
            raise PrepareFailed(
                f"spec.rewardCode.inline: {name!r} is not a module file name such as my_rewards.py", permanent=True
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in code.inline.items():
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, directory / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        raise PrepareFailed(f"spec.rewardCode.inline: cannot write {directory}: {exc}", permanent=True) from exc
    reporter.progress(f"wrote {len(code.inline)} inline reward module(s) to {directory}")
