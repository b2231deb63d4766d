"""The one source of everything that crosses between Python and C: constants, codes and structs.

``native/build.py`` turns this module into the C headers ``zb_abi.h`` (the core and the hot entry, see
:func:`c_header`) and ``zb_hook_abi.h`` (the allocator hook, see :func:`hook_header`) before
compiling, and hashes their text into the build key, so a changed constant rebuilds the library.
Nothing here is written by hand twice: Python imports these names, C includes the generated headers,
and the core reports the layout it was compiled with (``abi_layout()``), which
:func:`check_layout` compares with :data:`STRUCTS` when the core loads (a real check, not an
``assert``: it holds under ``python -O``).

It lives in ``native/`` (the lowest layer that needs it) so that the build can read it and every
layer above may import it. Data and the struct packers built from it: only the standard library,
no I/O.

Contents:

* ``HEADER``: the fields of the 16-int64 op header each rank posts in its comm slot (C:
  ``H_<NAME>``, Python: ``H_<NAME>``).
* ``ARGS``: the op argument struct ``zb_op`` that Python fills for the one native call per op:
  the header fields first (so C copies them into the header as is), then the local-only fields.
  Python fills it by field name (:data:`ZbOp`, :func:`fill_op`).
* ``CHAN_ROW``: the per-rank row of the table ``chan_new`` reads (C: ``CR_<NAME>``).
* ``EP_ARGS``: the typed argument block of each EP kernel (a struct, then one row struct per rank),
  filled by field name (:func:`ep_args`).
* ``STRUCTS``: every struct Python hands to C, by C name: its int64 fields in order.
* op, algorithm, dtype, reduce-op and EP op codes; result codes ``RC_*`` of the native call;
  ``ERR_*`` (kinds of error a rank posts); ``ABORT_*`` (why a rank left an op half-way) and ``WHERE_*``
  (in which protocol); the comm
  slot lines the channel uses and the words inside a flag line (``W_*``); ``VEC_CAP``; the
  allocator hook's counters.
"""

from __future__ import annotations

import ctypes
import struct

