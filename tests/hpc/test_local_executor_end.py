"""How an ended ``hpc.executor`` local job is reported (``executor_end_state``): from the
logs and result pickles submitit leaves in the run directory, read without unpickling.

The real jobs (a success, a raise, a cancel) are in ``test_python_api``; here the files
are made by hand, as submitit writes them (``PID_T_log.out``, ``PID_T_result.pkl`` holding
``("success", value)`` or ``("error", traceback)``), and as an attacker or a damaged disk
would leave them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from hpc.schedulers import JobState
from hpc.schedulers.local import executor_end_state

PID = 4242
JOB = f"local-{PID}-123"


def _task(run_dir: Path, t: int, result: object | bytes | None) -> None:
    (run_dir / f"{PID}_{t}_log.out").write_text("")
    if result is None:
        return
    data = result if isinstance(result, bytes) else pickle.dumps(result, protocol=5)
    (run_dir / f"{PID}_{t}_result.pkl").write_bytes(data)


@pytest.mark.parametrize(
    ("results", "cancelled", "state"),
    [
        ([("success", 1), ("success", [2] * 10_000)], False, JobState.COMPLETED),
        ([("success", 1), ("error", "Traceback ...")], False, JobState.FAILED),
        ([("error", "Traceback ...")], True, JobState.FAILED),  # it failed before the cancel
        ([("success", 1), None], False, JobState.FAILED),  # a rank killed: no result
        ([None, None], True, JobState.CANCELLED),
        ([], False, JobState.FAILED),  # the controller ended before it started a task
    ],
    ids=["all-success", "one-error", "error-then-cancel", "killed-rank", "cancelled", "none"],
)
def test_end_state_from_the_folder(
    tmp_path: Path, results: list[object], cancelled: bool, state: JobState
) -> None:
    for t, result in enumerate(results):
        _task(tmp_path, t, result)
    (tmp_path / f"{PID + 1}_0_log.out").write_text("")  # another job's task: not this one's
    assert executor_end_state(tmp_path, JOB, cancelled) == state


class _Planted:
    """A pickle that, if loaded, would create the file named by ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.target), "w"))


@pytest.mark.parametrize("kind", ["reduce", "other-word", "truncated", "not-pickle", "fifo"])
def test_a_crafted_or_damaged_result_is_never_loaded_and_says_unknown(
    tmp_path: Path, kind: str
) -> None:
    """The pickle is untrusted: nothing in it runs; anything but submitit's own start is
    UNKNOWN, not COMPLETED (a planted "success" later in the stream does not count)."""
    target = tmp_path / "pwned"
    _task(tmp_path, 0, ("success", 1))
    bad = tmp_path / f"{PID}_1_result.pkl"
    (tmp_path / f"{PID}_1_log.out").write_text("")
    if kind == "reduce":
        bad.write_bytes(pickle.dumps((_Planted(target), "success"), protocol=5))
    elif kind == "other-word":
        bad.write_bytes(pickle.dumps(("succeeded", 1), protocol=2))
    elif kind == "truncated":
        bad.write_bytes(pickle.dumps(("success", 1), protocol=5)[:5])
    elif kind == "not-pickle":
        bad.write_bytes(b"\x00\xff" * 100)
    else:
        os.mkfifo(bad)
    assert executor_end_state(tmp_path, JOB, cancelled=False) == JobState.UNKNOWN
    assert not target.exists()


def test_no_start_time_or_no_proc_cannot_tell_ended_from_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Missing results prove an end only where the job was known gone: not for an old
    ``local-PID`` id (the pid alone may be another process) nor without ``/proc``. A full
    set of results proves it anywhere."""
    _task(tmp_path, 0, None)
    assert executor_end_state(tmp_path, f"local-{PID}", cancelled=False) == JobState.UNKNOWN
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p != "/proc/self" and real_isdir(p))
    assert executor_end_state(tmp_path, JOB, cancelled=True) == JobState.UNKNOWN
    _task(tmp_path, 0, ("success", None))
    assert executor_end_state(tmp_path, JOB, cancelled=False) == JobState.COMPLETED
