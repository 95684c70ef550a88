"""hpc.failure: which rank failed and its last lines (issue 31 item 2), on real logs.

The logs under data/failing-rank/ come from a real 2-node run on the test SLURM cluster
(tests/test_e2e_failing_rank.py's probe: rank 1 prints 20 numbered lines, an escape
sequence with NUL and BEL, invalid UTF-8, then raises; srun ends rank 0): ``rank-files``
with ``per_rank_logs: true`` (ranks/rank-0000N.log, the job log e2e-1.out), and
``labelled-log`` without (``srun --label``, the job log e2e-2.out). Each test copies
them to a temporary folder and changes only what it is about.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hpc import failure

DATA = Path(__file__).parent / "data" / "failing-rank"
TAIL = [
    "rank1-line-18",
    "rank1-line-19",
    "bad bytes: \ufffd[31m\ufffd\ufffd end",
    "\ufffd\ufffd not utf-8",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:     raise RuntimeError("boom-on-rank-1")',
    "[rank1]: RuntimeError: boom-on-rank-1",
]


def _run(tmp_path: Path, layout: str) -> Path:
    run_dir = tmp_path / layout
    shutil.copytree(DATA / layout, run_dir)
    return run_dir


def _job_log(run_dir: Path) -> Path:
    (log,) = run_dir.glob("e2e-*.out")
    return log


def _drop_lines(path: Path, needle: bytes) -> None:
    path.write_bytes(
        b"".join(ln for ln in path.read_bytes().splitlines(keepends=True) if needle not in ln)
    )


def _quoted(lines: list[str]) -> list[str]:
    assert all(ln.startswith("  | ") for ln in lines[1:]), lines
    return [ln[4:] for ln in lines[1:]]


@pytest.mark.parametrize("layout", ["rank-files", "labelled-log"])
def test_srun_names_rank_1_and_its_node_and_its_last_lines_are_quoted(
    tmp_path: Path,
    layout: str,
) -> None:
    run_dir = _run(tmp_path, layout)
    lines = failure.failing_rank_lines(run_dir)
    where = run_dir / "ranks" / "rank-00001.log" if layout == "rank-files" else _job_log(run_dir)
    assert lines[0] == (
        f"hpc: rank 1 (n2) failed (srun: exited with exit code 1); its last 8 lines ({where}):"
    )
    quoted = _quoted(lines)
    assert len(quoted) == 8
    assert quoted[:5] == TAIL[:5] and quoted[-2:] == TAIL[-2:]
    assert not any("rank0-" in q for q in quoted)


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ("rank-files", "its log holds an error"),
        ("labelled-log", "the first error line of the job log"),
    ],
)
def test_without_srun_report_the_rank_with_the_traceback(
    tmp_path: Path,
    layout: str,
    why: str,
) -> None:
    """A launcher that reports no task exits (rule 3): the rank's own error lines."""
    run_dir = _run(tmp_path, layout)
    _drop_lines(_job_log(run_dir), b"srun: ")
    lines = failure.failing_rank_lines(run_dir, lines=3)
    assert (
        lines[0].startswith(f"hpc: rank 1 (n2) failed ({why}); its last 3 lines (")
        if layout == "rank-files"
        else lines[0].startswith(f"hpc: rank 1 (?) failed ({why})")
    )
    quoted = _quoted(lines)
    assert quoted[0].startswith('[rank1]:   File "') and quoted[1:] == TAIL[-2:]


def test_pals_names_the_rank_that_exited_by_error_not_the_cascade(tmp_path: Path) -> None:
    """PALS's own lines (as ALCF's ezpz captured them): the clean exits and the SIGTERM
    cascade name nothing; ``HOST: rank 1 exited with code 1`` names rank 1 and its host."""
    run_dir = _run(tmp_path, "labelled-log")
    log = _job_log(run_dir)
    _drop_lines(log, b"srun: ")
    with log.open("ab") as fh:
        fh.write(
            b"x4102c5s0b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov: rank 0 died from signal 15\n"
            b"x4102c5s1b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov: rank 2 exited with code 0\n"
            b"x4102c5s1b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov: rank 1 exited with code 1\n"
        )
    lines = failure.failing_rank_lines(run_dir)
    assert lines[0].startswith(
        "hpc: rank 1 (x4102c5s1b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov) "
        "failed (mpiexec: exited with exit code 1); its last 8 lines"
    )
    assert _quoted(lines)[-1] == "[rank1]: RuntimeError: boom-on-rank-1"