__all__ = [
    "HEADER", "HDR_FIELDS", "ARGS", "ARG_DEFAULTS", "CHAN_ROW", "EP_ARGS", "STRUCTS", "ZbOp", "fill_op", "ep_args",
    "OPS", "OP_NAMES",
    "ALGOS", "ALGO_NAMES", "DTYPES", "REDUCE_OPS", "REDUCE_ALIASES", "REDUCE_NAMES", "EP_OPS", "EP_OP_NAMES",
    "RESULTS", "ERRORS", "ABORTS", "ABORT_WHERE", "SLOT_LINES", "WORDS", "VEC_CAP", "MAX_WORLD", "STATES", "HOOK_COUNTERS",
    "c_header", "hook_header", "check_layout",
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
#: What :func:`fill_op` writes for a field the caller does not name (every other field: 0).
ARG_DEFAULTS = {"stage_off": -1}
#: One row per group rank of the table ``chan_new`` reads: the addresses of that rank's ARRIVE, PHASE,
#: DONE and HEADER lines, its segment STATE word, byte 0 of its heap, its published heap size word, its
#: liveness descriptor (-1: this rank), its size-vector area, its ABORT line and its ELECT line (group
#: rank 0's is the group's election word), and its own ABORT line (RABORT: the world slot's, which every
#: wait reads, see runtime/liveness.py).
CHAN_ROW = ("ARRIVE", "PHASE", "DONE", "HEADER", "STATE", "BASE", "SIZE", "FD", "VEC", "ABORT", "ELECT", "RABORT",
            "RANK")
#: The argument block of each EP kernel (``native/csrc/cpu/ep.c``): C struct name -> (its fields, the fields of the
#: row that follows it once per rank, or ``()``). Addresses are ``*_out`` (written), or inputs; ``R`` ranks,
#: ``me`` this rank, ``E`` experts, ``L`` local experts, ``C`` channels, ``K`` top-k, ``T`` tokens. Each
#: kernel's comment in ep.c says what it reads and writes.
EP_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "zb_ep_layout": (("idx", "T", "K", "E", "R", "idx_is_int32", "per_rank_out", "per_expert_out", "in_rank_out"),
                     ()),
    "zb_ep_route": (("in_rank", "T", "R", "C", "E", "meta", "meta_len", "head_out", "expect"), ()),
    "zb_ep_plan": (("R", "me", "E", "C", "L", "counts_out", "per_expert_out", "recv_chan_out"), ("meta", "meta_len")),
    "zb_ep_pull": (("R", "me", "head", "L", "K", "n_recv", "src_idx_out", "stream", "x_dst", "x_row", "s_dst",
                    "s_row", "i_dst", "i_row", "w_dst", "w_row"),
                   ("meta", "meta_len", "T", "x_src", "s_src", "i_src", "w_src")),
    "zb_ep_combine": (("R", "T", "in_rank", "head") + tuple(f"{j}_{f}" for j in ("x", "w") for f in (
                          "dst", "width", "itemsize", "dtype", "nextra", "extra0", "extra1")),
                      ("base", "nrows", "x", "w")),
    "zb_ep_ll_plan": (("T", "K", "E", "idx", "counts_out", "tokens_out", "slots_out", "err_out"), ()),
    "zb_ep_ll_pull": (("R", "me", "L", "N", "E", "xrow", "x_out", "count_out", "src_info_out", "layout_out",
                       "begin_out", "masked", "keep_of", "srow", "s_out", "s_e", "s_slot", "s_j", "err_out"),
                      ("meta", "meta_len", "x", "T", "s")),
    "zb_ep_ll_addrs": (("T", "K", "E", "L", "R", "row_bytes", "idx", "w", "begin", "addr_out", "w_out", "err_out"),
                       ("meta", "x", "nrows")),
    "zb_ep_ll_combine": (("T", "K", "H", "dst", "src", "w", "acc"), ()),
    "zb_ep_hosts_recv": (("nsrc", "nbytes", "bit", "K", "lo", "L", "idx_at", "w_at", "s_at", "srow", "x_at", "xrow", "n",
                          "total", "x_dst", "s_dst", "i_dst", "w_dst", "src_dst", "per_expert_out", "err_out"),
                         ("blk", "nrows", "want")),
    "zb_ep_hosts_pack": (("T", "R", "H", "in_rank", "host_of", "bit_of", "K", "nbytes", "idx_at", "w_at", "s_at",
                          "srow", "x_at", "xrow", "x", "s", "idx", "w", "dst", "counts_out", "toks_out", "masks_out"),
                         ()),
    "zb_ep_hosts_handle": (("T", "R", "H", "C", "me", "in_rank", "host_of", "counts", "src_idx", "T_of", "scratch",
                            "rdma_chan_out", "gbl_chan_out", "recv_rdma_chan_out", "recv_rdma_rank_out",
                            "recv_gbl_chan_out", "recv_gbl_rank_out", "rdma_head_out", "nvl_head_out"), ()),
    "zb_ep_hosts_ll_recv": (("nsrc", "L", "N", "xrow", "srow", "x_dst", "info_dst", "s_dst", "s_le", "s_slot", "s_j",
                             "layout_out", "count_out", "err_out"), ("raw", "n", "row", "dropped")),
}
#: Every struct Python passes to C by address (int64 fields, in order): C name -> fields (an EP block's row
#: is ``<name>_row``).
STRUCTS: dict[str, tuple[str, ...]] = {"zb_op": ARGS}
for _name, (_head, _row) in EP_ARGS.items():
    STRUCTS[_name] = _head
    if _row:
        STRUCTS[_name + "_row"] = _row
del _name, _head, _row

#: Op codes of the channel (C: OP_<NAME>). BARRIER: the communicator's barrier (no bytes; DIGEST: the
#: caller's tag, which every rank must post alike; AUX: the ``ABORT_WHERE`` a rank leaving it half-way
#: reports, 0 for BARRIER).
OPS = {"ALL_REDUCE": 1, "ALL_GATHER": 2, "REDUCE_SCATTER": 3, "ALL_TO_ALL": 4, "BROADCAST": 5, "BARRIER": 6}
OP_NAMES = {v: k.lower() for k, v in OPS.items()}
ALGOS = {"ONESHOT": 1, "TWOSHOT": 2, "PULL": 3, "PUSH": 4}
ALGO_NAMES = {v: k.lower() for k, v in ALGOS.items()}
#: dtype codes (C: ZB_DT_<NAME>), one numbering for every user: the reduction kernels serve the first ten
#: (``ops/dtypes.py`` maps torch dtypes onto all of them); F8_E4M3 is moved by EP, never reduced.
DTYPES = {"F32": 0, "BF16": 1, "F16": 2, "F64": 3, "I8": 4, "U8": 5, "I16": 6, "I32": 7, "I64": 8, "BOOL": 9,
          "F8_E4M3": 10}
