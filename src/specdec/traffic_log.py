"""A size-bounded log of served traffic (prompts and outputs), for `specdec distill --from-logs`.

Off unless a directory is given. Records are JSON lines in segment files
`traffic-000001.jsonl`, `traffic-000002.jsonl`, ...; a new segment starts when the current one
reaches a quarter of the bound, and the oldest segments are deleted once the directory holds
more than `max_bytes`. One record:

    {"time": 1718000000.0, "prompt": "text" | [{"role": "user", "content": "..."}],
     "output": "...", "meta": {"target": "smollm2-135m", ...}}

The target's outputs are its own samples, so they are on-policy distillation data as they are.
The server writes through `QueuedTrafficLog`: a request handler only queues its record
(bounded; a full queue drops it), and one writer thread serializes and writes, so a slow or
stuck disk never blocks the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from specdec.errors import SpecdecError

log = logging.getLogger("specdec.server")
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MAX_PENDING = 1024
_SEGMENTS_PER_BOUND = 4
_NAME = re.compile(r"^traffic-(\d{6,})\.jsonl$")


class TrafficLog:
    """Appends records; thread-safe, so a server's request threads can share one."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1024:
            raise SpecdecError(f"the traffic log bound must be at least 1024 bytes, got {max_bytes}",
                               "log_dir")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create the log directory {directory}: {e.strerror}",
                               "log_dir") from None
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


class QueuedTrafficLog:
    """A TrafficLog written by its own thread. `record` never blocks: it queues the record
    and returns False when `max_pending` records already wait (the record is dropped and
    counted in `dropped`). `prompt` may be a zero-argument callable, called by the writer
    (detokenizing a prompt given as ids is work the caller need not do)."""

    def __init__(self, log_: TrafficLog, max_pending: int = DEFAULT_MAX_PENDING):
        self.log = log_
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._write_forever, name="specdec-traffic-log", daemon=True)
        self._thread.start()

    def record(self, prompt, output: str, meta: dict | None = None) -> bool:
        try:
            self._queue.put_nowait((prompt, output, meta))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("traffic log: the writer is behind; %d records dropped so far", self.dropped)
            return False
        return True

    def _write_forever(self) -> None:
        while (item := self._queue.get()) is not None:
            prompt, output, meta = item
            try:
                self.log.record(prompt() if callable(prompt) else prompt, output, meta)
            except Exception as e:  # a full disk or a bad record must not stop the writer
                log.warning("traffic log write failed: %s", e)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (waiting at most `timeout` seconds), then stop the writer."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the writer is stuck (a hung disk): it is a daemon thread, leave it
        self._thread.join(timeout)


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