def test_a_peers_later_traceback_does_not_win_in_the_merged_log(tmp_path: Path) -> None:
    """Rank 0's traceback about the closed connection comes after rank 1's: rank 1."""
    run_dir = _run(tmp_path, "labelled-log")
    log = _job_log(run_dir)
    _drop_lines(log, b"srun: ")
    with log.open("ab") as fh:
        fh.write(b"0: Traceback (most recent call last):\n0: RuntimeError: Connection closed\n")
    assert failure.failing_rank_lines(run_dir)[0].startswith("hpc: rank 1 ")


def test_supervisor_failure_record_names_the_rank(tmp_path: Path) -> None:
    """No srun report, no error line: the latest supervisor failure event in run.json."""
    run_dir = _run(tmp_path, "rank-files")
    _drop_lines(_job_log(run_dir), b"srun: ")
    _drop_lines(run_dir / "ranks" / "rank-00001.log", b"[rank1]")
    record = json.loads((run_dir / "run.json").read_text())
    record["supervisor"] = {
        "events": [
            {"event": "failure", "attempt": 1, "ranks": [0], "nodes": ["n1"]},
            {"event": "restart", "attempt": 2},
            {"event": "failure", "attempt": 2, "ranks": [1], "nodes": ["n2"]},
        ]
    }
    lines = failure.failing_rank_lines(run_dir, record, lines=2)
    assert lines[0].startswith(
        "hpc: rank 1 (n2) failed (the supervisor's failure record (run.json)); its last 2 lines"
    )
    assert _quoted(lines) == TAIL[2:4]


@pytest.mark.parametrize(
    "bad", [{"events": "x"}, {"events": [{"event": "failure", "ranks": ["1", True, -1]}]}]
)
def test_malformed_supervisor_record_names_nothing(tmp_path: Path, bad: dict) -> None:
    run_dir = _run(tmp_path, "rank-files")
    _drop_lines(_job_log(run_dir), b"srun: ")
    _drop_lines(run_dir / "ranks" / "rank-00001.log", b"[rank1]")
    assert failure.failing_rank_lines(run_dir, {"supervisor": bad}) == []


def test_no_failure_evidence_is_no_lines(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "labelled-log")
    log = _job_log(run_dir)
    _drop_lines(log, b"srun: ")
    _drop_lines(log, b"[rank1]")
    assert failure.failing_rank_lines(run_dir) == []


def test_huge_binary_log_is_read_from_its_end_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 MiB of binary without a newline before the real lines, and a 1 MiB last line:
    at most TAIL_BYTES are read, each quoted line is cut to MAX_CHARS."""
    run_dir = _run(tmp_path, "rank-files")
    path = run_dir / "ranks" / "rank-00001.log"
    real = path.read_bytes()
    path.write_bytes(
        real[:40]
        + os.urandom(8 << 20).replace(b"\n", b"x")
        + b"\n"
        + real[40:]
        + b"Z" * (1 << 20)
        + b"\n"
    )
    reads: list[int] = []
    real_tail = failure._tail

    def counting(p: Path) -> list[bytes]:
        got = real_tail(p)
        reads.append(sum(len(x) + 1 for x in got))
        return got

    monkeypatch.setattr(failure, "_tail", counting)
    lines = failure.failing_rank_lines(run_dir)
    assert reads and all(n <= failure.TAIL_BYTES + 4 for n in reads)  # + the "\u2026" mark
    assert lines[0].startswith("hpc: rank 1 (n2) failed (srun: exited with exit code 1)")
    quoted = _quoted(lines)
    # the window begins inside the 1 MiB line: quoted as cut at both ends
    assert quoted == ["\u2026" + "Z" * (failure.MAX_CHARS - 2) + "\u2026"]
    assert all(len(q) <= failure.MAX_CHARS for q in quoted)


def test_a_fifo_as_rank_log_does_not_block(tmp_path: Path) -> None:
    """A named pipe in ranks/ is refused by the regular-file reader, never waited on."""
    from hpc.errors import UserError

    run_dir = _run(tmp_path, "rank-files")
    path = run_dir / "ranks" / "rank-00001.log"
    path.unlink()
    os.mkfifo(path)
    # ranks/ lists regular files only: rank 1 has no file, the job log has no line of it
    assert failure.failing_rank_lines(run_dir) == [
        f"hpc: rank 1 (n2) failed (srun: exited with exit code 1); no lines of it in the "
        f"end of {_job_log(run_dir)}"
    ]
    (run_dir / "e2e-1.out").unlink()
    os.mkfifo(run_dir / "e2e-1.out")  # the job log a FIFO: one line, not a hang
    with pytest.raises(UserError, match="regular file"):
        failure.failing_rank_lines(run_dir)