#: reduce-op codes (C: ZB_OP_<NAME>).
REDUCE_OPS = {"SUM": 0, "PROD": 1, "MAX": 2, "MIN": 3, "AVG": 4}
#: Every spelling an op accepts (lower case; torch's ``ReduceOp`` names among them) -> its code.
REDUCE_ALIASES = {"sum": 0, "prod": 1, "product": 1, "max": 2, "min": 3, "avg": 4, "mean": 4}
#: The name a code is reported by.
REDUCE_NAMES = {0: "sum", 1: "product", 2: "max", 3: "min", 4: "avg"}
#: EP op codes: an EP header's OP field and the op part of a tagged barrier's tag (``ep/exchange.py``).
EP_OPS = {"DISPATCH": 1, "COMBINE": 2, "LL_DISPATCH": 3, "LL_COMBINE": 4, "CLEAN": 5}
EP_OP_NAMES = {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine",
               5: "clean_low_latency_buffer"}
#: Result codes of the native op call.
RESULTS = {"OK": 0, "TIMEOUT": 1, "DEAD": 2, "GONE": 3, "MISMATCH": 4, "STEP": 5, "SPAN": 6, "PEER_ERROR": 7,
           "SPLITS": 8, "INTERRUPTED": 10, "NOMEM": 11, "SIZES": 12, "ABORTED": 13}
#: Header ERROR values: what kind of error a rank posts.
ERRORS = {"USAGE": 1, "NOMEM": 2}
#: ABORT line reason word (``W_WHY``): why a rank left an op half-way (PEER: a peer died or left first).
ABORTS = {"INTERRUPT": 1, "EXCEPTION": 2, "TIMEOUT": 3, "PEER": 4}
#: An ABORT line's words are ``WORDS``' VALUE (non-zero once the owner left an op half-way: the op's
#: number, at least 1), WHY (an ``ABORTS`` value) and WHERE (an ``ABORT_WHERE`` value, the protocol of the
#: op it left). One meaning everywhere: see ``runtime/liveness.py``. A rank's own ABORT line is the world slot's (slot 0); a sub-group's op channel
#: also marks its slot's line, which its in-op handshake reads (chan.c ``peer_left``).
#: Which protocol's op a rank left (the ABORT line's WHERE word; C: ``WHERE_<NAME>``).
ABORT_WHERE = {"COLLECTIVE": 1, "BARRIER": 2, "EP": 3, "P2P": 4, "STORE": 5}
#: Lines of a comm slot the op channel uses (line 0, once the barrier epoch, is unused: the barrier is an op).
#: ELECT: group rank 0's line only, the oneshot all_reduce's election word (chan_ops.c "oneshot").
#: WAIT: the world slot's only, the rank a p2p wait of this rank waits for (``runtime/liveness.py`` ``waiting``).
SLOT_LINES = {"ARRIVE": 1, "PHASE": 2, "DONE": 3, "HEADER": 4, "WAIT": 5, "ABORT": 6, "ELECT": 7, "VECTORS": 8}
#: int64 words of a 64-byte flag line (C: ``W_<NAME>``). VALUE: the flag; WAITERS: the int32 at its byte 0
#: counts the processes futex-sleeping on the flag. Then per kind of line: ABORT line: WHY (``ABORT_*``);
#: ELECT line: RC, RANK, FIELD (the claimant's verdict, read by every rank it releases). ABORT line: VALUE the
#: sequence number of the op left (non-zero once set), WHY, WHERE (an ``ABORT_WHERE`` value), CAUSE and VIA
#: (world rank + 1, 0: none): VIA the rank this one left because of (the peer that left, died, or never came
#: before the timeout), CAUSE the first rank of that chain (VIA's CAUSE when VIA left an op too, else VIA;
#: this rank itself when it left by its own Ctrl-C or exception). Written before VALUE, as WHY and WHERE.
WORDS = {"VALUE": 0, "WAITERS": 1, "WHY": 2, "WHERE": 3, "RC": 2, "RANK": 3, "FIELD": 4, "CAUSE": 4, "VIA": 5}
#: int64 entries of a rank's size-vector area: the rest of its 8 KiB comm slot.
VEC_CAP = (8192 - SLOT_LINES["VECTORS"] * 64) // 8
#: Largest communicator the native channel serves.
MAX_WORLD = 256
#: Segment header STATE values the channel reads (heap/layout.py owns them; a unit test checks equality).
STATES = {"FINALIZED": 2, "FAILED": 3}
#: Counters of a heap registered with the CPU allocator hook (``csrc/cpu/cpu_alloc_hook.cpp``, ``zbh_stats``
#: order; C++: ``k<CamelName>``, then ``kNumCounters``): name and meaning.
HOOK_COUNTERS = {
    "hits": "allocations served from the native cache, no Python",
    "misses": "allocations that called refill (sma.try_malloc)",
    "fallback_allocs": "non-strict allocations served from ordinary memory: heap full",
    "fallback_bytes": "their requested bytes",
    "strict_failures": "strict allocations that raised: heap full",
    "live_bytes": "heap bytes (class sizes) held by live tensors",
    "live_blocks": "heap blocks held by live tensors",
    "cached_bytes": "bytes in the native cache (the SMA tier)",
    "cached_blocks": "blocks in the native cache",
    "releases": "frees handed back to the SMA (cache full or class not cached)",
    "dropped_frees": "frees after unregister_heap, dropped",
}


