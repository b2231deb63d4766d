"""Shared fixtures: every test must leave no zbccl segment and no rank behind."""

from __future__ import annotations

import os

import pytest


def zbccl_shm_entries() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if "zbccl" in n.lower())
    except FileNotFoundError:
        return []


def zbccl_memfds_of(pid: int) -> list[str]:
    """zbccl memfd mappings held by process ``pid`` (empty once it finalized and freed)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [ln.strip() for ln in f if "/memfd:zbccl-" in ln]
    except OSError:
        return []


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = set(zbccl_shm_entries())
    yield
    leaked = sorted(set(zbccl_shm_entries()) - before)
    assert not leaked, f"test left zbccl segments in /dev/shm: {leaked}"
