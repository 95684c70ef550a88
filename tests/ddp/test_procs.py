"""``hpc_ddp.procs.descendants``: the tree below a process, which ``hpc cancel`` signals
for a job that has no process group of its own (``hpc.executor``'s local jobs)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from hpc_ddp.procs import descendants, process_stat
from tests.support.polling import wait_until


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_descendants_are_the_whole_tree_parents_first() -> None:
    # bash -> (inner bash -> sleep), sleep; "; :" keeps each bash from exec'ing its last command
    outer = subprocess.Popen(["bash", "-c", 'bash -c "sleep 300; :" & sleep 300 & wait; :'])
    try:
        wait_until(lambda: len(descendants(outer.pid)) == 3, 60, "the tree of 3 below bash")
        tree = descendants(outer.pid)
        assert outer.pid not in tree
        children = [p for p in tree if _ppid(p) == outer.pid]
        (inner_bash,) = [p for p in children if descendants(p)]
        (grandchild,) = descendants(inner_bash)
        assert tree.index(grandchild) > tree.index(inner_bash)  # parents first
        assert len(children) == 2 and _ppid(grandchild) == inner_bash
        assert descendants(grandchild) == []
        # A child that has exited (a zombie its parent has not reaped) is not counted.
        os.kill(inner_bash, signal.SIGSTOP)  # a stopped parent cannot reap
        wait_until(lambda: (process_stat(inner_bash) or ("",))[0] == "T", 60, "bash stopped")
        os.kill(grandchild, signal.SIGKILL)
        wait_until(lambda: (process_stat(grandchild) or ("",))[0] == "Z", 60, "a zombie")
        assert grandchild not in descendants(outer.pid)
        assert descendants(os.getpid()).count(outer.pid) == 1
    finally:
        for pid in [*descendants(outer.pid), outer.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        outer.wait(timeout=60)
