"""Policy models of PyTorch's CUDACachingAllocator, written from its documented constants and rules.

They place no memory: they keep the allocator's bookkeeping (segments, blocks, pools) so a trace replays
against them at any scale, and they expose the same face as ``vmalloc.Arena`` (``malloc``, ``free``,
``stats``, ``empty_cache``) with the same stat names, so one replay loop drives every allocator.

Sources (c10/cuda/CUDACachingAllocator.cpp): kMinBlockSize = 512, kSmallSize = 1 MiB, kSmallBuffer = 2 MiB,
kMinLargeAlloc = 10 MiB, kLargeBuffer = 20 MiB, kRoundLarge = 2 MiB; best fit per (stream, size) in a small
and a large pool; should_split; max_split_size; free-cached-blocks-and-retry before OOM; and, for
expandable_segments, one growable segment per stream and pool, mapped in 2 MiB (small) / 20 MiB (large)
pages, with fully free pages unmapped on OOM and empty_cache.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional

from vmalloc import OutOfMemoryError

KiB, MiB = 1024, 1024 * 1024
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_LARGE_BUFFER = 20 * MiB
K_ROUND_LARGE = 2 * MiB


def round_size(size: int) -> int:
    """512 B rounding (roundup_power2_divisions unset, the default)."""
    return K_MIN_BLOCK if size < K_MIN_BLOCK else K_MIN_BLOCK * math.ceil(size / K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """Segment size cudaMalloc'ed for a request that no cached block serves (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * math.ceil(size / K_ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    stream: int
    small: bool
    segment: _Segment
    allocated: bool = False
    requested: int = 0
    prev: Optional[_Block] = None
    next: Optional[_Block] = None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


@dataclass(eq=False)
class _Segment:
    addr: int
    size: int
    stream: int
    small: bool
    head: Optional[_Block] = None
    blocks: list = field(default_factory=list)


