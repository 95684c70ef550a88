"""A failing rank's last lines in ``hpc status RUN`` (issue 31 item 2), on the real SLURM:
2 nodes x 1 rank, rank 1 raises after printing numbered lines while rank 0 waits; srun
(--kill-on-bad-exit) then ends rank 0. Both log layouts: per-rank files, and the
rank-labelled merged job log. The status names rank 1, its node n2, and quotes its last
lines; rank 0's lines are never quoted. ``hpc status RUN --watch`` ends with the same
lines and the job's exit status. And the same on the real OpenPBS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_e2e_schedulers import PY, hpc, submit, wait_status, write_spec

PROBE = """\
import sys, time
import ddp
r = ddp.init().rank
for i in range(20):
    print(f"rank{r}-line-{i}", flush=True)
if r == 1:
    print("bad bytes: \\x1b[31m\\x00\\x07 end", flush=True)
    sys.stdout.buffer.write(b"\\xff\\xfe not utf-8\\n")
    sys.stdout.flush()
    raise RuntimeError("boom-on-rank-1")
time.sleep(120)  # srun ends this rank once rank 1 has failed
"""


def _failed_status(tmp_path: Path, per_rank: bool) -> tuple[str, Path, str]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    runs = tmp_path / "runs"
    fields = {"per_rank_logs": True} if per_rank else {}
    spec = write_spec(tmp_path / "f.yaml", [PY, str(probe)], nodes=2, ppn=1, **fields)
    job_id, run_dir = submit(str(spec), runs=runs)
    assert wait_status(job_id, runs) == "FAILED"
    got = hpc("status", job_id, "--runs-dir", str(runs))
    assert got.stdout.strip() == f"{job_id} FAILED"
    return job_id, run_dir, got.stderr


#: rank 1's stdout and stderr as the probe writes them: the quoted form of the escape and
#: NUL/BEL bytes and of the invalid UTF-8 is U+FFFD, never the raw bytes.
OUT = [f"rank1-line-{i}" for i in range(20)] + [
    "bad bytes: \ufffd[31m\ufffd\ufffd end",
    "\ufffd\ufffd not utf-8",
]
ERR = [
    "[rank1]: Traceback (most recent call last):",
    "[rank1]:   File ",  # the probe's path follows
    '[rank1]:     raise RuntimeError("boom-on-rank-1")',
    "[rank1]: RuntimeError: boom-on-rank-1",
]


def assert_rank1_tail(quoted: list[str], merged: bool, err: str) -> None:
    """The 8 quoted lines are rank 1's last 8. In a per-rank file that is stdout's last 4
    then the traceback: rank 1's stdout is written into its file directly (ddp.rank_logs),
    each line as it is printed, and its stderr through a tee, so the traceback, raised
    after the last print, is appended after it. In a merged job log
    srun and hydra forward stdout and stderr through separate pipes, so the two streams may
    interleave in any order: there the lines must be the last of each stream, each in its
    own order (a suffix of each: which stream's pipe srun or hydra reads last is theirs)."""
    assert len(quoted) == 8 and not any("rank0-" in q for q in quoted), err
    errs = [q for q in quoted if q.startswith("[rank1]:")]
    outs = [q for q in quoted if not q.startswith("[rank1]:")]
    tail = ERR[len(ERR) - len(errs) :]
    assert len(errs) <= len(ERR) and all(
        q.startswith(e) for q, e in zip(errs, tail, strict=True)
    ), err
    assert outs == OUT[len(OUT) - len(outs) :], err
    if not merged:
        assert quoted == outs + errs and len(errs) == len(ERR), err


@pytest.mark.slurm
@pytest.mark.parametrize("per_rank", [True, False], ids=["rank-files", "labelled-log"])
def test_status_quotes_the_failing_ranks_last_lines(
    slurm_cluster: Any,
    tmp_path: Path,
    per_rank: bool,
) -> None:
    job_id, run_dir, err = _failed_status(tmp_path, per_rank)
    lines = err.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("hpc: rank "))
    head, quoted = lines[start], [ln.removeprefix("  | ") for ln in lines[start + 1 :]]
    where = (run_dir / "ranks" / "rank-00001.log") if per_rank else run_dir / f"e2e-{job_id}.out"
    assert head == (
        f"hpc: rank 1 (n2) failed (srun: exited with exit code 1); its last 8 lines ({where}):"
    ), err
    assert_rank1_tail(quoted, merged=not per_rank, err=err)
    assert not any(c in err for c in "\x1b\x00\x07"), err


