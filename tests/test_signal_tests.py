"""Every test that sends SIGINT, SIGQUIT or SIGHUP to a process it started starts that
process with those signals at their defaults (``tests/support/signals.py``).

Why: a test run started in the background (``make test &`` in a script) or under
``nohup`` passes those signals on ignored, and the child keeps them ignored, as it
should. Twice a Ctrl-C test then waited out its bound and failed in such a run (the
download's, then ``hpc status --watch``'s) while it passed in a terminal.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SENDS = re.compile(r"(send_signal|os\.kill|os\.killpg)\([^)]*signal\.(SIGINT|SIGQUIT|SIGHUP)\b")


def test_each_test_that_sends_an_inheritable_signal_starts_its_child_with_the_defaults() -> None:
    sending = [
        path
        for path in TESTS.rglob("*.py")
        if "__pycache__" not in path.parts and SENDS.search(path.read_text())
    ]
    assert sending, "the pattern no longer finds the known senders"
    missing = [
        str(path.relative_to(TESTS))
        for path in sending
        if "default_signals" not in path.read_text()
    ]
    assert missing == [], f"start the child with preexec_fn=default_signals: {missing}"