class _Pool:
    """Free blocks ordered by (stream, size, address), as PyTorch's BlockPool set."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}

    def add(self, b: _Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: _Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        del self.keys[i]
        del self.blocks[k]

    def best_fit(self, stream: int, size: int) -> Optional[_Block]:
        i = bisect.bisect_left(self.keys, (stream, size, -1))
        if i < len(self.keys) and self.keys[i][0] == stream:
            return self.blocks[self.keys[i]]
        return None


class _Stats:
    def __init__(self) -> None:
        self.v: dict[str, int] = {}

    def add(self, name: str, n: int) -> None:
        cur = self.v.get(name + ".all.current", 0) + n
        self.v[name + ".all.current"] = cur
        self.v[name + ".all.peak"] = max(self.v.get(name + ".all.peak", 0), cur)
        key = ".all.allocated" if n >= 0 else ".all.freed"
        self.v[name + key] = self.v.get(name + key, 0) + abs(n)

    def count(self, name: str, n: int = 1) -> None:
        self.v[name] = self.v.get(name, 0) + n

    def get(self, name: str) -> int:
        return self.v.get(name, 0)

    def reset_peak(self) -> None:
        for key in [k for k in self.v if k.endswith(".all.peak")]:
            self.v[key] = self.v.get(key[: -len(".all.peak")] + ".all.current", 0)


class NativeCachingModel:
    """PyTorch's default caching allocator: cudaMalloc'ed segments split best-fit, per stream.

    ``capacity`` plays the device: cudaMalloc fails when the segments would exceed it. ``max_split_size``
    mirrors ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`` (None: unlimited, the default).
    """

    name = "pytorch_native"

    def __init__(self, capacity: int, max_split_size: Optional[int] = None) -> None:
        self.capacity = int(capacity)
        self.max_split = max_split_size if max_split_size is not None else 2**62
        self.small_pool = _Pool()
        self.large_pool = _Pool()
        self.live: dict[int, _Block] = {}
        self.segments: dict[int, _Segment] = {}
        self.reserved = 0
        self._next_addr = 1 << 40
        self.stats_ = _Stats()
        for k in ("num_alloc", "num_free", "num_ooms", "num_alloc_retries", "num_device_alloc", "num_device_free"):
            self.stats_.count(k, 0)

    # -- allocation -------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        if nbytes == 0:
            return 0
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = self.small_pool if small else self.large_pool
        block = self._get_free_block(pool, stream, size, small)
        if block is None:
            block = self._alloc_segment(stream, size, small)
        if block is None:
            # release_cached_blocks: free every fully free segment, then try cudaMalloc once more.
            self.stats_.count("num_alloc_retries")
            self._release_cached_blocks()
            block = self._alloc_segment(stream, size, small)
        if block is None:
            self.stats_.count("num_ooms")
            raise OutOfMemoryError(
                f"{self.name}: out of memory allocating {nbytes} bytes; allocated "
                f"{self.stats_.get('allocated_bytes.all.current')}, reserved {self.reserved}, capacity {self.capacity}"
            )
        if pool.blocks.get(block.key()) is block:
            pool.remove(block)
        if self._should_split(block, size):
            rest = _Block(
                block.addr + size, block.size - size, stream, small, block.segment, prev=block, next=block.next
            )
            if block.next:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        block.requested = nbytes
        self.live[block.addr] = block
        self.stats_.add("requested_bytes", nbytes)
        self.stats_.add("allocated_bytes", block.size)
        self.stats_.add("active_bytes", block.size)
        self.stats_.add("allocation", 1)
        self.stats_.count("num_alloc")
        return block.addr

    def _get_free_block(self, pool: _Pool, stream: int, size: int, small: bool) -> Optional[_Block]:
        b = pool.best_fit(stream, size)
        if b is None:
            return None
        if not small:
            # Oversize blocks (>= max_split_size) never serve smaller requests, and serve larger ones only
            # within kLargeBuffer.
            if size < self.max_split and b.size >= self.max_split:
                return None
            if size >= self.max_split and b.size >= size + K_LARGE_BUFFER:
                return None
        return b

    def _alloc_segment(self, stream: int, size: int, small: bool) -> Optional[_Block]:
        seg_size = allocation_size(size)
        if self.reserved + seg_size > self.capacity:
            return None
        addr = self._next_addr
        self._next_addr += seg_size + K_LARGE_BUFFER
        seg = _Segment(addr, seg_size, stream, small)
        block = _Block(addr, seg_size, stream, small, seg)
        seg.head = block
        self.segments[addr] = seg
        self.reserved += seg_size
        self.stats_.add("reserved_bytes", seg_size)
        self.stats_.add("segment", 1)
        self.stats_.count("num_device_alloc")
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _release_cached_blocks(self) -> None:
        for addr, seg in list(self.segments.items()):
            b = seg.head
            if b is not None and not b.allocated and b.next is None and b.prev is None:
                (self.small_pool if seg.small else self.large_pool).remove(b)
                del self.segments[addr]
                self.reserved -= seg.size
                self.stats_.add("reserved_bytes", -seg.size)
                self.stats_.add("segment", -1)
                self.stats_.count("num_device_free")

    # -- free -------------------------------------------------------------------------------------------
    def free(self, addr: int) -> None:
        if addr == 0:
            return
        block = self.live.pop(addr, None)
        if block is None:
            raise ValueError(f"{self.name}: free of {addr:#x}, which is not a live allocation")
        self.stats_.add("requested_bytes", -block.requested)
        self.stats_.add("allocated_bytes", -block.size)
        self.stats_.add("active_bytes", -block.size)
        self.stats_.add("allocation", -1)
        self.stats_.count("num_free")
        block.allocated = False
        block.requested = 0
        pool = self.small_pool if block.small else self.large_pool
        for neighbour in (block.prev, block.next):  # try_merge_blocks
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next:
                        block.next.prev = neighbour
                    if block.segment.head is block:
                        block.segment.head = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next:
                        neighbour.next.prev = block
        pool.add(block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    def reset_peak_stats(self) -> None:
        self.stats_.reset_peak()

    def stats(self) -> dict[str, int]:
        s = dict(self.stats_.v)
        s["capacity"] = self.capacity
        s["reserved_bytes.all.current"] = self.reserved
        return s


class ExpandableSegmentsModel:
    """``expandable_segments:True``: per (stream, pool) one virtual segment that grows by mapping pages
    (2 MiB for the small pool, 20 MiB for the large pool) at its end; blocks are split best fit inside it,
    free pages are unmapped when an allocation would otherwise fail, and on empty_cache.

    Modelled as a page-granular address space per (stream, pool): a request takes the best-fitting free run
    of mapped bytes, else maps pages at the lowest free address past the mapped part.
    """

    name = "pytorch_expandable"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.mapped = 0
        self.live: dict[int, tuple[tuple[int, bool], int, int, int]] = {}  # addr -> (key, size, requested, page)
        self.spaces: dict[tuple[int, bool], dict] = {}
        self._next_base = 1 << 40
        self.stats_ = _Stats()
        for k in ("num_alloc", "num_free", "num_ooms", "num_alloc_retries", "num_maps", "num_unmaps"):
            self.stats_.count(k, 0)

    def _space(self, stream: int, small: bool) -> dict:
        key = (stream, small)
        if key not in self.spaces:
            self.spaces[key] = {
                "base": self._next_base,
                "page": K_SMALL_BUFFER if small else K_LARGE_BUFFER,
                "used": [],
                "mapped_pages": set(),
            }
            self._next_base += 1 << 44
        return self.spaces[key]

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        if nbytes == 0:
            return 0
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        sp = self._space(stream, small)
        addr = self._fit(sp, size, mapped_only=True)
        if addr is None:
            addr = self._fit(sp, size, mapped_only=False)
            if addr is not None and not self._map_range(sp, addr, size):
                self.stats_.count("num_alloc_retries")
                self._unmap_free_pages()
                if not self._map_range(sp, addr, size):
                    self.stats_.count("num_ooms")
                    raise OutOfMemoryError(
                        f"{self.name}: out of memory allocating {nbytes} bytes; mapped {self.mapped}, "
                        f"capacity {self.capacity}"
                    )
        bisect.insort(sp["used"], (addr, size))
        self.live[addr] = ((stream, small), size, nbytes, sp["page"])
        self.stats_.add("requested_bytes", nbytes)
        self.stats_.add("allocated_bytes", size)
        self.stats_.add("active_bytes", size)
        self.stats_.add("allocation", 1)
        self.stats_.count("num_alloc")
        return addr

    def _gaps(self, sp: dict):
        cursor = sp["base"]
        for a, s in sp["used"]:
            if a > cursor:
                yield cursor, a - cursor
            cursor = max(cursor, a + s)
        yield cursor, None  # unbounded tail

    def _fit(self, sp: dict, size: int, mapped_only: bool) -> Optional[int]:
        page = sp["page"]
        best = None
        for start, length in self._gaps(sp):
            if length is not None and length < size:
                continue
            if mapped_only:
                first, last = (start - sp["base"]) // page, (start + size - 1 - sp["base"]) // page
                if not all(p in sp["mapped_pages"] for p in range(first, last + 1)):
                    continue
                if best is None or (length or 2**63) < best[1]:
                    best = (start, length or 2**63)
            else:
                return start  # lowest address: new pages go to the lowest free place (re-merges splits)
        return best[0] if best else None

    def _map_range(self, sp: dict, addr: int, size: int) -> bool:
        page = sp["page"]
        first, last = (addr - sp["base"]) // page, (addr + size - 1 - sp["base"]) // page
        new = [p for p in range(first, last + 1) if p not in sp["mapped_pages"]]
        if self.mapped + len(new) * page > self.capacity:
            return False
        sp["mapped_pages"].update(new)
        self.mapped += len(new) * page
        self.stats_.add("reserved_bytes", len(new) * page)
        self.stats_.count("num_maps", len(new))
        return True

    def _unmap_free_pages(self) -> None:
        for sp in self.spaces.values():
            page, base = sp["page"], sp["base"]
            busy = set()
            for a, s in sp["used"]:
                busy.update(range((a - base) // page, (a + s - 1 - base) // page + 1))
            free = sp["mapped_pages"] - busy
            sp["mapped_pages"] -= free
            self.mapped -= len(free) * page
            self.stats_.add("reserved_bytes", -len(free) * page)
            self.stats_.count("num_unmaps", len(free))

    def free(self, addr: int) -> None:
        if addr == 0:
            return
        entry = self.live.pop(addr, None)
        if entry is None:
            raise ValueError(f"{self.name}: free of {addr:#x}, which is not a live allocation")
        key, size, requested, _ = entry
        sp = self.spaces[key]
        sp["used"].remove((addr, size))
        self.stats_.add("requested_bytes", -requested)
        self.stats_.add("allocated_bytes", -size)
        self.stats_.add("active_bytes", -size)
        self.stats_.add("allocation", -1)
        self.stats_.count("num_free")

    def empty_cache(self) -> None:
        self._unmap_free_pages()

    def reset_peak_stats(self) -> None:
        self.stats_.reset_peak()

    def stats(self) -> dict[str, int]:
        s = dict(self.stats_.v)
        s["capacity"] = self.capacity
        s["reserved_bytes.all.current"] = self.mapped
        return s
