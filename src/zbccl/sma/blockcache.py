"""The SMA's size-class policy and its cache of freed blocks: pure bookkeeping, no lock, no I/O.

:class:`CachingAllocator` (``caching.py``) is the thread- and finalizer-safe
front end; it calls into a :class:`BlockCache` only while holding its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, ItemsView
from operator import index

from zbccl.errors import ZbcclInvalidUsageError

__all__ = ["BlockCache", "Record"]

#: What the allocator keeps per block: (size, requested, kind, seq).
Record = tuple[int, int, str, int]

# Requests up to this size are rounded to a multiple of the alignment only.
_EXACT_LIMIT = 4096
# Above it, each octave (2**k, 2**(k+1)] has 2**_CLASS_BITS classes: waste < 1/8.
_CLASS_BITS = 3
_STEP_BITS = _CLASS_BITS + 1


class BlockCache:
    """Size classes, and freed blocks kept per class for reuse.

    Size classes (:meth:`round_size`): up to ``max(4 KiB, 8 * alignment)`` the
    request rounded up to the alignment; above, 8 classes per octave (a request
    in ``(2**k, 2**(k+1)]`` rounds up to a multiple of ``2**(k-3)``), so a block
    exceeds its request by less than 12.5 %.

    Cached blocks are reused LIFO within a class (hot blocks first) and given
    back through ``release`` oldest first: beyond ``limit`` bytes, or on
    :meth:`evict`.

    Args:
        alignment: power of two; every size class is a multiple.
        limit: most bytes kept cached; None: no limit.
        release: hands a cached block's offset back to the arena.
    """

    def __init__(self, alignment: int, limit: int | None, release: Callable[[int], None]) -> None:
        self._mask = alignment - 1
        self._align_neg = -alignment
        self._exact_limit = max(_EXACT_LIMIT, alignment << _CLASS_BITS)
        self._limit = limit
        self._release = release
        self._stacks: dict[int, list[int]] = {}  # size class -> cached offsets, newest last
        # Every cached offset -> its last live record, oldest first (for the limit).
        self._records: OrderedDict[int, Record] = OrderedDict()
        self.nbytes = 0  # bytes of cached blocks

    def round_size(self, nbytes: int) -> int:
        """Size class of a request: the block size an allocation of ``nbytes`` reserves."""
        if nbytes <= self._exact_limit:
            if nbytes > 0:
                return (nbytes + self._mask) & self._align_neg
        elif type(nbytes) is int:
            # nbytes in (2**k, 2**(k+1)]: step 2**(k-3) >= alignment since nbytes > 8 * alignment.
            step = 1 << ((nbytes - 1).bit_length() - _STEP_BITS)
            return (nbytes + step - 1) & -step
        nbytes = index(nbytes)  # numpy integers and the like; floats raise TypeError
        if nbytes < 1:
            raise ZbcclInvalidUsageError(f"round_size: bad size, expected nbytes >= 1, got {nbytes}")
        return self.round_size(nbytes)

    def take(self, size: int) -> int | None:
        """The newest cached block of class ``size``, removed from the cache; None if there is none."""
        stack = self._stacks.get(size)
        if not stack:
            return None
        offset = stack.pop()
        del self._records[offset]
        self.nbytes -= size
        return offset

    def put(self, offset: int, rec: Record) -> None:
        """Cache a freed block (``rec[0]`` is its class), then keep to the limit."""
        size = rec[0]
        stack = self._stacks.get(size)
        if stack is None:
            stack = self._stacks[size] = []
        stack.append(offset)
        self._records[offset] = rec
        self.nbytes += size
        if self._limit is not None and self.nbytes > self._limit:
            self.evict(until=self._limit)

    def evict(self, *, until: int = 0) -> None:
        """Release the oldest cached blocks until at most ``until`` bytes stay cached."""
        records = self._records
        while records and self.nbytes > until:
            offset, rec = records.popitem(last=False)
            # The globally oldest block is also the oldest of its class: stacks only pop at the end.
            stack = self._stacks[rec[0]]
            assert stack[0] == offset
            del stack[0]
            self._release(offset)
            self.nbytes -= rec[0]

    def __contains__(self, offset: int) -> bool:
        return offset in self._records

    def __len__(self) -> int:
        return len(self._records)

    def items(self) -> ItemsView[int, Record]:
        """(offset, last live record) of every cached block, oldest first."""
        return self._records.items()

    def check(self) -> None:
        """Class stacks and byte count agree with the records; AssertionError otherwise."""
        by_class = {off: size for size, stack in self._stacks.items() for off in stack}
        assert by_class == {off: rec[0] for off, rec in self._records.items()}, "class stacks drifted"
        assert self.nbytes == sum(by_class.values()), "cached_bytes drifted"
