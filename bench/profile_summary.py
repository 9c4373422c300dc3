"""Summarise py-spy raw (collapsed) stacks: per process, where the samples fall.

    python bench/profile_summary.py bench/results/<dir>/server-stacks.txt [--top 15]

Each input line is `frame;frame;...;frame COUNT` (py-spy `--format raw`), the first
frame naming the process when py-spy ran with `--subprocesses`. Frames are grouped
by function and file (line numbers dropped). For every process it prints the share
of samples in each function as the innermost frame ("self") and anywhere on the
stack ("total").
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def short(frame: str) -> str:
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "/tmp/site/", "services/", "bench/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['func']} ({path})"


def summarise(lines: list[str], top: int) -> str:
    self_counts: dict[str, Counter[str]] = defaultdict(Counter)
    total_counts: dict[str, Counter[str]] = defaultdict(Counter)
    samples: Counter[str] = Counter()
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        process = "all"
        while frames and frames[0].startswith("process "):  # parent first, then the child that was sampled
            name = frames.pop(0)
            while name.count('"') % 2 and frames:  # a command line holding ';' was split: join it back
                name += ";" + frames.pop(0)
            process = name[:100]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        samples[process] += count
        self_counts[process][short(frames[-1])] += count
        for name in {short(f) for f in frames}:
            total_counts[process][name] += count
    out = []
    for process, n in samples.most_common():
        out.append(f"### {process}: {n} samples\n")
        out.append("| self | function |\n| ---: | --- |")
        out += [f"| {100 * c / n:.1f}% | `{name}` |" for name, c in self_counts[process].most_common(top)]
        out.append("\n| total | function |\n| ---: | --- |")
        out += [f"| {100 * c / n:.1f}% | `{name}` |" for name, c in total_counts[process].most_common(top)]
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in args.stacks:
        print(f"## {path}\n")
        print(summarise(path.read_text(errors="replace").splitlines(), args.top))


if __name__ == "__main__":
    main()
