"""The one source of every constant the Python ops and the C channel share.

``native/build.py`` turns this module into the C header ``zb_abi.h`` (see
:func:`c_header`) before compiling, and hashes the text into the build key, so
a changed constant rebuilds the core. Nothing here is written by hand twice:
the ops import these names, the C code includes the generated header.

It lives in ``native/`` (the lowest layer that needs it) so that the build can
read it and every layer above may import it. Pure data: no imports, no I/O.

Contents:

* ``HEADER``: the fields of the 16-int64 op header each rank posts in its comm
  slot (C: ``H_<NAME>``, Python: ``H_<NAME>``).
* ``ARGS``: the op argument struct ``zb_op`` that Python fills for the one
  native call per op: the header fields first (so C copies them into the
  header as is), then the local-only fields (C: ``o->in_addr``..., Python:
  ``A_<NAME>`` indices into the int64 buffer).
* op, algorithm, dtype and reduce-op codes; result codes ``RC_*`` of the
  native call; ``ERR_*`` (kinds of error a rank posts); ``ABORT_*`` (why a rank
  left an op half-way), the ABORT line's words and ``WHERE_*``; the comm slot lines the channel uses; ``VEC_CAP``.
"""

from __future__ import annotations

__all__ = [
    "HEADER", "HDR_FIELDS", "ARGS", "OPS", "OP_NAMES", "ALGOS", "ALGO_NAMES", "DTYPES", "REDUCE_OPS", "RESULTS",
    "ERRORS", "ABORTS", "ABORT_WORDS", "ABORT_WHERE", "SLOT_LINES", "VEC_CAP", "MAX_WORLD", "STATES", "c_header",
]

#: Op header fields, in order (int64 each; 16 slots). KIND: the store kind group rank 0 chose for the op
#: (all_reduce; the others follow it, so the kind it measures is the one every rank used).
HEADER = ("SEQ", "OP", "DTYPE", "REDOP", "IN_NUMEL", "OUT_NUMEL", "IN_OFF", "OUT_OFF", "ALGO", "ROOT", "ROW",
          "DIGEST", "ERROR", "AUX", "PHASE_BASE", "KIND")
HDR_FIELDS = 16
#: The argument struct ``zb_op``: the header (16 fields; C sets KIND), then what only this rank needs.
#: in_addr/out_addr: local addresses of the operands; itemsize: bytes per element; counts: address of
#: ``nvec`` int64 sizes this rank posts in its size-vector area (per-rank counts; all_to_all: in | out);
#: stage_off: a heap block (offset) reserved for this rank's private input, -1 if the input is in the
#: heap (exchanges copy into it only when no algorithm can do without); timeout_ns: this op's wait
#: budget; staged (written by C): the bytes it staged.
ARGS = tuple(h.lower() for h in HEADER) + ("in_addr", "out_addr", "itemsize", "counts", "nvec",
                                           "stage_off", "timeout_ns", "staged")

OPS = {"ALL_REDUCE": 1, "ALL_GATHER": 2, "REDUCE_SCATTER": 3, "ALL_TO_ALL": 4, "BROADCAST": 5}
OP_NAMES = {v: k.lower() for k, v in OPS.items()}
ALGOS = {"ONESHOT": 1, "TWOSHOT": 2, "PULL": 3, "PUSH": 4}
ALGO_NAMES = {v: k.lower() for k, v in ALGOS.items()}
#: dtype codes of the reduction kernels (C: ZB_DT_<NAME>); ops/dtypes.py maps torch dtypes onto them.
DTYPES = {"F32": 0, "BF16": 1, "F16": 2, "F64": 3, "I8": 4, "U8": 5, "I16": 6, "I32": 7, "I64": 8, "BOOL": 9}
#: reduce-op codes (C: ZB_OP_<NAME>).
REDUCE_OPS = {"SUM": 0, "PROD": 1, "MAX": 2, "MIN": 3, "AVG": 4}
#: Result codes of the native op call.
RESULTS = {"OK": 0, "TIMEOUT": 1, "DEAD": 2, "GONE": 3, "MISMATCH": 4, "STEP": 5, "SPAN": 6, "PEER_ERROR": 7,
           "SPLITS": 8, "INTERRUPTED": 10, "NOMEM": 11, "SIZES": 12, "ABORTED": 13}
