"""Geometry of the kernels' signal area: the one source the kernels, ``heap/layout.py`` and the transports share.

Pure constants and arithmetic (no triton import). Each rank's signal pad holds a *kernel area* of
``MAX_COMMS`` kernel slots, one per communicator slot (``heap/layout.py`` places the area in the pad and
sizes it with :func:`kernel_pad_bytes`). One kernel slot, in int64 words at byte offsets::

    0     K_EPOCH   launches of this slot's kernels completed by this rank (the kernel increments it)
    8     K_DONE    blocks of the current launch that finished (the last one resets it, bumps K_EPOCH)
    64    K_STATUS  ST_WORDS host-visible status words (what went wrong, which ranks; see ST_*)
    1024  K_STAMP   MAX_BLOCKS words: block b's last timer reading (so that all its threads agree on the time)
    2048  K_ARGS    2 x KMAX_WORLD argument rows of ROW_BYTES (A_* fields, then the splits): row [E % 2][src]
                    is written by rank ``src`` (pushed before its signals), for launch E
    14336 K_SIG     MAX_BLOCKS x KMAX_WORLD signal words: word [b][src] is written by rank ``src``'s block b

Everything is written by kernels on the device, except that the owner zeroes its slot when a
``DeviceOps`` is created, and ``DeviceOps.check`` reads (and clears) the status words.
"""

from __future__ import annotations

__all__ = [
    "KMAX_WORLD", "MAX_BLOCKS", "K_EPOCH", "K_DONE", "K_STATUS", "K_ARGS", "K_STAMP", "K_SIG", "KSLOT_BYTES",
    "A_FIELDS", "A_EPOCH", "A_OP", "A_GRID", "A_SPLITS", "ARG_WORDS", "ROW_BYTES",
    "ST_CODE", "ST_MISSING", "ST_BAD", "ST_FIELD", "ST_MINE", "ST_THEIRS", "ST_EPOCH", "ST_OP", "ST_WORDS",
    "F_ROWS_IN", "F_ROWS_OUT",
    "S_TIMEOUT", "S_MISMATCH", "S_PEER_ERROR", "PHASE", "STEP_EXIT",
    "KOP", "KOP_NAMES",
]

#: Most ranks a kernel communicator may have (signal words per block, split entries per argument row).
KMAX_WORLD = 16
#: Most blocks (CTAs / interpreter programs) one launch may use.
MAX_BLOCKS = 128

K_EPOCH = 0
K_DONE = 8
K_STATUS = 64
K_STAMP = 1024
K_ARGS = K_STAMP + MAX_BLOCKS * 8

#: The argument row's fields (int64 words from K_ARGS), then 2 x KMAX_WORLD split entries from A_SPLITS.
#: EPOCH: the launch the row belongs to; OP: a KOP code; GRID: blocks of the launch; OUTER/INNER: the
#: tensor's size before/after ``dim`` (elements); NUMEL: input elements; SPLITS: the per-rank sizes
#: (all_gather_v, reduce_scatter_v: every rank's size along dim; all_to_all_v: this rank's in_splits,
#: then from A_SPLITS + KMAX_WORLD its out_splits, in rows).
A_FIELDS = ("EPOCH", "OP", "DTYPE", "REDOP", "ALGO", "GRID", "ROOT", "OUTER", "INNER", "NUMEL", "IN_OFF",
            "OUT_OFF", "VARIANT")
A_EPOCH, A_OP, A_GRID = 0, 1, 5
A_SPLITS = 16
ARG_WORDS = A_SPLITS + 2 * KMAX_WORLD
ROW_BYTES = ARG_WORDS * 8
K_SIG = K_ARGS + 2 * KMAX_WORLD * ROW_BYTES

#: Status words (int64 from K_STATUS). CODE: an OR of S_* bits; MISSING: bit r set for each group rank
#: r that never arrived (timeout); BAD: 1 + the group rank whose arguments differed (0: none); FIELD:
#: the A_* index that differed (A_SPLITS + i: split i); MINE/THEIRS: the two values; EPOCH: the launch;
#: OP: its KOP code.
ST_CODE, ST_MISSING, ST_BAD, ST_FIELD, ST_MINE, ST_THEIRS, ST_EPOCH, ST_OP = range(8)
#: FIELD values past the row's words: all_to_all_v's device splits ask for rows past a tensor (MINE: the row the
#: splits reach, THEIRS: the rows there are). F_ROWS_OUT: this rank's output (BAD is this rank); F_ROWS_IN: the
#: input of rank BAD - 1, whose in_splits reach past it. The rows past the end are neither read nor written.
F_ROWS_IN, F_ROWS_OUT = 126, 127
ST_WORDS = 8
S_TIMEOUT, S_MISMATCH, S_PEER_ERROR = 1, 2, 4
KSLOT_BYTES = K_SIG + MAX_BLOCKS * KMAX_WORLD * 8

#: Signal values: launch ``e`` (1-based) at barrier step ``s`` signals ``e * PHASE + s``; words only grow.
PHASE = 1 << 20
STEP_EXIT = PHASE - 1

#: Kernel op codes (the argument row's OP). ERROR: a rank whose call failed validation; it still takes
#: part in the handshake so that every rank hears of it and the epochs stay in step.
KOP = {"BARRIER": 1, "ALL_REDUCE": 2, "ALL_GATHER": 3, "REDUCE_SCATTER": 4, "ALL_TO_ALL": 5, "BROADCAST": 6,
       "ERROR": 15}
KOP_NAMES = {v: k.lower() for k, v in KOP.items()}


assert K_STATUS + ST_WORDS * 8 <= K_STAMP, "the status words overlap the timer stamps"
