"""BlockCache on its own: size classes, LIFO reuse per class, oldest-first release."""

from __future__ import annotations

import pytest

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.sma import BlockCache


def test_round_size_classes():
    c = BlockCache(64, None, lambda off: None)
    assert [c.round_size(n) for n in (1, 64, 65, 4096)] == [64, 64, 128, 4096]
    assert c.round_size(4097) == 4608 and c.round_size(1 << 20) == 1 << 20  # 8 classes per octave
    with pytest.raises(ZbcclInvalidUsageError, match="nbytes >= 1"):
        c.round_size(0)


def test_lifo_per_class_and_oldest_first_release():
    released: list[int] = []
    c = BlockCache(64, 256, released.append)
    c.put(0, (128, 100, "a", 1))
    c.put(128, (64, 10, "b", 2))
    c.put(192, (128, 120, "c", 3))
    assert len(c) == 2 and c.nbytes == 192 and released == [0]  # over the 256-byte limit: oldest out
    assert c.take(128) == 192 and c.take(128) is None  # the newest of its class
    assert 128 in c and 0 not in c and list(dict(c.items())) == [128]
    c.check()
    c.evict()
    assert released == [0, 128] and c.nbytes == 0 and len(c) == 0
    c.check()
