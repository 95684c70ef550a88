"""hpc submit --chain N / --after JOBID[:KIND] (hpc.chain): the submit commands, the
record, the status lines, the refusals and the no-half-chain rule, with fake clients
(the real OpenPBS chain is tests/test_e2e_pbs.py's)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hpc.cli import main

QSUB_COUNTER = 'n=$(( $(cat "$FAKE_LOG" | grep -c "^qsub") )); echo "$((100 + n)).server"'


def _calls(fake_bin, name: str) -> list[str]:
    log = fake_bin.log
    return (
        [line for line in log.read_text().splitlines() if line.startswith(name + " ")]
        if log.exists()
        else []
    )


def _submit(tmp_path: Path, *flags: str, cluster: str = "pbs") -> int:
    return main(
        [
            "submit",
            "--cluster",
            cluster,
            "--account",
            "p",
            "--name",
            "t",
            "--runs-dir",
            str(tmp_path / "runs"),
            *flags,
            "--",
            "python",
            "train.py",
        ]
    )


def test_chain_queues_each_segment_afterany_the_one_before(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("qsub", QSUB_COUNTER)
    assert _submit(tmp_path, "--chain", "3") == 0
    calls = _calls(fake_bin, "qsub")
    assert len(calls) == 3
    assert "depend" not in calls[0]
    assert "-W depend=afterany:101.server " in calls[1]
    assert "-W depend=afterany:102.server " in calls[2]
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["job_id"] == "101.server"
    assert [s["job_id"] for s in record["chain"]] == ["101.server", "102.server", "103.server"]
    script = Path(record["script"]).read_text()
    assert 'if [ -e "$HPC_RUN_DIR/chain.done" ]' in script
    # the marker is written after the launch line only (set -e: the command exited 0)
    assert script.index("mpiexec") < script.index('mv -f "$HPC_RUN_DIR/.chain.done.tmp"')
    assert script.index('[ -e "$HPC_RUN_DIR/chain.done" ]') < script.index("mpiexec")
    assert "3 segments queued" in capsys.readouterr().err


def test_plain_submit_has_no_chain_lines(fake_bin, tmp_path: Path) -> None:
    fake_bin("qsub", QSUB_COUNTER)
    assert _submit(tmp_path) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert "chain" not in record and "chain.done" not in Path(record["script"]).read_text()


def test_a_refused_segment_cancels_the_queued_ones(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin(
        "qsub",
        'n=$(grep -c "^qsub" "$FAKE_LOG"); [ "$n" -ge 3 ] && '
        '{ echo "qsub: would exceed queue limit" >&2; exit 38; }; echo "$((100 + n)).server"',
    )
    fake_bin("qdel", "exit 0")
    assert _submit(tmp_path, "--chain", "4") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "segment 3 of 4 was refused" in err[0]
    assert "cancelled the 2 segment(s) already queued (101.server, 102.server)" in err[0]
    assert sorted(_calls(fake_bin, "qdel")) == ["qdel 101.server", "qdel 102.server"]
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["state"] == "CANCELLED" and "segment 3 of 4" in record["error"]


@pytest.mark.parametrize(
    "flags",
    [
        ("--chain", "0"),
        ("--chain", "-1"),
        ("--chain", "101"),
        ("--chain", "99999999999"),
        ("--chain", "x"),
        ("--chain", "٣"),
        ("--after", "garbage"),
        ("--after", "12:maybe"),
        ("--after", "12;rm -rf ~"),
        ("--after", ""),
        ("--after", ":ok"),
        ("--chain", "2", "--sweep", "optim.lr=1,2"),
    ],
)
def test_bad_input_is_one_line_and_nothing_submitted(
    fake_bin, tmp_path: Path, flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("qsub", QSUB_COUNTER)
    assert _submit(tmp_path, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpc: error: --") and "allowed" in err[0]
    assert _calls(fake_bin, "qsub") == []
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize(
    ("cluster", "after", "words"),
    [
        ("pbs", "7.server", "-W depend=afterok:7.server"),
        ("pbs", "7[].server:any", "-W depend=afterany:7[].server"),  # not Torque's afteranyarray
        ("pbs", "7[].server:notok", "-W depend=afternotok:7[].server"),
        ("pbs", "7[3].server:ok", "-W depend=afterok:7[3].server"),
        ("slurm", "42", "--dependency=afterok:42"),
        ("slurm", "42_3:any", "--dependency=afterany:42_3"),
    ],
)
def test_after_renders_the_scheduler_dependency(
    tmp_path: Path, cluster: str, after: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _submit(tmp_path, "--dry-run", "--after", after, cluster=cluster) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("# submit:")]
    assert f" {shlex.join(words.split())} " in line


def test_dry_run_of_a_chain_shows_every_segment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _submit(tmp_path, "--dry-run", "--chain", "3", cluster="slurm") == 0
    out = capsys.readouterr().out
    assert "--dependency=afterany:SEGMENT1" in out and "--dependency=afterany:SEGMENT2" in out
    assert "segment 3/3" in out and not (tmp_path / "runs").exists()


def test_local_has_no_dependencies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _submit(tmp_path, "--chain", "2", cluster="local") == 2
    assert "has no job dependencies" in capsys.readouterr().err


def test_status_lists_the_segments(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One squeue names every segment; hpc status prints a line per segment."""
    fake_bin("sbatch", 'n=$(grep -c "^sbatch" "$FAKE_LOG"); echo "$((500 + n))"')
    fake_bin("squeue", 'printf "501|501|RUNNING\\n502|502|PENDING\\n503|503|PENDING\\n"')
    assert _submit(tmp_path, "--chain", "3", cluster="slurm") == 0
    capsys.readouterr()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert main(["status", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "501 RUNNING"
    assert lines[1:] == [
        "501 RUNNING segment 1/3",
        "502 PENDING segment 2/3",
        "503 PENDING segment 3/3",
    ]
    assert len(_calls(fake_bin, "squeue")) == 1


def test_site_rules_refuse_before_submitting(
    fake_bin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile's no_dependencies / max_queued: one line, exit 2, nothing queued."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "site.yaml").write_text(
        "scheduler: pbs\ndevice: cpu\nppn: 1\nqueues:\n"
        "  debug: {nodes: 1-2, walltime: '01:00:00', no_dependencies: 'site docs: no chains'}\n"
        "  small: {nodes: 1-2, walltime: '01:00:00', max_queued: 2}\n"
    )
    fake_bin("qsub", QSUB_COUNTER)
    monkeypatch.setenv("HPC_DDP_CLUSTERS", str(profiles))
    assert _submit(tmp_path, "--chain", "2", "--queue", "debug", cluster="site") == 2
    assert "takes no job dependencies (site docs: no chains)" in capsys.readouterr().err
    assert _submit(tmp_path, "--chain", "3", "--queue", "small", cluster="site") == 2
    assert "at most 2 queued jobs per user" in capsys.readouterr().err
    assert _calls(fake_bin, "qsub") == []


def test_pbs_status_of_several_finished_jobs_asks_again_for_those_json_left_out(fake_bin) -> None:
    """OpenPBS 23.06's ``qstat -x -f -F json A B`` of finished jobs prints A alone (seen
    on the real server with a chain's segments): B is read from ``qstat -x -f``."""
    from hpc.schedulers.pbs import PBS

    fake_bin(
        "qstat",
        r"""if [ "$3" = "-F" ]; then
  printf '{"Jobs": {"1.s": {"job_state": "F", "Exit_status": -29, "substate": 93}}}\n'
else
  printf 'Job Id: 1.s\n    job_state = F\n    Exit_status = -29\n    substate = 93\n\n'
  printf 'Job Id: 2.s\n    job_state = F\n    Exit_status = 0\n    substate = 92\n\n'
fi""",
    )
    states = PBS().statuses(["1.s", "2.s"])
    assert {k: str(v) for k, v in states.items()} == {"1.s": "TIMEOUT", "2.s": "COMPLETED"}
