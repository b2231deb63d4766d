"""Shared fixtures: every test must leave no process mapping a zbccl heap segment behind."""

from __future__ import annotations

import os
import uuid

import pytest

from tests import leaks


def pytest_configure(config: pytest.Config) -> None:
    # Inherited by every process this session starts (forkserver, ranks,
    # subprocesses), so the leak check can tell them from other sessions'.
    os.environ.setdefault(leaks.TAG_VAR, uuid.uuid4().hex)


@pytest.fixture(autouse=True)
def no_process_keeps_a_segment():
    """After each test no process of this session maps a segment it did not map before.

    That includes the pytest process itself: in-process (world 1) tests must
    finalize. Ranks still exiting get a bounded grace period (polled).
    """
    tag = os.environ[leaks.TAG_VAR]
    before = leaks.mappings(tag)
    yield
    leaked = leaks.new_mappings(before, tag, grace=10.0)
    assert not leaked, "processes still map zbccl heap segments after the test:\n" + leaks.describe(leaked)
