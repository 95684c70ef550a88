"""Waiting for something in a test: poll with a deadline, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once ``check()`` is true; raise TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
