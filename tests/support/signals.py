"""Children whose signal dispositions are the defaults, whatever the test runner inherited.

A test run started in the background (`cmd &` in a script: SIGINT and SIGQUIT ignored)
or under `nohup` (SIGHUP ignored) passes those ignored dispositions on through every
fork and exec, and a process that finds a signal ignored at start is right to keep it
ignored (that is what `nohup` asks for; `ddp.data` and bash's `trap` both honour it). A
test that sends such a signal to check what happens by default must therefore start its
child with the defaults itself, or it tests the runner's environment instead.
"""

from __future__ import annotations

import signal

#: The signals a shell or nohup may leave ignored for the processes it starts.
INHERITED = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def default_signals() -> None:
    """``preexec_fn`` for subprocess: the child starts with these signals at SIG_DFL."""
    for signum in INHERITED:
        signal.signal(signum, signal.SIG_DFL)