@pytest.mark.slurm
def test_watch_ends_with_the_failing_ranks_last_lines(slurm_cluster: Any, tmp_path: Path) -> None:
    """``hpc status RUN --watch`` through a pipe, started right after submit: it ends by
    itself when the job does (the wait is on the watch's own exit, bounded only against a
    hang), its last lines are the summary plain ``hpc status`` prints (rank 1, node n2,
    its last lines), and its exit status is the job's own, as SLURM recorded it."""
    import subprocess

    from tests.test_e2e_schedulers import ROOT

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path / "f.yaml", [PY, str(probe)], nodes=2, ppn=1, per_rank_logs=True)
    job_id, run_dir = submit(str(spec), runs=runs)
    watch = subprocess.run(
        [PY, "-m", "hpc", "status", str(run_dir), "--runs-dir", str(runs), "--watch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # the watch ends when the job does; this bound is against a hang only
    )
    from hpc import core

    code = core.exit_code(str(run_dir), runs)  # what SLURM recorded (hpc logs -f gives it too)
    assert watch.returncode == code and code not in (None, 0), (code, watch.stdout, watch.stderr)
    assert watch.stderr.strip().endswith("hpc: job ended: FAILED"), watch.stderr
    out = watch.stdout.splitlines()
    start = next((i for i, ln in enumerate(out) if ln.startswith("hpc: rank ")), None)
    assert start is not None and out[start - 1] == f"job {job_id} FAILED", out
    where = run_dir / "ranks" / "rank-00001.log"
    assert out[start] == (
        f"hpc: rank 1 (n2) failed (srun: exited with exit code 1); its last 8 lines ({where}):"
    ), out
    quoted = [ln.removeprefix("  | ") for ln in out[start + 1 :]]
    assert_rank1_tail(quoted, merged=False, err="\n".join(out))
    assert not any(c in watch.stdout for c in "\x1b\x00\x07"), out
    plain = hpc("status", job_id, "--runs-dir", str(runs))  # the non-watch command's summary
    assert plain.stderr.splitlines()[-9:] == out[start:], (plain.stderr, out)


@pytest.mark.pbs
def test_pbs_status_quotes_the_failing_ranks_last_lines(
    openpbs: Any, pbs_job_venv: Path, tmp_path: Path
) -> None:
    """The same probe on the real OpenPBS (generic profile: MPICH hydra, its merged log
    labelled ``[RANK] ``): hydra names no rank of its own, so the rank's traceback does."""
    from tests.support.parts import require_exe
    from tests.test_e2e_pbs import Hpc

    require_exe("mpiexec.hydra", "mpiexec.mpich")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.replace("time.sleep(120)", "time.sleep(5)"))  # hydra lets it end
    client = Hpc(pbs_job_venv, tmp_path / "runs")
    try:
        _job_id, run_dir = client.submit(
            "--cluster", "pbs", "--nodes", "2", "--walltime", "00:05:00", "--", "python", str(probe)
        )
        assert client.wait(run_dir, timeout=180) == "FAILED"
        got = client("status", str(run_dir), "--runs-dir", str(client.runs))
    finally:
        openpbs.delete_all(client.submitted)
    lines = got.stderr.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("hpc: rank ")), None)
    assert start is not None, got.stderr
    head, quoted = lines[start], [ln.removeprefix("  | ") for ln in lines[start + 1 :]]
    assert (
        head.startswith("hpc: rank 1 (") and "failed (the first error line of the job log)" in head
    ), got.stderr
    # hydra forwards stdout and stderr through separate pipes: the traceback's last line is
    # among rank 1's last lines, not always the very last (see assert_rank1_tail)
    assert ERR[-1] in quoted, got.stderr
    assert not any("rank0-" in q for q in quoted), got.stderr
