"""Request preparation off the event loop, in parallel: a small thread pool whose threads
each tokenize with their own copy of the tokenizer.

A Hugging Face fast tokenizer is a Rust object behind a RefCell: a call that changes its
settings (truncation, padding) while another thread encodes raises "Already borrowed". A
copy per thread shares nothing, so requests tokenize side by side without a global lock
(the model worker keeps the original for detokenizing).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

MAX_WORKERS = 4


class TokenizerPool:
    """`await pool.run(fn, *args)` runs fn in a pool thread; there `pool.local()` is that
    thread's tokenizer."""

    def __init__(self, tokenizer, workers: int | None = None):
        self.tokenizer = tokenizer
        self.workers = workers or max(1, min(MAX_WORKERS, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="specdec-tokenize")
        self._local = threading.local()

    def local(self):
        """This thread's own tokenizer (the original outside the pool's threads)."""
        if not threading.current_thread().name.startswith("specdec-tokenize"):
            return self.tokenizer
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:  # a tokenizer that cannot be copied is shared (pure Python ones are safe)
                tok = self.tokenizer
            self._local.tokenizer = tok
        return tok

    async def run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
