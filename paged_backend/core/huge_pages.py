"""Zeroed CPU tensors on transparent huge pages, for the KV pool.

Decode attention reads the pool's blocks in table order, which after a server's churn is scattered over the pool:
on 4 KiB pages a 32 KiB block spans eight pages, each likely a TLB miss and a page walk, and on a large pool the page
tables themselves fall out of cache. One 2 MiB page covers 512 of them (measured: a few percent per decode step,
benchmarks/RESULTS.md, "Why bf16 decode attention trails fp32 on this Xeon, and the KV pool on 2 MiB pages"). Linux
hands out huge pages to a region that asks with madvise (the usual "madvise" mode of
/sys/kernel/mm/transparent_hugepage/enabled) or to all ("always"); elsewhere this is plain `torch.zeros`.

Opt-in (`PAGED_BACKEND_KV_HUGE_PAGES=1`): the kernel assembles and clears 2 MiB pages more slowly than small ones, and
on the VM it was measured on a 512 MiB pool took 0.15-0.8 s to commit against 0.1-0.15 s, at every engine start.
A long-running server with long contexts gains; a short run or a test suite of many engines pays.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SWITCH = "PAGED_BACKEND_KV_HUGE_PAGES"  # "1": CPU KV pools on 2 MiB pages (kv_cache.pool_zeros)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether this kernel gives transparent huge pages to a region that asks (mode "always" or "madvise")."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU, on 2 MiB pages where the kernel offers them.

    The memory is an anonymous mapping, advised before its first touch (so the faults take huge pages) and then
    zeroed, which commits it now as torch.zeros would. The tensor holds the mapping; it is unmapped with the last
    tensor that views it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_offered():
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch (shmem_enabled)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # the slack: to start on a 2 MiB boundary
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor
