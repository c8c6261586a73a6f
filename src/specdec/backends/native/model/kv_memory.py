"""KV memory that is committed as tokens are held, not when the cache is made.

A pool's cache keeps the layout the attention kernels read ([layers, slots, ...] by position),
so a slot's keys stay one strided block and no kernel gathers pages. The memory behind it is a
private anonymous mapping: the kernel of the operating system hands out a zeroed 4 KiB page on
the first write to it, so a slot costs what its tokens touch and an idle window costs address
space only (the idea of vAttention, Prabhu et al. 2024, on the CPU's own demand paging). A
released slot's pages go back to the system (`madvise(MADV_DONTNEED)`) and read as zeros again.

Elsewhere (a GPU, a system without Linux's mapping flags) the tensor is allocated whole."""

from __future__ import annotations

import math
import mmap
import sys

import torch

PAGE = mmap.PAGESIZE
# Linux's value of MAP_NORESERVE (Python's mmap module does not export it): the window is
# address space, so the kernel should not count it against the commit limit up front.
_MAP_NORESERVE = 0x4000


class LazyTensor:
    """A zero-filled tensor whose pages are committed on first write (on a Linux CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device=None):
        device = torch.device(device if device is not None else "cpu")
        self.shape, self.dtype = tuple(shape), dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.nbytes = math.prod(shape) * self.itemsize
        self.lazy = device.type == "cpu" and sys.platform == "linux" and self.nbytes > 0
        if not self.lazy:
            self._map = None
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        self._map.madvise(mmap.MADV_NOHUGEPAGE)  # a 2 MiB page would commit ~1k tokens of every row at once
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)

    def release(self, first: int, count: int) -> None:
        """Give back the pages lying wholly inside elements first .. first + count of the
        flat tensor; they read as zeros afterwards. A no-op where the tensor is not lazy."""
        if not self.lazy or count <= 0:
            return
        start = -(-first * self.itemsize // PAGE) * PAGE  # rounded inward to whole pages
        end = (first + count) * self.itemsize // PAGE * PAGE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def resident_bytes() -> int:
    """This process's resident memory, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


def committed_bytes(row_bytes: int, rows: int) -> int:
    """What `rows` rows of which the first `row_bytes` bytes were written commit, page by page
    (a row starting mid-page is counted as if aligned: an estimate, never below the truth by
    more than a page a row)."""
    return rows * -(-row_bytes // PAGE) * PAGE if row_bytes > 0 else 0
