"""The leak check itself can fail: a process mapping a zbccl-named memfd is reported."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import leaks

_HOLDER = """
import mmap, os, sys
fd = os.memfd_create(sys.argv[1])
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
os.close(fd)  # only the mapping keeps the segment alive, as in zbccl
print("mapped", flush=True)
sys.stdin.read()
"""


def _holder(name: str, tag: str) -> subprocess.Popen:
    env = {**os.environ, leaks.TAG_VAR: tag}
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, name], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "mapped\n"
    return p


def test_a_process_mapping_a_segment_is_reported_until_it_exits():
    tag = os.environ[leaks.TAG_VAR]
    before = leaks.mappings(tag)
    p = _holder("zbccl-leaktest0-r0", tag)
    try:
        t0 = time.monotonic()
        found = leaks.new_mappings(before, tag, grace=0.5)
        assert found == {p.pid: frozenset({"memfd:zbccl-leaktest0-r0"})}, found
        assert time.monotonic() - t0 >= 0.5  # it waited out the grace period first
        assert leaks.processes_mapping("leaktest0") == [p.pid]
        assert f"pid {p.pid}" in leaks.describe(found) and "zbccl-leaktest0-r0" in leaks.describe(found)
    finally:
        p.stdin.close()  # the holder exits; the segment goes with it
        p.wait(30)
    assert leaks.new_mappings(before, tag, grace=10.0) == {}
    assert leaks.processes_mapping("leaktest0") == []


def test_other_sessions_processes_are_not_counted():
    tag = os.environ[leaks.TAG_VAR]
    before = leaks.mappings(tag)
    p = _holder("zbccl-leaktest1-r0", "another-session")
    try:
        assert leaks.new_mappings(before, tag, grace=0.0) == {}
        assert p.pid in leaks.mappings(None)  # seen when no session filter is given
    finally:
        p.stdin.close()
        p.wait(30)


def test_an_exiting_process_is_waited_for():
    tag = os.environ[leaks.TAG_VAR]
    before = leaks.mappings(tag)
    p = _holder("zbccl-leaktest2-r0", tag)
    p.stdin.close()  # exits on its own, a moment after the check starts
    assert leaks.new_mappings(before, tag, grace=20.0) == {}
    p.wait(30)
