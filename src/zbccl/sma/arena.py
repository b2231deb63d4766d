"""Offset allocator over ``[0, size)``: pure arithmetic, no memory is touched.

The arena hands out aligned offsets into a range it never reads or writes, so it
can be fuzz-tested anywhere and placed over any heap (shared memory, device
memory, a simulated range).

Placement (after ZBAL's ``SplitMemoryHeap``, with its gaps fixed):

* Free blocks sit in segregated lists binned by size: one bin per alignment unit
  below 16 units, then 8 bins per octave, so a bin's blocks differ by < 12.5 %.
  A bitmask of non-empty bins finds the next bin that can serve a request with a
  few integer operations.
* Small requests (below ``small_threshold``) take the best fit: the smallest
  free block that holds the request, looking only at the request's own bin and,
  if that has none large enough, the first non-empty bin above it (all of whose
  blocks fit). Each bin is a list sorted by (size, start), so the search is a
  bisection, not a scan, even when thousands of similar holes share a bin. The
  block is carved from its low end; equal fits prefer the lowest address.
* Large requests take the *highest-addressed* free block that holds them
  (address-ordered first fit, from the top) and are carved from its high end.
  Large blocks therefore stay packed against the top of the arena: blocks
  allocated while every earlier large block is still live form one contiguous
  run ending at the top, and the free space below them is one range (the
  "stack" guarantee the caching front end relies on, see ``caching.py``).
  Small and large blocks grow from opposite ends, so short-lived small blocks
  do not pin holes inside the region large blocks need.
* The arena can be extended at the top (:meth:`Arena.extend`, heap growth); the
  new range merges with a free block that ends at the old top.
* Freed blocks merge with free neighbours in O(1) (free blocks are indexed by
  start and by end), so no two free blocks are ever adjacent.
* Alignment is at least 64 bytes (ZBAL's 32 B misaligned vector loads).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

from zbccl.errors import ZbcclInvalidUsageError

__all__ = ["Arena"]

_MIN_ALIGNMENT = 64
# Below this many alignment units every size has its own bin; above it each
# octave is split into 1 << _SUB_BITS bins.
_SUB_BITS = 3
_EXACT_UNITS = 1 << (_SUB_BITS + 1)
# A free block is keyed ``size << _KEY_SHIFT | start`` in its bin's sorted list, so
# the list orders blocks by (size, start) with plain integer comparisons.
_KEY_SHIFT = 64
_START_MASK = (1 << _KEY_SHIFT) - 1


def _bin_index(units: int) -> int:
    """Bin of a block of ``units`` alignment units (monotonic in ``units``)."""
    if units < _EXACT_UNITS:
        return units
    shift = units.bit_length() - (_SUB_BITS + 1)
    return (shift << _SUB_BITS) + (units >> shift)


class Arena:
    """Offset allocator over ``[0, size)``: small blocks best fit from the bottom, large ones from the top.

    Not thread-safe: :class:`zbccl.sma.CachingAllocator` serialises access.

    Args:
        size: bytes the arena covers; the usable size is ``size`` rounded down to ``alignment``.
        alignment: power of two >= 64; every offset and block size is a multiple of it.
        small_threshold: requests of at least this many bytes are placed from the high end.
    """

    def __init__(self, size: int, *, alignment: int = 64, small_threshold: int = 1 << 20) -> None:
        if alignment < _MIN_ALIGNMENT or alignment & (alignment - 1):
            raise ZbcclInvalidUsageError(
                f"Arena: bad alignment, expected a power of two >= {_MIN_ALIGNMENT}, got {alignment}"
            )
        if size < 0:
            raise ZbcclInvalidUsageError(f"Arena: bad size, expected >= 0, got {size}")
        if small_threshold < 0:
            raise ZbcclInvalidUsageError(f"Arena: bad small_threshold, expected >= 0, got {small_threshold}")
        self._alignment = alignment
        self._mask = alignment - 1
        self._shift = alignment.bit_length() - 1
        self._size = size & ~self._mask
        self._small_threshold = small_threshold
        self._used: dict[int, int] = {}  # start -> size of live blocks
        self._free_by_start: dict[int, int] = {}  # start -> size
        self._free_by_end: dict[int, int] = {}  # end -> start
        self._free_starts: list[int] = []  # sorted starts of free blocks (large requests scan from the top)
        nbins = _bin_index(max(self._size >> self._shift, 1)) + 1
        self._bins: list[list[int]] = [[] for _ in range(nbins)]  # sorted keys, see _KEY_SHIFT
        self._nonempty = 0  # bit b set <=> self._bins[b] is non-empty
        self._used_bytes = 0
        if self._size:
            self._insert_free(0, self._size)

    # -- free-list maintenance -------------------------------------------------

    def _insert_free(self, start: int, size: int) -> None:
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start
        insort(self._free_starts, start)
        b = _bin_index(size >> self._shift)
        insort(self._bins[b], size << _KEY_SHIFT | start)
        self._nonempty |= 1 << b

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        starts = self._free_starts
        del starts[bisect_left(starts, start)]
        b = _bin_index(size >> self._shift)
        bucket = self._bins[b]
        del bucket[bisect_left(bucket, size << _KEY_SHIFT | start)]
        if not bucket:
            self._nonempty &= ~(1 << b)

    def _best_in_bin(self, b: int, need: int) -> int | None:
        """Start of the smallest block in bin ``b`` holding ``need`` bytes (lowest address among equals)."""
        bucket = self._bins[b]
        i = bisect_left(bucket, need << _KEY_SHIFT)
        if i == len(bucket):
            return None
        return bucket[i] & _START_MASK

    def _best_fit(self, need: int) -> int | None:
        b = _bin_index(need >> self._shift)
        start = self._best_in_bin(b, need) if self._nonempty >> b & 1 else None
        if start is None:
            above = self._nonempty >> (b + 1)
            if not above:
                return None
            # Every block in a higher bin is larger than ``need``.
            start = self._best_in_bin(b + (above & -above).bit_length(), need)
            assert start is not None
        return start

    def _highest_fit(self, need: int) -> int | None:
        """Start of the highest-addressed free block holding ``need`` bytes."""
        if self.largest_free_block < need:
            return None
        by_start = self._free_by_start
        for start in reversed(self._free_starts):  # the top few blocks usually fit: large ones live there
            if by_start[start] >= need:
                return start
        raise AssertionError("largest_free_block fits but no free block does")  # pragma: no cover

    # -- public API --------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Reserve ``round_up(nbytes, alignment)`` bytes; return their aligned offset, or None if nothing fits."""
        if nbytes < 1:
            raise ZbcclInvalidUsageError(f"Arena.alloc: bad size, expected nbytes >= 1, got {nbytes}")
        need = (nbytes + self._mask) & ~self._mask
        if need > self._size:
            return None
        high = need >= self._small_threshold
        start = self._highest_fit(need) if high else self._best_fit(need)
        if start is None:
            return None
        size = self._free_by_start[start]
        self._remove_free(start, size)
        rest = size - need
        if high:
            offset = start + rest
            if rest:
                self._insert_free(start, rest)
        else:
            offset = start
            if rest:
                self._insert_free(start + need, rest)
        self._used[offset] = need
        self._used_bytes += need
        return offset

    def free(self, offset: int) -> int:
        """Release the block at ``offset``, merging it with free neighbours; return its size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ZbcclInvalidUsageError(
                f"Arena.free: offset {offset} is not a live block (unknown offset or double free), "
                f"expected the offset of a live block, got {offset}"
            )
        self._used_bytes -= size
        start, end = offset, offset + size
        next_size = self._free_by_start.get(end)
        if next_size is not None:
            self._remove_free(end, next_size)
            end += next_size
        prev_start = self._free_by_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        self._insert_free(start, end - start)
        return size

    def extend(self, new_size: int) -> None:
        """Grow the arena to ``[0, new_size)`` (rounded down to the alignment); the new range is free.

        It merges with a free block ending at the old top. Shrinking is refused.
        """
        new = new_size & ~self._mask
        if new < self._size:
            raise ZbcclInvalidUsageError(
                f"Arena.extend: cannot shrink, expected new_size >= {self._size}, got {new_size}"
            )
        if new == self._size:
            return
        nbins = _bin_index(max(new >> self._shift, 1)) + 1
        self._bins.extend([] for _ in range(nbins - len(self._bins)))
        start = self._size
        prev_start = self._free_by_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        self._size = new
        self._insert_free(start, new - start)

    def block_size(self, offset: int) -> int:
        """Size in bytes of the live block at ``offset``."""
        size = self._used.get(offset)
        if size is None:
            raise ZbcclInvalidUsageError(
                f"Arena.block_size: unknown offset {offset}, expected the offset of a live block, got {offset}"
            )
        return size

    @property
    def size(self) -> int:
        """Usable bytes: the constructor's size rounded down to the alignment."""
        return self._size

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def small_threshold(self) -> int:
        return self._small_threshold

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._size - self._used_bytes

    @property
    def largest_free_block(self) -> int:
        """Size of the largest free block (0 when full): the last entry of the highest non-empty bin."""
        if not self._nonempty:
            return 0
        return self._bins[self._nonempty.bit_length() - 1][-1] >> _KEY_SHIFT

    @property
    def free_tail(self) -> int:
        """Size of the free block ending at the top of the arena (0 if the top block is in use)."""
        start = self._free_by_end.get(self._size)
        return 0 if start is None else self._size - start

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_by_start)

    def used_blocks(self) -> Iterator[tuple[int, int]]:
        """``(offset, size)`` of live blocks, sorted by offset (a snapshot)."""
        return iter(sorted(self._used.items()))

    def free_blocks(self) -> Iterator[tuple[int, int]]:
        """``(offset, size)`` of free blocks, sorted by offset (a snapshot)."""
        return iter(sorted(self._free_by_start.items()))

    def check(self) -> None:
        """Verify every internal invariant; raise AssertionError on the first broken one."""
        blocks = sorted(
            [(s, n, False) for s, n in self._used.items()]
            + [(s, n, True) for s, n in self._free_by_start.items()]
        )
        pos = 0
        prev_free = False
        for start, size, is_free in blocks:
            assert start == pos, f"gap or overlap at {pos}: next block starts at {start}"
            assert size > 0 and not size & self._mask and not start & self._mask, (start, size)
            assert not (prev_free and is_free), f"adjacent free blocks meet at {start}"
            pos, prev_free = start + size, is_free
        assert pos == self._size, f"blocks end at {pos}, arena size is {self._size}"
        assert self._used_bytes == sum(self._used.values()), "used_bytes counter drifted"
        assert self._free_by_end == {s + n: s for s, n in self._free_by_start.items()}, "end index drifted"
        assert self._free_starts == sorted(self._free_by_start), "start index drifted"
        binned: dict[int, int] = {}
        for b, bucket in enumerate(self._bins):
            assert bool(bucket) == bool(self._nonempty >> b & 1), f"non-empty mask wrong at bin {b}"
            assert bucket == sorted(bucket), f"bin {b} is not sorted"
            for key in bucket:
                start, size = key & _START_MASK, key >> _KEY_SHIFT
                assert _bin_index(size >> self._shift) == b, f"block {start} of {size} B in bin {b}"
                binned[start] = size
        assert self._nonempty >> len(self._bins) == 0, "mask has bits past the last bin"
        assert binned == self._free_by_start, "bins disagree with the free index"
        assert sum(map(len, self._bins)) == len(binned), "a free block is binned twice"
