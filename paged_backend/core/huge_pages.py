"""Zeroed CPU tensors on transparent huge pages, for the KV pool.

Decode attention reads the pool's blocks in table order, which is random in memory: every 4 KiB page it touches is a
TLB miss and a page walk, and with 4 KiB pages a 32 KiB block spans eight of them. On 2 MiB pages the same reads
miss the TLB 512 times less often (the gain, measured: benchmarks/RESULTS.md, "The KV pool on 2 MiB pages"). Linux
hands out huge pages to a region that asks with madvise (the usual "madvise" mode of
/sys/kernel/mm/transparent_hugepage/enabled) or to all ("always"); elsewhere this is plain `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
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
