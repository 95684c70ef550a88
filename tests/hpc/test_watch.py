"""``hpc status RUN --watch`` (hpc.watch): what a pipe gets, the end status, Ctrl-C.

The scheduler is scripted here (the real SLURM: tests/hpc/test_watch_slurm.py); the run's files
are real: metrics.jsonl lines as the trainer writes them and run.json events written
by ddp.supervise's own ``record``. ``sleep`` is where the next thing happens, so no test
waits on a clock."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from ddp.supervise import record
from hpc import watch
from hpc.errors import UserError


class Scripted(watch.Watcher):
    """A Watcher whose scheduler answers from a list (one entry a query); the files are
    the run directory's own."""

    def __init__(self, run_dir: Path, states: list[str]) -> None:
        self.run_dir, self.states, self.asked = run_dir, states, 0
        self.ident, self.runs_dir = str(run_dir), run_dir.parent

    def look(self) -> watch.View:
        state = self.states[min(self.asked, len(self.states) - 1)]
        self.asked += 1
        metrics, (restarts, excluded, stopped) = watch.local_parts(self.run_dir)
        return watch.View("42", state, [], metrics, restarts, excluded, stopped)

    final = look


def _metrics(run_dir: Path, step: int, loss: float, slow: int) -> None:
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write(
            json.dumps(
                {
                    "kind": "train",
                    "step": step,
                    "loss": loss,
                    "samples_per_s": 100.0 + step,
                    "slowest_rank": float(slow),
                }
            )
            + "\n"
        )