class ZbOp(ctypes.Structure):
    """``zb_op`` (:data:`ARGS`), one int64 per field, addressed by name: ``op.seq``, ``op.timeout_ns``."""

    _fields_ = [(a, ctypes.c_int64) for a in ARGS]


def _filler(name: str, fields: tuple[str, ...], defaults: dict[str, int]):
    """``fill(buf, *, <field>=<default>, ...)``: pack a struct's fields, by name, into ``buf`` (one
    ``struct.pack_into``; generated from the field list as ``collections.namedtuple`` builds its class, so
    a call names every field it sets and the order lives only in ``fields``)."""
    params = ", ".join(f"{f}={defaults.get(f, 0)}" for f in fields)
    src = f"def fill_{name}(buf, *, {params}):\n    _pack(buf, 0, {', '.join(fields)})\n"
    ns = {"_pack": struct.Struct(f"<{len(fields)}q").pack_into}
    exec(src, ns)  # noqa: S102 - the text is built from this module's constant field names only
    return ns[f"fill_{name}"]


#: ``fill_op(buf, *, seq=0, op=0, ...)``: write a whole ``zb_op`` into ``buf`` (a :class:`ZbOp`), by field name.
fill_op = _filler("zb_op", ARGS, ARG_DEFAULTS)


def _lister(name: str, fields: tuple[str, ...]):
    """``values(*, <field>, ...) -> [int, ...]``: a struct's fields, every one named, in the struct's order."""
    src = f"def {name}(*, {', '.join(fields)}):\n    return [{', '.join(fields)}]\n"
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - the text is built from this module's constant field names only
    return ns[name]


def ep_args(name: str):
    """``(head, row)`` of EP kernel block ``name`` (:data:`EP_ARGS`): ``head(**fields)`` and ``row(**fields)``
    give the values in struct order (``row`` None without rows); the block is ``head(...) + row(...) * R``
    as int64."""
    head, row = EP_ARGS[name]
    return _lister(name, head), (_lister(name + "_row", row) if row else None)


def check_layout(reported: dict) -> str | None:
    """Compare the layout the compiled core reports (``abi_layout()``: C name -> ``(sizeof, (offsetof of
    each field, ...))``) with :data:`STRUCTS`; the first difference in words, or None when they agree."""
    for name, fields in STRUCTS.items():
        got = reported.get(name)
        want = (8 * len(fields), tuple(8 * i for i in range(len(fields))))
        if got is None:
            return f"the core does not report struct {name}"
        if tuple(got[0:1]) + (tuple(got[1]),) != want:
            return f"struct {name} differs, expected sizeof/offsets {want}, got {got}"
    extra = set(reported) - set(STRUCTS)
    return f"the core reports structs abi.py does not define: {sorted(extra)}" if extra else None