#: Header ERROR values: what kind of error a rank posts.
ERRORS = {"USAGE": 1, "NOMEM": 2}
#: ABORT line reason word (at +16): why a rank left an op half-way (PEER: a peer died or left first).
ABORTS = {"INTERRUPT": 1, "EXCEPTION": 2, "TIMEOUT": 3, "PEER": 4}
#: The words of an ABORT line (int64 indices; C: ``AW_<NAME>``). SEQ: non-zero once the owner left an op
#: half-way (the op's number, at least 1; futex waiter count at +8 as on every flag); WHY: an ``ABORTS``
#: value; WHERE: an ``ABORT_WHERE`` value, the protocol of the op it left. One meaning everywhere: see
#: ``runtime/liveness.py``. A rank's own ABORT line is the world slot's (slot 0); a sub-group's op channel
#: also marks its slot's line, which its in-op handshake reads (chan.c ``peer_left``).
ABORT_WORDS = {"SEQ": 0, "WHY": 2, "WHERE": 3}
#: Which protocol's op a rank left (the ABORT line's WHERE word; C: ``WHERE_<NAME>``).
ABORT_WHERE = {"COLLECTIVE": 1, "BARRIER": 2, "EP": 3, "P2P": 4, "STORE": 5}
#: Lines of a comm slot the op channel uses (line 0 is the communicator's barrier epoch).
#: ELECT: group rank 0's line only, the oneshot all_reduce's election word (chan_ops.c "oneshot").
SLOT_LINES = {"ARRIVE": 1, "PHASE": 2, "DONE": 3, "HEADER": 4, "ABORT": 6, "ELECT": 7, "VECTORS": 8}
#: int64 entries of a rank's size-vector area: the rest of its 8 KiB comm slot.
VEC_CAP = (8192 - SLOT_LINES["VECTORS"] * 64) // 8
#: Largest communicator the native channel serves.
MAX_WORLD = 256
#: Segment header STATE values the channel reads (heap/layout.py owns them; a unit test checks equality).
STATES = {"FINALIZED": 2, "FAILED": 3}


def _defines(prefix: str, table: dict[str, int]) -> list[str]:
    return [f"#define {prefix}{k} {v}" for k, v in table.items()]


def c_header() -> str:
    """The text of ``zb_abi.h``."""
    lines = ["/* Generated from zbccl/native/abi.py by native/build.py: do not edit. */",
             "#ifndef ZBCCL_ABI_H", "#define ZBCCL_ABI_H", "#include <stddef.h>", "#include <stdint.h>", "",
             f"#define HDR_FIELDS {HDR_FIELDS}", f"#define VEC_CAP {VEC_CAP}", f"#define ZB_MAXW {MAX_WORLD}",
             "enum { " + ", ".join(f"H_{h} = {i}" for i, h in enumerate(HEADER)) + " };"]
    lines += _defines("OP_", OPS) + _defines("ALGO_", ALGOS) + _defines("ZB_DT_", DTYPES)
    lines += _defines("ZB_OP_", REDUCE_OPS) + _defines("RC_", RESULTS) + _defines("ERR_", ERRORS)
    lines += _defines("ABORT_", ABORTS) + _defines("AW_", ABORT_WORDS) + _defines("WHERE_", ABORT_WHERE)
    lines += _defines("L_", SLOT_LINES) + _defines("STATE_", STATES)
    lines += ["", "/* One op's arguments, filled by Python (ops/channel.py) and passed by address. */",
              "typedef struct {", *(f"    int64_t {a};" for a in ARGS), "} zb_op;",
              f"_Static_assert(sizeof(zb_op) == {len(ARGS)} * 8, \"zb_op is packed int64\");",
              f"_Static_assert(offsetof(zb_op, in_addr) == {HDR_FIELDS} * 8, \"header fields lead zb_op\");",
              "", "#endif", ""]
    return "\n".join(lines)


def _export() -> None:
    """Python names: H_*, A_* (indices), OP_*, ALGO_*, RC_*, ERR_*, ABORT_*, L_* (module globals)."""
    g = globals()
    for i, h in enumerate(HEADER):
        g[f"H_{h}"] = i
    for i, a in enumerate(ARGS):
        g[f"A_{a.upper()}"] = i
    for prefix, table in (("OP_", OPS), ("ALGO_", ALGOS), ("RC_", RESULTS), ("ERR_", ERRORS),
                          ("ABORT_", ABORTS), ("AW_", ABORT_WORDS), ("WHERE_", ABORT_WHERE), ("L_", SLOT_LINES)):
        for k, v in table.items():
            g[prefix + k] = v
    __all__.extend(n for n in list(g) if n not in __all__ and n.split("_")[0] in ("H", "A", "OP", "ALGO", "RC", "ERR", "ABORT", "AW", "WHERE", "L")
                   and n.isupper())


_export()
