"""The kernel signal area's geometry (native/triton/geometry.py) and its place in the shm control area."""

from __future__ import annotations

import pytest

from zbccl.heap import layout
from zbccl.native.triton import geometry as g


def test_kernel_slot_fits_its_parts():
    assert g.K_EPOCH < g.K_DONE < g.K_STATUS
    assert g.K_STATUS + g.ST_WORDS * 8 <= g.K_ARGS
    assert g.K_ARGS + 2 * g.ROW_BYTES <= g.K_SIG  # two argument rows (launch parity)
    assert g.KSLOT_BYTES == g.K_SIG + g.MAX_BLOCKS * g.KMAX_WORLD * 8
    assert len(g.A_FIELDS) <= g.A_SPLITS and g.ARG_WORDS == g.A_SPLITS + 2 * g.KMAX_WORLD
    assert g.KMAX_WORLD <= 63  # the status words hold the missing ranks as one int64 bit mask
    assert g.STEP_EXIT < g.PHASE


def test_kernel_area_follows_the_comm_slots_in_the_shm_pad():
    assert layout.slot_offset(layout.MAX_COMMS - 1) + layout.SLOT_BYTES <= layout.KERNEL_AREA
    assert layout.MAX_COMMS == (layout.COMM_BYTES - layout.HEADER_BYTES) // layout.SLOT_BYTES
    end = layout.KERNEL_AREA + layout.kernel_slot_offset(layout.MAX_COMMS - 1) + g.KSLOT_BYTES
    assert end <= layout.CTRL_BYTES and layout.CTRL_BYTES % layout.PAGE == 0
    assert layout.kernel_slot_offset(1) - layout.kernel_slot_offset(0) == g.KSLOT_BYTES


@pytest.mark.parametrize("world", [1, 2, 4, 8, g.KMAX_WORLD])
def test_kernel_pad_bytes_serves_every_slot(world):
    n = layout.kernel_pad_bytes(world)
    assert n >= layout.MAX_COMMS * g.KSLOT_BYTES and n % layout.PAGE == 0


def test_kernel_pad_bytes_refuses_a_world_it_cannot_serve():
    with pytest.raises(ValueError, match="device kernels serve"):
        layout.kernel_pad_bytes(g.KMAX_WORLD + 1)
    with pytest.raises(ValueError):
        layout.kernel_slot_offset(layout.MAX_COMMS)
