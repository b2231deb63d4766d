"""The shared constants have one source (native/abi.py): the C header is generated from it and is
part of the core's build key; the few values owned elsewhere are checked, not mirrored."""

from __future__ import annotations

import re
from pathlib import Path

from zbccl import native
from zbccl.heap import layout
from zbccl.native import abi
from zbccl.native import build as nb
from zbccl.ops import channel

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
    assert "typedef struct {" in text and text.count("int64_t ") == len(abi.ARGS)


def test_no_hand_written_tables_remain_in_c():
    for path in CSRC.glob("*.[ch]"):
        src = path.read_text()
        assert not re.search(r"#define (RC_|ERR_|ABORT_|OP_ALL|ALGO_|STATE_)\w+ \d", src), path.name
        assert not re.search(r"enum \{ *(RC_|H_SEQ|ZB_DT_|ZB_OP_)", src), path.name


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


def test_channel_run_follows_the_struct():
    # channel.py asserts it at import; the packed struct has one int64 per field
    assert channel._ARGS.size == 8 * len(abi.ARGS)