def _defines(prefix: str, table: dict[str, int]) -> list[str]:
    return [f"#define {prefix}{k} {v}" for k, v in table.items()]


def _struct(name: str, fields: tuple[str, ...]) -> list[str]:
    return ["typedef struct {", *(f"    int64_t {f};" for f in fields), f"}} {name};",
            f"#define ZB_OFFSETS_{name} " + ", ".join(f"offsetof({name}, {f})" for f in fields)]


def c_header() -> str:
    """The text of ``zb_abi.h``."""
    lines = ["/* Generated from zbccl/native/abi.py by native/build.py: do not edit. */",
             "#ifndef ZBCCL_ABI_H", "#define ZBCCL_ABI_H", "#include <stddef.h>", "#include <stdint.h>", "",
             f"#define HDR_FIELDS {HDR_FIELDS}", f"#define VEC_CAP {VEC_CAP}", f"#define ZB_MAXW {MAX_WORLD}",
             "enum { " + ", ".join(f"H_{h} = {i}" for i, h in enumerate(HEADER)) + " };",
             "enum { " + ", ".join(f"CR_{c} = {i}" for i, c in enumerate(CHAN_ROW)) + f", CR_COLUMNS = {len(CHAN_ROW)} }};"]
    lines += _defines("OP_", OPS) + _defines("ALGO_", ALGOS) + _defines("ZB_DT_", DTYPES)
    lines += _defines("ZB_OP_", REDUCE_OPS) + _defines("EP_OP_", EP_OPS) + _defines("RC_", RESULTS)
    lines += _defines("ERR_", ERRORS) + _defines("ABORT_", ABORTS) + _defines("WHERE_", ABORT_WHERE)
    lines += _defines("L_", SLOT_LINES)
    lines += _defines("W_", WORDS) + _defines("STATE_", STATES)
    lines += ["", "/* The structs Python fills by field name (abi.STRUCTS) and passes by address; abi_layout()",
              " * (chan.c) reports their sizes and offsets, which abi.check_layout compares when the core loads. */"]
    for name, fields in STRUCTS.items():
        lines += _struct(name, fields)
    lines += ["#define ZB_ABI_STRUCTS(X) " + " ".join(f"X({n})" for n in STRUCTS),
              "#ifdef __cplusplus  /* the hot entry (py/hot.cpp) includes this header too */",
              f"static_assert(offsetof(zb_op, in_addr) == {HDR_FIELDS} * 8, \"header fields lead zb_op\");",
              "#else",
              f"_Static_assert(offsetof(zb_op, in_addr) == {HDR_FIELDS} * 8, \"header fields lead zb_op\");",
              "#endif",
              "", "#endif", ""]
    return "\n".join(lines)


def _camel(name: str) -> str:
    return "k" + "".join(p.capitalize() for p in name.split("_"))


def hook_header() -> str:
    """The text of ``zb_hook_abi.h`` (the allocator hook's counter order)."""
    return "\n".join([
        "/* Generated from zbccl/native/abi.py by native/build.py: do not edit. */", "#pragma once", "",
        "/* Exported counter order (zbh_stats): abi.HOOK_COUNTERS. */",
        "enum Counter { " + ", ".join(f"{_camel(n)} = {i}" for i, n in enumerate(HOOK_COUNTERS))
        + f", kNumCounters = {len(HOOK_COUNTERS)} }};", ""])


def _export() -> None:
    """Python names: H_*, A_* (indices), OP_*, ALGO_*, EP_OP_*, RC_*, ERR_*, ABORT_*, L_*, W_* (module globals)."""
    g = globals()
    for i, h in enumerate(HEADER):
        g[f"H_{h}"] = i
    for i, a in enumerate(ARGS):
        g[f"A_{a.upper()}"] = i
    for prefix, table in (("OP_", OPS), ("ALGO_", ALGOS), ("EP_OP_", EP_OPS), ("RC_", RESULTS), ("ERR_", ERRORS),
                          ("ABORT_", ABORTS), ("WHERE_", ABORT_WHERE), ("L_", SLOT_LINES),
                          ("W_", WORDS)):
        for k, v in table.items():
            g[prefix + k] = v
            if prefix + k not in __all__:
                __all__.append(prefix + k)
    __all__.extend(n for n in list(g) if n not in __all__ and n.split("_")[0] in ("H", "A") and n.isupper())


_export()
