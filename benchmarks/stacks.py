"""Summarize a py-spy raw (collapsed-stack) file: per thread, the share of samples, and the
frames that hold the most of each thread's samples (inclusive), so one reads where a loaded
service's threads spend their time. benchmarks/serve_profile.sh writes the files.

    python3 benchmarks/stacks.py build/profile/serve-prefill.txt [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_THREAD = re.compile(r"^(?:process \d+:\S+;)?thread \((?P<id>[^)]*)\)")


def _key(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py:123)'."""
    where = re.search(r"\((?P<path>[^()]+):(?P<line>\d+)\)$", frame)
    if where is None:
        return frame
    name = frame[: where.start()].strip()
    return f"{name} ({Path(where.group('path')).name}:{where.group('line')})"


def summarize(path: Path, top: int) -> str:
    per_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread (")), "thread (?)")
        n = int(count)
        totals[thread] += n
        seen = set()
        key = "(no Python frame)"
        for frame in frames:
            if frame.startswith(("process ", "thread (")):
                continue
            key = _key(frame)
            if key not in seen:  # inclusive: once per stack
                seen.add(key)
                per_thread[thread][key] += n
        leaves[thread][key] += n
    grand = sum(totals.values()) or 1
    lines = [f"{path.name}: {grand} samples"]
    for thread, n in totals.most_common():
        lines.append(f"  {thread}: {n} samples ({100 * n / grand:.0f}%)")
        # Frames every stack of the thread passes through (its run loop) say nothing.
        inclusive = [(key, k) for key, k in per_thread[thread].most_common() if k < 0.995 * n]
        for key, k in inclusive[:top]:
            lines.append(f"      {100 * k / n:5.1f}%  {key}")
        lines.append("    self:")
        for key, k in leaves[thread].most_common(top // 2):
            lines.append(f"      {100 * k / n:5.1f}%  {key}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.files:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
