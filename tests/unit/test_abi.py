"""The shared constants have one source (native/abi.py): the C header is generated from it and is
part of the core's build key; the few values owned elsewhere are checked, not mirrored."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from zbccl import native
from zbccl.heap import layout
from zbccl.native import abi
from zbccl.native import build as nb
from zbccl.ops import dtypes

CSRC = Path(native.__file__).parent / "csrc"


def test_header_defines_every_constant_once():
    text = abi.c_header()
    for prefix, table in (("OP_", abi.OPS), ("ALGO_", abi.ALGOS), ("ZB_DT_", abi.DTYPES),
                          ("ZB_OP_", abi.REDUCE_OPS), ("RC_", abi.RESULTS), ("ERR_", abi.ERRORS),
                          ("ABORT_", abi.ABORTS), ("L_", abi.SLOT_LINES)):
        for name, value in table.items():
            assert len(re.findall(rf"#define {prefix}{name} {value}\n", text)) == 1, prefix + name
    for i, field in enumerate(abi.HEADER):
        assert f"H_{field} = {i}" in text
    assert text.count("typedef struct {") == len(abi.STRUCTS)
    assert text.count("    int64_t ") == sum(len(f) for f in abi.STRUCTS.values())
    for i, name in enumerate(abi.CHAN_ROW):
        assert f"CR_{name} = {i}" in text


def test_no_hand_written_tables_remain_in_c():
    for path in CSRC.glob("*.[ch]"):
        src = path.read_text()
        assert not re.search(r"#define (RC_|ERR_|ABORT_|OP_ALL|ALGO_|STATE_)\w+ \d", src), path.name
        assert not re.search(r"enum \{ *(RC_|H_SEQ|ZB_DT_|ZB_OP_)", src), path.name


def test_ep_kernels_read_typed_blocks():
    # the EP kernels take their structs (abi.EP_ARGS), not positional int64 arrays
    src = (CSRC / "ep.c").read_text()
    assert not re.search(r"\ba\[\d+\]|\bper\[\d", src)
    for name, (head, row) in abi.EP_ARGS.items():
        assert f"const {name} *a" in src, name
        assert not row or f"{name}_row" in src, name
        fill, fill_row = abi.ep_args(name)
        assert fill(**dict.fromkeys(head, 1)) == [1] * len(head)
        assert (fill_row is None) == (not row)


def test_values_owned_elsewhere_agree():
    assert abi.STATES == {"FINALIZED": layout.STATE_FINALIZED, "FAILED": layout.STATE_FAILED}
    assert abi.VEC_CAP == (layout.SLOT_BYTES - abi.L_VECTORS * layout.LINE) // 8
    assert max(abi.SLOT_LINES.values()) * layout.LINE < layout.SLOT_BYTES


def test_generated_header_is_in_the_build_key(tmp_path):
    src = tmp_path / "x.c"
    src.write_text("int x;\n")
    spec = nb.BuildSpec("x", (src,), "c", False, (), "cc", (("zb_abi.h", abi.c_header()),))
    other = nb.BuildSpec("x", (src,), "c", False, (), "cc", (("zb_abi.h", abi.c_header() + "\n"),))
    assert nb._key(spec) != nb._key(other)
    assert native.GENERATED["core"] == (("zb_abi.h", abi.c_header()),)


def test_core_reports_the_layout_abi_py_defines():
    # the compiled core's sizeof/offsetof of every struct Python fills, against the field lists
    reported = native.core().abi_layout()
    assert set(reported) == set(abi.STRUCTS)
    for name, fields in abi.STRUCTS.items():
        size, offsets = reported[name]
        assert size == 8 * len(fields), name
        assert list(offsets) == [8 * i for i in range(len(fields))], name
    assert abi.check_layout(reported) is None
    assert ctypes.sizeof(abi.ZbOp) == reported["zb_op"][0]
    assert [getattr(abi.ZbOp, f).offset for f in abi.ARGS] == list(reported["zb_op"][1])


def test_check_layout_finds_a_drift():
    good = native.core().abi_layout()
    size, offs = good["zb_op"]
    assert "zb_op" in abi.check_layout({**good, "zb_op": (size + 8, offs)})
    assert "zb_op" in abi.check_layout({**good, "zb_op": (size, offs[:-1])})
    assert "does not report" in abi.check_layout({})
    assert "zb_x" in abi.check_layout({**good, "zb_x": (8, (0,))})


def test_fill_op_writes_by_field_name():
    op = abi.ZbOp()
    abi.fill_op(op, seq=7, op=abi.OP_BROADCAST, root=3, timeout_ns=11)
    assert (op.seq, op.op, op.root, op.timeout_ns) == (7, abi.OP_BROADCAST, 3, 11)
    assert op.stage_off == abi.ARG_DEFAULTS["stage_off"] and op.in_addr == 0
    with pytest.raises(TypeError):
        abi.fill_op(op, sequence=1)  # a misspelt field is an error, not a silently ignored value


def test_one_dtype_and_reduce_table():
    assert sorted(dtypes.CODES.values()) == sorted(abi.DTYPES.values())  # every code has its torch dtype
    assert all(dtypes.CODES[d] == c for d, c in dtypes.DTYPE_CODES.items())
    assert set(dtypes.REDUCE_OPS.values()) == set(abi.REDUCE_OPS.values())
    assert all(dtypes.op_name(c) in abi.REDUCE_ALIASES for c in abi.REDUCE_OPS.values())


def test_hook_counters_have_one_source():
    from zbccl.adapters import scope

    assert scope.HOOK_COUNTERS == tuple(abi.HOOK_COUNTERS)
    text = abi.hook_header()
    for i, name in enumerate(abi.HOOK_COUNTERS):
        assert f"{abi._camel(name)} = {i}" in text
    assert f"kNumCounters = {len(abi.HOOK_COUNTERS)}" in text
    assert native.GENERATED["cpu_alloc_hook"] == (("zb_hook_abi.h", text),)
    assert "enum Counter {" not in (CSRC / "cpu_alloc_hook.cpp").read_text()
