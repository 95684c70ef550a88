"""Waiting for something in a test: poll with a deadline, never a fixed sleep.

A wait on a job (a file it writes, a state it reaches) also ends when the job ends: a
job that died at its first line must fail the test with its own error, at once, not
minutes later as "not after 120 s". So such a wait names how to tell the job ended
(``ended``) and how to read its log (``log``), and every failure quotes that log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

LOG_TAIL = 8000
"""Characters of a job's log quoted in a failure (its end, where the error is)."""


class JobEnded(AssertionError):
    """The job ended before what the test waited for happened."""


def quote_log(log: Callable[[], str] | None) -> str:
    """The end of the job's log, to append to a failure message ('' without ``log``)."""
    if log is None:
        return ""
    try:
        text = log()
    except OSError as exc:  # the failure must still say what the wait was for
        return f"\n--- the job's log could not be read: {exc}"
    if not text.strip():
        return "\n--- the job's log is empty (or not written yet)"
    tail = text[-LOG_TAIL:]
    cut = "... " if len(text) > LOG_TAIL else ""
    return f"\n--- the job's log:\n{cut}{tail}"


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    ended: Callable[[], str | None] | None = None,
    log: Callable[[], str] | None = None,
) -> None:
    """Return once ``check()`` is true.

    ``ended()`` returns the job's final state once it has one (else None): the wait
    then fails at once with :class:`JobEnded`. After ``timeout`` s it fails with
    TimeoutError, a bound against a true hang only. Both quote ``log()``.
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not check():
        final = ended() if ended is not None else None
        if final is not None:
            if check():  # it happened just before the job ended
                return
            raise JobEnded(f"{what}: the job ended ({final}) first{quote_log(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s{quote_log(log)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def wait_state(
    state: Callable[[], str],
    wanted: Sequence[str],
    final: Sequence[str],
    timeout: float,
    what: str,
    log: Callable[[], str] | None = None,
) -> str:
    """Poll a job's ``state()`` until it is one of ``wanted``; return it.

    A state in ``final`` that is not wanted (the job ended: FAILED while the test waits
    for RUNNING) ends the wait at once; a timeout names the last state seen. Every
    failure quotes ``log()``.
    """
    seen: list[str] = []

    def check() -> bool:
        seen.append(state())
        return seen[-1] in wanted

    def ended() -> str | None:
        return seen[-1] if seen[-1] in final else None

    try:
        wait_until(check, timeout, what, ended=ended, log=log)
    except TimeoutError:
        last = seen[-1] if seen else "?"
        raise TimeoutError(
            f"{what}: not after {timeout} s (last state {last}){quote_log(log)}"
        ) from None
    return seen[-1]
