"""Run callables in threads of this process and collect what they raised (tests of thread safety)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["run_threads"]


def run_threads(targets: Sequence[Callable[[], object]], *, timeout: float = 120.0) -> list[BaseException]:
    """Run each of ``targets`` in its own thread, all released at once (a barrier), and join them; the exceptions
    they raised, in no particular order (a thread still running after ``timeout`` seconds is one too)."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def run(fn: Callable[[], object]) -> None:
        try:
            start.wait()
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    errors.extend(TimeoutError(f"{t.name} still running after {timeout:.0f}s") for t in threads if t.is_alive())
    return errors
