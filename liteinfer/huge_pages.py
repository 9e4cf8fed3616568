"""Host memory on 2 MiB pages (Linux transparent huge pages) for what a CPU step streams through: the weights and
the KV pool.

A decode step of one sequence reads every weight once. On 4 KiB pages that is a TLB miss every 4 KiB, and the
hardware prefetcher stops at each page's end; on 2 MiB pages SmolLM2's int8 linears streamed ~15% faster from memory
(docs/benchmarks.md). Linux hands out huge pages only where a process asks for them (`madvise`) under the default of
most distributions (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and only for 2 MiB-aligned ranges,
which PyTorch's allocator does not align to; so the memory is allocated here, aligned and advised before it is first
touched. Where that is refused (not Linux, huge pages off) the memory stays on 4 KiB pages and nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_ALIGNMENT = 64  # each tensor's start in a shared region: PyTorch's own CPU alignment, a cache line
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # madvise, malloc_trim


def empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary, its whole huge pages advised before any use;
    under one huge page, a plain one (a huge page would hold mostly nothing: each pool of a tiny model's KV cache would
    take 2 MiB)."""
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # large enough to start `nbytes` on a boundary
    start = -raw.data_ptr() % HUGE_PAGE
    # Whole huge pages only: a partly used last one would be resident in full (60 KV pools of 34.1 MiB held ~120
    # MiB more); the tail stays on 4 KiB pages.
    _advise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on huge pages."""
    return empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()


def move(tensors: Iterable[torch.Tensor]) -> int:
    """Copy the storages behind `tensors` into one region on huge pages and point each tensor at its copy in place
    (`Tensor.set_`): every reference to them, a module's parameter or a quantized weight's field, sees the move.
    Tensors sharing a storage (a tied head, views) keep sharing it. Only dense CPU tensors move (oneDNN's opaque
    packed weights stay where they are). Returns the bytes moved: none when all of it fits in less than one huge
    page."""
    storages: dict[int, tuple[torch.UntypedStorage, dict[int, torch.Tensor]]] = {}
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_mkldnn:
            storage = tensor.untyped_storage()
            # by id: a tensor named twice (a parameter shared by two modules) is moved once
            storages.setdefault(storage.data_ptr(), (storage, {}))[1][id(tensor)] = tensor
    offsets, total = {}, 0
    for pointer, (storage, _) in storages.items():
        offsets[pointer] = total
        total += -(-storage.nbytes() // _ALIGNMENT) * _ALIGNMENT
    if total < HUGE_PAGE:  # not worth a huge page: left as they are
        return 0
    region = empty(total)
    base = region.storage_offset()  # bytes from the start of region's storage (a multiple of 64)
    with torch.no_grad():
        for pointer, offset in offsets.items():
            # Each old storage is let go as soon as its tensors have moved: the peak is the weights plus one storage
            # (the region's pages are taken as they are written), not twice the weights.
            storage, users = storages.pop(pointer)
            size = storage.nbytes()
            region[offset:offset + size].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,)))
            for tensor in users.values():
                byte_offset = base + offset + tensor.storage_offset() * tensor.element_size()
                tensor.set_(region.untyped_storage(), byte_offset // tensor.element_size(), tensor.size(),
                            tensor.stride())
            del storage, users
    _return_freed_memory()
    return total


def _advise(address: int, length: int) -> None:
    if _libc is not None and _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KiB pages", ctypes.get_errno())


def _return_freed_memory() -> None:
    """Hand the moved tensors' old memory back to the OS: glibc keeps freed blocks below its mmap threshold (up to
    32 MiB) in the heap, where they would stay resident (SmolLM2 int8, eager: 2,982 against 2,705 MiB after
    start-up)."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):  # glibc; musl has none
        _libc.malloc_trim(0)