def test_a_pipe_gets_a_line_only_when_it_changes(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{}")
    w = Scripted(tmp_path, ["PENDING", "RUNNING", "RUNNING", "RUNNING", "RUNNING", "COMPLETED"])
    script = iter(
        [
            lambda: None,  # nothing new: nothing printed
            lambda: _metrics(tmp_path, 2, 1.5, 1),
            lambda: record(tmp_path, {"event": "exclude", "excluded": ["n2"], "nodes": ["n2"]}),
            lambda: (
                record(tmp_path, {"event": "restart", "attempt": 2}),
                _metrics(tmp_path, 4, 1.25, 0),
            ),
            lambda: None,
        ]
    )
    out, err = io.StringIO(), io.StringIO()
    code = watch.run(
        "r", tmp_path, None, out, err, tty=False, sleep=lambda _: next(script)(), watcher=w
    )
    assert code == 0 and err.getvalue() == "hpc: job ended: COMPLETED\n"
    assert out.getvalue().splitlines() == [
        "job 42 PENDING",
        "job 42 RUNNING",
        "metrics step 2 loss 1.5 samples/s 102.0",
        "slowest rank 1",
        "supervisor: 0 restarts, excluded n2",
        "metrics step 4 loss 1.25 samples/s 104.0",
        "slowest rank 0",
        "supervisor: 1 restart, excluded n2",
        "job 42 COMPLETED",
    ]


def test_the_end_state_is_the_last_line_even_when_the_last_metrics_come_with_it(
    tmp_path: Path,
) -> None:
    """The job's last metrics and its end can be seen in one look (the scheduler was
    asked just after rank 0's last write): a pipe still ends on the job's state, which a
    script reading the watch's last line relies on; a failure's lines follow it."""
    for end in ("COMPLETED", "FAILED"):
        run_dir = tmp_path / end
        run_dir.mkdir()
        (run_dir / "run.json").write_text("{}")
        w = Scripted(run_dir, ["RUNNING", end])
        out = io.StringIO()
        watch.run(
            "r",
            run_dir,
            None,
            out,
            io.StringIO(),
            tty=False,
            sleep=lambda _, d=run_dir: _metrics(d, 9, 0.5, 1),
            watcher=w,
        )
        lines = out.getvalue().splitlines()
        assert lines[:3] == [
            "job 42 RUNNING",
            "metrics step 9 loss 0.5 samples/s 109.0",
            "slowest rank 1",
        ]
        assert lines[3] == f"job 42 {end}", lines
        assert len(lines) == 4 or end == "FAILED", lines


def test_a_job_that_failed_is_a_failing_exit(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{}")
    w = Scripted(tmp_path, ["RUNNING", "FAILED"])
    code = watch.run(
        "r",
        tmp_path,
        None,
        io.StringIO(),
        io.StringIO(),
        tty=False,
        sleep=lambda _: None,
        watcher=w,
    )
    assert code == 1


def test_ctrl_c_leaves_with_130_and_asks_nothing_more(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{}")
    w = Scripted(tmp_path, ["RUNNING"])

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    err = io.StringIO()
    for tty in (False, True):
        w.asked = 0
        code = watch.run(
            "r", tmp_path, None, io.StringIO(), err, tty=tty, sleep=interrupted, watcher=w
        )
        assert code == 130 and w.asked == 1
    assert "the job was not touched" in err.getvalue()


def test_a_terminal_gets_the_live_view_ending_in_the_final_state(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{}")
    _metrics(tmp_path, 6, 0.5, 1)
    w = Scripted(tmp_path, ["RUNNING", "COMPLETED"])
    out = io.StringIO()
    assert (
        watch.run(
            "r", tmp_path, None, out, io.StringIO(), tty=True, sleep=lambda _: None, watcher=w
        )
        == 0
    )
    assert "job 42 COMPLETED" in out.getvalue() and "metrics step 6 loss 0.5" in out.getvalue()


def test_the_last_metrics_line_is_read_from_the_tail_and_half_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    pad = json.dumps({"kind": "train", "step": 0, "note": "x" * 1000})
    lines = [pad] * 200 + [
        json.dumps({"kind": "train", "step": 7, "loss": 2.0}),
        json.dumps({"kind": "eval", "step": 7, "loss": 1.0}),
    ]
    path.write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a line being written
    assert path.stat().st_size > watch.TAIL_BYTES
    assert watch.last_metrics(path) == {"kind": "train", "step": 7, "loss": 2.0}
    assert watch.last_metrics(tmp_path / "none.jsonl") is None
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="named pipe"):
        watch.last_metrics(fifo)  # never a hang


def test_malformed_supervisor_blocks_count_as_absent() -> None:
    for rec in (
        {},
        {"supervisor": []},
        {"supervisor": {"events": "x"}},
        {"supervisor": {"events": [1, None, {"event": "exclude", "excluded": "n2"}]}},
    ):
        assert watch.supervisor_events(rec) == (0, [], None)
    rec = {"supervisor": {"events": [{"event": "restart"}, {"event": "stopped", "why": "w"}]}}
    assert watch.supervisor_events(rec) == (1, [], "w")
    assert watch.metrics_line({"step": True, "loss": float("nan")}) == "metrics (no step yet)"


def _chain(fake_bin, tmp_path: Path, squeue: str) -> Path:
    """A 3-segment SLURM chain submitted through the CLI against fake clients."""
    from hpc.cli import main

    fake_bin("sbatch", 'n=$(grep -c "^sbatch" "$FAKE_LOG"); echo "$((500 + n))"')
    fake_bin("squeue", squeue)
    fake_bin("scontrol", 'echo "JobId=$3 ExitCode=0:0"')
    assert (
        main(
            [
                "submit",
                "--cluster",
                "slurm",
                "--account",
                "p",
                "--name",
                "t",
                "--chain",
                "3",
                "--runs-dir",
                str(tmp_path / "runs"),
                "--",
                "python",
                "t.py",
            ]
        )
        == 0
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def test_watch_asks_the_scheduler_once_a_look_for_every_segment(
    fake_bin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Batched as plain ``hpc status`` is: one squeue a look for the job and its three
    segments, and the scheduler is asked again only when its Backoff is due."""
    from hpc.cli import main

    squeue = (
        'n=$(grep -c "^squeue" "$FAKE_LOG"); s=RUNNING; [ "$n" -ge 3 ] && s=COMPLETED; '
        'printf "501|501|$s\\n502|502|$s\\n503|503|$s\\n"'
    )
    run_dir = _chain(fake_bin, tmp_path, squeue)
    capsys.readouterr()
    ticks: list[float] = []
    now = [0.0]
    monkeypatch.setattr(
        watch, "_sleep", lambda s: (ticks.append(s), now.__setitem__(0, now[0] + s))
    )
    monkeypatch.setattr(watch, "_clock", lambda: now[0])
    assert main(["status", str(run_dir), "--watch"]) == 0
    calls = [c for c in fake_bin.log.read_text().splitlines() if c.startswith("squeue")]
    # asked at t=0, 1 and 3 s (Backoff 1 s, doubling), then once more for the end state;
    # the look at t=2 read only the files
    assert len(calls) == 4 and ticks == [1.0, 1.0, 1.0], (calls, ticks)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "job 501 RUNNING" and out[-1] == "  503 COMPLETED segment 3/3"


def test_plain_status_names_restarts_and_excluded_nodes(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpc.cli import main

    run_dir = _chain(fake_bin, tmp_path, 'printf "501|501|RUNNING\\n"')
    record(run_dir, {"event": "exclude", "nodes": ["n2"], "excluded": ["n2"]})
    record(run_dir, {"event": "restart", "attempt": 2})
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines()[0] == "501 RUNNING"  # stdout keeps its JOBID STATE lines
    assert got.err == "supervisor: 1 restart, excluded n2\n"


# --- a failed job: the view ends with its failing rank (hpc.failure) ---------------------

FAILING = Path(__file__).parent / "data" / "failing-rank"  # a real 2-node run: rank 1 raised


def _failed_run(tmp_path: Path, layout: str) -> tuple[Path, Path]:
    """(runs folder, run directory) holding a copy of a real failed run's record and logs."""
    import shutil

    runs = tmp_path / "runs"
    run_dir = runs / layout
    shutil.copytree(FAILING / layout, run_dir)
    return runs, run_dir


@pytest.mark.parametrize("layout", ["rank-files", "labelled-log"])
def test_a_failed_job_ends_the_watch_with_its_failing_rank(
    fake_bin,
    tmp_path: Path,
    layout: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through the CLI, against scripted squeue/scontrol answers: the watch's last lines
    are the ones plain ``hpc status`` prints on stderr (rank 1, its node n2, its last
    lines), and it exits with the job's own code (scontrol's ExitCode 3)."""
    from hpc.cli import main

    runs, run_dir = _failed_run(tmp_path, layout)
    job = json.loads((run_dir / "run.json").read_text())["job_id"]
    fake_bin(
        "squeue",
        f'n=$(grep -c "^squeue" "$FAKE_LOG"); s=RUNNING; [ "$n" -ge 2 ] && s=FAILED; '
        f'echo "{job}|{job}|$s"',
    )
    fake_bin("scontrol", f'echo "JobId={job} ExitCode=3:0"')
    monkeypatch.setattr(watch, "_sleep", lambda s: None)
    code = main(["status", str(run_dir), "--runs-dir", str(runs), "--watch"])
    got = capsys.readouterr()
    assert code == 3, got
    assert main(["status", str(run_dir), "--runs-dir", str(runs)]) == 0  # FAILED by now
    plain = capsys.readouterr().err.splitlines()
    where = run_dir / "ranks" / "rank-00001.log" if layout == "rank-files" else None
    head = next(ln for ln in plain if ln.startswith("hpc: rank "))
    assert head.startswith("hpc: rank 1 (n2) failed (srun: exited with exit code 1); its last 8")
    assert where is None or f"({where}):" in head
    out = got.out.splitlines()
    assert out[:2] == [f"job {job} RUNNING", f"job {job} FAILED"], out
    assert out[2:] == plain[plain.index(head) :], out  # the same summary, whole
    assert out[-1] == "  | [rank1]: RuntimeError: boom-on-rank-1"
    assert not any("rank0-" in ln for ln in out)
    assert got.err == "hpc: job ended: FAILED\n"


def test_the_live_view_of_a_failed_job_shows_its_failing_rank(tmp_path: Path) -> None:
    """On a terminal (rich Live) the last frame holds the summary too."""
    _, run_dir = _failed_run(tmp_path, "rank-files")
    w = Scripted(run_dir, ["RUNNING", "FAILED"])
    out = io.StringIO()
    code = watch.run(
        "r", run_dir, None, out, io.StringIO(), tty=True, sleep=lambda _: None, watcher=w
    )
    assert code == 1  # no scheduler to ask for the code here: a failed job is never 0
    shown = out.getvalue()
    assert "job 42 FAILED" in shown
    assert "hpc: rank 1 (n2) failed (srun: exited with exit code 1); its last 8 lines" in shown
    assert "  | [rank1]: RuntimeError: boom-on-rank-1" in shown


def test_no_failing_rank_for_a_job_that_completed(tmp_path: Path) -> None:
    """The same logs, but the scheduler says COMPLETED: no summary (the rule of plain
    ``hpc status``: only a FAILED job names a failing rank)."""
    _, run_dir = _failed_run(tmp_path, "rank-files")
    w = Scripted(run_dir, ["RUNNING", "COMPLETED"])
    out = io.StringIO()
    watch.run("r", run_dir, None, out, io.StringIO(), tty=False, sleep=lambda _: None, watcher=w)
    assert out.getvalue().splitlines() == ["job 42 RUNNING", "job 42 COMPLETED"]


def test_an_unreadable_rank_log_is_one_line_and_the_jobs_status_still_given(
    tmp_path: Path,
) -> None:
    """A FIFO where the job log should be: the view says so in one line (never a hang,
    never a traceback) and the watch still exits with the failed job's status."""
    _, run_dir = _failed_run(tmp_path, "rank-files")
    log = run_dir / "e2e-1.out"
    log.unlink()
    os.mkfifo(log)
    w = Scripted(run_dir, ["FAILED"])
    out = io.StringIO()
    code = watch.run(
        "r", run_dir, None, out, io.StringIO(), tty=False, sleep=lambda _: None, watcher=w
    )
    assert code == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "job 42 FAILED" and len(lines) == 2, lines
    assert lines[1].startswith("hpc: no failing rank named: ") and "named pipe" in lines[1]


def test_a_local_job_whose_process_is_gone_ends_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hpc run`` killed with its job (kill -9: no end state recorded) leaves a record
    saying RUNNING and a pid that is gone. The local scheduler says UNKNOWN, which here
    is final (nothing runs it again): the watch ends, as ``hpc logs -f`` does, instead
    of printing UNKNOWN forever (found by an adversarial pass)."""
    from hpc.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "--cluster", "local", "--name", "k", "--", "true"]) == 0
    capsys.readouterr()
    (run_dir,) = (tmp_path / "runs").glob("k-*")
    record = json.loads((run_dir / "run.json").read_text())
    record["state"] = "RUNNING"  # what a killed hpc run leaves
    record.pop("exit_code", None)
    (run_dir / "run.json").write_text(json.dumps(record))
    looks = []

    def sleep(_: float) -> None:
        looks.append(1)
        if len(looks) > 50:  # the old watch never ended: fail instead of hanging
            raise AssertionError("the watch of a job that is gone did not end")

    out, err = io.StringIO(), io.StringIO()
    code = watch.run(str(run_dir), tmp_path / "runs", None, out, err, tty=False, sleep=sleep)
    assert err.getvalue() == "hpc: job ended: UNKNOWN\n"
    assert code == 1 and out.getvalue().split() == ["job", record["job_id"], "UNKNOWN"]


def test_unknown_from_a_remote_scheduler_does_not_end_the_watch() -> None:
    """On SLURM or PBS, UNKNOWN may be a client that did not answer this time."""
    assert not watch.View("7", "UNKNOWN").ended
    assert watch.View("7", "UNKNOWN", unknown_ended=True).ended
    assert not watch.View("7", "RUNNING", unknown_ended=True).ended
    assert not watch.View("7", "UNKNOWN", [("7_1", "a", "RUNNING")], unknown_ended=True).ended
