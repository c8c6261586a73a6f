"""A size-bounded log of served traffic (prompts and outputs), for `specdec distill --from-logs`.

Off unless a directory is given. Records are JSON lines in segment files
`traffic-000001.jsonl`, `traffic-000002.jsonl`, ...; a new segment starts when the current one
reaches a quarter of the bound, and the oldest segments are deleted once the directory holds
more than `max_bytes`. One record:

    {"time": 1718000000.0, "prompt": "text" | [{"role": "user", "content": "..."}],
     "output": "...", "meta": {"target": "smollm2-135m", ...}}

The target's outputs are its own samples, so they are on-policy distillation data as they are.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from specdec.errors import SpecdecError

DEFAULT_MAX_BYTES = 256 * 2**20
_SEGMENTS_PER_BOUND = 4
_NAME = re.compile(r"^traffic-(\d{6,})\.jsonl$")


class TrafficLog:
    """Appends records; thread-safe, so a server's request threads can share one."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1024:
            raise SpecdecError(f"the traffic log bound must be at least 1024 bytes, got {max_bytes}", "log_dir")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create the log directory {directory}: {e.strerror}", "log_dir") from None
        self.max_bytes = max_bytes
        self.segment_bytes = max(512, max_bytes // _SEGMENTS_PER_BOUND)
        self._lock = threading.Lock()

    def record(self, prompt: str | list[dict], output: str, meta: dict | None = None) -> None:
        line = json.dumps(
            {"time": round(time.time(), 3), "prompt": prompt, "output": output, "meta": meta or {}},
            ensure_ascii=False,
        ) + "\n"
        data = line.encode("utf-8")
        if len(data) > self.max_bytes:  # a record larger than the whole bound is not kept
            return
        with self._lock:
            segments = _segments(self.directory)
            current = segments[-1] if segments else None
            if current is None or current.stat().st_size + len(data) > self.segment_bytes:
                number = int(_NAME.match(current.name).group(1)) + 1 if current else 1
                current = self.directory / f"traffic-{number:06d}.jsonl"
                segments.append(current)
            with open(current, "ab") as f:
                f.write(data)
            self._enforce_bound(segments)

    def _enforce_bound(self, segments: list[Path]) -> None:
        sizes = [p.stat().st_size for p in segments]
        total = sum(sizes)
        for path, size in zip(segments[:-1], sizes[:-1], strict=True):  # never the one being written
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def _segments(directory: Path) -> list[Path]:
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def read_traffic(directory: str | os.PathLike) -> Iterator[dict]:
    """Yield the records of a log directory, oldest first. Malformed lines are skipped."""
    path = Path(directory)
    if not path.is_dir():
        raise SpecdecError(f"log directory not found: {directory}", "from_logs")
    for segment in _segments(path):
        with open(segment, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(rec, dict) and isinstance(rec.get("output"), str) and rec.get("prompt"):
                    yield rec
