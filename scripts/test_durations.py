"""Write tests/durations.json from a ``pytest --durations=0`` log: each test's setup +
call + teardown seconds, by node id without parameters (``tests/x.py::test_y``).

Why: ``make test-fast`` leaves out the tests marked ``slow``, and tests/conftest.py
marks a test slow when this file says it took ``SLOW_S`` seconds or more, so the
marker follows what was measured, not what someone remembered to write. A new test
is fast until the file is written again:

    python -m pytest -q --durations=0 > /tmp/durations.log
    python scripts/test_durations.py /tmp/durations.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+)$")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
#: Tests under a second are left out: they are fast, and the file stays short.
KEEP_S = 1.0


def main(*logs: str) -> None:
    """Later logs win for the tests they ran (a partial run updates its tests only)."""
    seconds: dict[str, float] = {}
    for log in logs:
        found: dict[str, float] = {}
        for line in Path(log).read_text(errors="replace").splitlines():
            match = LINE.match(line.strip())
            if match:
                test = match.group(2).split("[", 1)[0]
                found[test] = round(found.get(test, 0.0) + float(match.group(1)), 2)
        if not found:
            sys.exit(f"{log}: no --durations=0 lines; allowed: the output of pytest --durations=0")
        seconds.update(found)
    kept = {test: s for test, s in sorted(seconds.items()) if s >= KEEP_S}
    OUT.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{OUT}: {len(kept)} of {len(seconds)} tests take {KEEP_S} s or more")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/test_durations.py PYTEST_DURATIONS_LOG...")
    main(*sys.argv[1:])
