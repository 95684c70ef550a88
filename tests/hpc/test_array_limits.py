"""Issue 32, arrays and chains as cited site rules, through ``hpc submit --dry-run``:

- a sweep wider than its queue's ``array_limit`` is throttled to it (``-J 0-14%10`` on
  Polaris ``prod``, ALCF "Limits on job arrays") and said once; an explicit
  ``--max-parallel`` above the limit is one line, exit 2;
- ``--chain N``/``--after`` in Perlmutter's ``debug`` QOS is one line, exit 2 (NERSC jobs
  policy: "job chaining in the debug QOS is not allowed").

The real OpenPBS check (``%N`` accepted, ``max_run_subjobs`` set) runs under the shared
lock: ``flock /tmp/hpc-openpbs.lock python3 -m pytest -q tests/hpc/test_array_limits.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import profiles
from hpc.cli import main

LRS = ",".join(str(i) for i in range(1, 16))  # 15 tasks


def _submit(tmp_path: Path, cluster: str, *flags: str) -> int:
    return main(
        [
            "submit",
            "--dry-run",
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


def _array_line(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("#PBS -J")]
    return line


@pytest.mark.parametrize(
    ("queue", "nodes", "expected"),
    [
        ("prod", "10", "#PBS -J 0-14%10"),
        ("preemptable", "1", "#PBS -J 0-14"),
        ("debug", "1", "#PBS -J 0-14%1"),
    ],
)
def test_polaris_sweep_is_throttled_to_its_queue_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], queue: str, nodes: str, expected: str
) -> None:
    """15 tasks: prod (10) and debug (1) throttle and say so once; preemptable (20) fits."""
    assert (
        _submit(
            tmp_path, "polaris", "--queue", queue, "--nodes", nodes, "--sweep", f"optim.lr={LRS}"
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert _array_line(out) == expected
    said = [ln for ln in err.splitlines() if "subjobs of an array at once" in ln]
    if expected.endswith("-14"):
        assert said == []
    else:
        limit = expected.rsplit("%", 1)[1]
        assert said == [
            f"hpc: the polaris queue {queue!r} runs at most {limit} subjobs of an "
            f"array at once; the sweep's 15 tasks run {limit} at a time (%{limit})"
        ]


def test_a_sweep_within_the_limit_and_an_explicit_max_parallel_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        _submit(
            tmp_path, "polaris", "--queue", "prod", "--nodes", "10", "--sweep", "optim.lr=1,2,3"
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert _array_line(out) == "#PBS -J 0-2" and "subjobs" not in err
    assert (
        _submit(
            tmp_path,
            "polaris",
            "--queue",
            "prod",
            "--nodes",
            "10",
            "--max-parallel",
            "4",
            "--sweep",
            f"optim.lr={LRS}",
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert _array_line(out) == "#PBS -J 0-14%4" and "subjobs" not in err


def test_max_parallel_above_the_queue_limit_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused, not clamped: the user's number cannot run there (hpc.sweep.throttle)."""
    assert (
        _submit(
            tmp_path,
            "polaris",
            "--queue",
            "prod",
            "--nodes",
            "10",
            "--max-parallel",
            "11",
            "--sweep",
            f"optim.lr={LRS}",
        )
        == 2
    )
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines()[-1] == (
        "hpc: error: --max-parallel: 11; the polaris queue 'prod' runs at most 10 subjobs of an "
        "array at once (the others would wait forever); allowed: 1 to 10"
    )
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_array_limits_are_cited_in_the_profiles() -> None:
    """ALCF's table (debug 1, preemptable 20, prod 10) with its page beside the numbers."""
    polaris = profiles.load("polaris", environ={})
    assert {q: polaris.queues[q].array_limit for q in ("debug", "preemptable", "prod")} == {
        "debug": 1,
        "preemptable": 20,
        "prod": 10,
    }
    aurora = profiles.load("aurora", environ={})
    assert aurora.queues["prod"].array_limit == 10
    root = Path(profiles.BUILTIN_DIR)
    page = "https://docs.alcf.anl.gov/running-jobs/example-job-scripts/#limits-on-job-arrays"
    for name in ("polaris", "aurora"):
        assert page in (root / f"{name}.yaml").read_text()
    assert (
        "unverified"
        in (root / "aurora.yaml").read_text().split("array_limit: 10")[1].splitlines()[0]
    )


def test_a_bad_array_limit_in_a_profile_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "site.yaml").write_text(
        "scheduler: pbs\nqueues:\n  q: {nodes: 1-2, array_limit: 0}\n"
    )
    monkeypatch.setenv("HPC_DDP_CLUSTERS", str(tmp_path))
    assert _submit(tmp_path, "site", "--sweep", "optim.lr=1,2") == 2
    assert (
        "queues.q.array_limit: 0 is not allowed; allowed: a whole number >= 1"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "flags",
    [
        ("--chain", "2", "--queue", "debug"),
        ("--after", "123", "--queue", "debug"),
        ("--chain", "3", "--walltime", "00:10:00"),  # no queue named: debug, the default QOS
    ],
)
def test_perlmutter_debug_qos_refuses_chains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]
) -> None:
    assert _submit(tmp_path, "perlmutter", *flags) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "hpc: error: --chain/--after: the perlmutter queue 'debug' takes no job dependencies "
        "(NERSC: job chaining in the debug QOS is not allowed, https://docs.nersc.gov/jobs/policy/); "
        "allowed: another queue, or one job"
    ]


def test_perlmutter_other_qos_and_one_debug_job_are_fine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _submit(tmp_path, "perlmutter", "--chain", "2", "--queue", "regular") == 0
    assert "--dependency=afterany:SEGMENT1" in capsys.readouterr().out
    assert _submit(tmp_path, "perlmutter", "--queue", "debug") == 0
    assert _submit(tmp_path, "perlmutter", "--after", "123:any", "--queue", "regular") == 0
    assert "--dependency=afterany:123" in capsys.readouterr().out


def _openpbs() -> str | None:
    qsub = "/opt/pbs/bin/qsub"
    if not os.access(qsub, os.X_OK):
        return None
    ok = (
        subprocess.run(["/opt/pbs/bin/qstat", "-B"], capture_output=True, timeout=30).returncode
        == 0
    )
    return qsub if ok else None


@pytest.mark.pbs
def test_openpbs_accepts_the_throttled_array(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rendered ``-J 0-14%10`` on the real OpenPBS 23.06: accepted, max_run_subjobs 10.
    Submitted held (``-h``) and deleted at once: nothing runs."""
    qsub = _openpbs()
    if qsub is None:
        pytest.skip("no OpenPBS server here (scripts/openpbs.sh start)")
    assert (
        _submit(
            tmp_path, "polaris", "--queue", "prod", "--nodes", "10", "--sweep", f"optim.lr={LRS}"
        )
        == 0
    )
    line = _array_line(capsys.readouterr().out)
    script = tmp_path / "arr.pbs"
    script.write_text(f"#!/bin/bash\n{line}\n#PBS -l select=1\n#PBS -l walltime=00:01:00\ntrue\n")
    proc = subprocess.run(
        [qsub, "-h", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    try:
        info = subprocess.run(
            ["/opt/pbs/bin/qstat", "-f", job_id], capture_output=True, text=True, timeout=60
        ).stdout
        assert re.search(r"max_run_subjobs = 10\b", info), info
        assert re.search(r"array_indices_submitted = 0-14\b", info), info
    finally:
        subprocess.run(
            [shutil.which("qdel", path="/opt/pbs/bin") or "qdel", job_id],
            capture_output=True,
            timeout=60,
        )


# --- SLURM MaxArraySize: a wider sweep is several arrays of one sweep ------------------

SCONTROL_11 = (
    'printf "MaxArraySize            = 11\\nSchedulerParameters     = batch_sched_delay=0\\n"'
)
SBATCH_COUNTER = 'n=$(grep -c "^sbatch" "$FAKE_LOG"); echo "$((700 + n))"'
LRS25 = ",".join(str(i) for i in range(25))


def _slurm(tmp_path: Path, *flags: str) -> int:
    return main(
        [
            "submit",
            "--cluster",
            "slurm",
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


def test_array_limit_is_read_from_scontrol_show_config() -> None:
    from hpc.schedulers.slurm import DEFAULT_MAX_ARRAY_SIZE, parse_array_limit

    assert parse_array_limit("MaxArraySize            = 4001\n") == 4001
    assert (
        parse_array_limit(
            "MaxArraySize = 100001\nSchedulerParameters = bf_continue,max_array_tasks=1000\n"
        )
        == 1000
    )
    assert parse_array_limit("") == DEFAULT_MAX_ARRAY_SIZE == 1001
    with pytest.raises(Exception, match="MaxArraySize = 0 .*allowed: one hpc submit per point"):
        parse_array_limit("MaxArraySize = 0\n")


def test_split_offsets_count_from_zero_in_every_array() -> None:
    from hpc.sweep import split

    assert split(2500, 1001) == [(0, 1001), (1001, 1001), (2002, 498)]
    assert split(25, 11) == [(0, 11), (11, 11), (22, 3)]
    assert split(11, 11) == [(0, 11)] and split(5, None) == [(0, 5)]


def test_dry_run_of_a_wide_sweep_shows_every_array(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("scontrol", SCONTROL_11)
    assert _slurm(tmp_path, "--dry-run", "--sweep", f"optim.lr={LRS25}") == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --array=0-10\n" in out
    assert '--offset "${1:-0}"' in out
    then = [ln for ln in out.splitlines() if ln.startswith("# then array")]
    assert [ln.split()[-1] for ln in then] == ["11", "22"]  # each array's offset: sbatch's $1
    assert all(ln.split()[-2].endswith("/job.slurm") for ln in then)
    assert "--array=0-10" in then[0] and "--array=0-2" in then[1]
    assert (
        "hpc: 25 tasks exceed the cluster's array size (11, MaxArraySize): one sweep of 3 "
        "arrays" in err
    )
    assert _slurm(tmp_path, "--dry-run", "--max-parallel", "4", "--sweep", f"optim.lr={LRS25}") == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-10%4\n" in out
    assert "--array=0-10%4 --dependency=afterany:ARRAY1" in out
    assert "--array=0-2%4 --dependency=afterany:ARRAY2" in out
    # --after holds for every array of the sweep (without --max-parallel they run at once)
    assert _slurm(tmp_path, "--dry-run", "--after", "123:any", "--sweep", f"optim.lr={LRS25}") == 0
    out = capsys.readouterr().out
    assert "# submit: sbatch --parsable --dependency=afterany:123 " in out
    then = [ln for ln in out.splitlines() if ln.startswith("# then array")]
    assert len(then) == 2 and all("--dependency=afterany:123 " in ln for ln in then)


def test_unreadable_config_takes_slurms_default(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No controller answering: MaxArraySize's cited default, 1001 (slurm.conf(5))."""
    fake_bin(
        "scontrol",
        "echo 'slurm_load_ctl_conf error: Unable to contact slurm controller' >&2; exit 1",
    )
    lrs = ",".join(str(i) for i in range(1003))  # 1001 + 2 (a lone last task: see split)
    assert _slurm(tmp_path, "--dry-run", "--sweep", f"optim.lr={lrs}") == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --array=0-1000\n" in out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith("# then array")] == ["1001"]
    assert "(1001, MaxArraySize): one sweep of 2 arrays" in err


def test_submit_records_one_sweep_and_status_cancel_take_every_array(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("scontrol", SCONTROL_11)
    fake_bin("sbatch", SBATCH_COUNTER)
    fake_bin("scancel", "true")
    fake_bin(
        "squeue",
        'printf "701_%s|701|COMPLETED\\n" $(seq 0 10); '
        'printf "702_%s|702|RUNNING\\n" $(seq 0 10); '
        'printf "703_%s|703|PENDING\\n" 0 1 2',
    )
    assert _slurm(tmp_path, "--sweep", f"optim.lr={LRS25}") == 0
    assert capsys.readouterr().out.strip() == "701"
    sbatch = _fake_calls(fake_bin, "sbatch")
    assert len(sbatch) == 3
    assert sbatch[1].endswith("job.slurm 11") and "--array=0-10 " in sbatch[1]
    assert sbatch[2].endswith("job.slurm 22") and "--array=0-2 " in sbatch[2]
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["job_id"] == "701"
    assert record["array_parts"] == [
        {"job_id": "701", "offset": 0, "count": 11},
        {"job_id": "702", "offset": 11, "count": 11},
        {"job_id": "703", "offset": 22, "count": 3},
    ]
    assert main(["status", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "701 RUNNING"  # one sweep: running while any array runs
    assert len(lines) == 26 and lines[12] == "702_0 RUNNING optim.lr=11"
    assert lines[25] == "703_2 PENDING optim.lr=24"
    assert len(_fake_calls(fake_bin, "squeue")) == 1  # all three arrays, one query
    # a task of the third array finds the run (hpc status / logs by its id)
    assert main(["status", "703_2", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "703_2 PENDING"
    assert main(["cancel", str(run_dir)]) == 0
    assert _fake_calls(fake_bin, "scancel") == [
        "scancel -v 701",
        "scancel -v 702",
        "scancel -v 703",
    ]


def test_a_refused_array_cancels_the_queued_ones(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("scontrol", SCONTROL_11)
    fake_bin(
        "sbatch",
        'n=$(grep -c "^sbatch" "$FAKE_LOG"); [ "$n" -lt 3 ] || '
        '{ echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2; exit 1; }; '
        'echo "$((700 + n))"',
    )
    fake_bin("scancel", "true")
    assert _slurm(tmp_path, "--sweep", f"optim.lr={LRS25}") == 3
    err = capsys.readouterr().err
    assert (
        "array 3 of 3 was refused" in err
        and "cancelled the 2 array(s) already queued (701, 702)" in err
    )
    assert _fake_calls(fake_bin, "scancel") == ["scancel -v 702", "scancel -v 701"]


def test_a_task_finds_its_point_by_offset_plus_index(tmp_path: Path) -> None:
    from hpc import sweep

    tasks = sweep.tasks_from_flags([f"optim.lr={LRS25}"])
    sweep.write_manifest(tmp_path, tasks)
    env = {"SLURM_ARRAY_TASK_ID": "2"}
    assert sweep.task_for(tmp_path, environ=env, offset="22").overrides == {"optim.lr": "24"}
    assert sweep.task_for(tmp_path, environ=env, offset="").index == 2  # plain sbatch: $1 empty
    with pytest.raises(Exception, match="past the 25 tasks"):
        sweep.task_for(tmp_path, environ=env, offset="23")
    for bad in ("-1", "1e3", "٣", "2;id"):
        with pytest.raises(Exception, match="is not an array offset; allowed"):
            sweep.task_for(tmp_path, environ=env, offset=bad)


def _fake_calls(fake_bin, name: str) -> list[str]:
    log = fake_bin.log
    return (
        [ln for ln in log.read_text().splitlines() if ln.startswith(name + " ")]
        if log.exists()
        else []
    )


def test_logs_follow_of_a_split_sweep_waits_for_every_array(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hpc logs -f RUN``'s state is the sweep's: running while the last array runs."""
    from hpc import core

    fake_bin("scontrol", SCONTROL_11)
    fake_bin("sbatch", SBATCH_COUNTER)
    fake_bin("squeue", 'printf "701|701|COMPLETED\\n702|702|COMPLETED\\n703|703|RUNNING\\n"')
    assert _slurm(tmp_path, "--sweep", f"optim.lr={LRS25}") == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    state, _ = core.watch(str(run_dir), tmp_path / "runs")
    assert state() == "RUNNING"
    from hpc.schedulers import JobState

    assert core.combined_state([JobState.COMPLETED, JobState.FAILED]) == "FAILED"
    assert core.combined_state([JobState.COMPLETED, JobState.PENDING]) == "PENDING"


# --- PBS max_array_size: the same split, the offset through qsub -v ----------------------

QSTAT_B5 = (
    'printf "Server: vm-pbs\\n    server_state = Active\\n    max_array_size = 5\\n'
    '    pbs_version = 23.06.06\\n"'
)
LRS12 = ",".join(str(i) for i in range(12))


def _pbs(tmp_path: Path, *flags: str) -> int:
    return main(
        [
            "submit",
            "--cluster",
            "pbs",
            "--name",
            "t",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--walltime",
            "00:05:00",
            *flags,
            "--",
            "python",
            "train.py",
        ]
    )


def test_max_array_size_is_read_from_qstat_bf() -> None:
    from hpc.schedulers.pbs import DEFAULT_MAX_ARRAY_SIZE, parse_max_array_size

    assert parse_max_array_size("Server: s\n    max_array_size = 5\n    total_jobs = 3\n") == 5
    assert (
        parse_max_array_size(
            "Server: a\n    max_array_size = 400\nServer: b\n    max_array_size = 300\n"
        )
        == 300
    )
    assert (
        parse_max_array_size("Server: s\n    total_jobs = 3\n") == DEFAULT_MAX_ARRAY_SIZE == 10000
    )
    assert parse_max_array_size("") == 10000
    for tiny in ("0", "1"):
        with pytest.raises(
            Exception, match=f"max_array_size is {tiny}.*allowed: one hpc submit per point"
        ):
            parse_max_array_size(f"    max_array_size = {tiny}\n")


def test_split_leaves_no_array_of_one_task() -> None:
    """PBS refuses ``-J 0-0``: a lone last task joins the part before it."""
    from hpc.sweep import split

    assert split(11, 5) == [(0, 5), (5, 4), (9, 2)]
    assert split(12, 5) == [(0, 5), (5, 5), (10, 2)]
    assert split(10001, 10000) == [(0, 9999), (9999, 2)]
    assert split(3, 2) == [(0, 2), (2, 1)]  # at 2 it cannot: hpc refuses that sweep (below)


def test_pbs_dry_run_splits_at_the_read_limit(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """12 tasks at max_array_size 5 (qstat -Bf): arrays of 5, 5, 2, each part's offset
    given to qsub -v and read by the script from $HPC_SWEEP_OFFSET."""
    fake_bin("qstat", QSTAT_B5)
    assert _pbs(tmp_path, "--dry-run", "--sweep", f"optim.lr={LRS12}") == 0
    out, err = capsys.readouterr()
    assert _array_line(out) == "#PBS -J 0-4"
    assert '--index "$PBS_ARRAY_INDEX" --offset "${HPC_SWEEP_OFFSET:-0}")' in out
    then = [ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("# then array")]
    assert [ln.split()[:5] for ln in then] == [
        ["qsub", "-J", "0-4", "-v", "HPC_SWEEP_OFFSET=5"],
        ["qsub", "-J", "0-1", "-v", "HPC_SWEEP_OFFSET=10"],
    ]
    assert all(ln.endswith("/job.pbs") for ln in then)
    assert (
        "hpc: 12 tasks exceed the cluster's array size (5, max_array_size): one sweep of 3 "
        "arrays" in err
    )
    assert _fake_calls(fake_bin, "qstat") == ["qstat -Bf"]
    assert _pbs(tmp_path, "--dry-run", "--max-parallel", "2", "--sweep", f"optim.lr={LRS12}") == 0
    out = capsys.readouterr().out
    assert "#PBS -J 0-4%2\n" in out
    assert "qsub -J 0-4%2 -v HPC_SWEEP_OFFSET=5 -W depend=afterany:ARRAY1 " in out
    assert "qsub -J 0-1%2 -v HPC_SWEEP_OFFSET=10 -W depend=afterany:ARRAY2 " in out


def test_pbs_at_a_limit_of_two_an_odd_sweep_is_one_line_not_a_refused_array(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At max_array_size 2 the last of 5 tasks would be ``-J 0-0``, which qsub refuses
    after the first arrays are queued: refused before anything is submitted instead."""
    fake_bin("qstat", QSTAT_B5.replace("= 5", "= 2"))
    fake_bin("qsub", "echo 1.vm-pbs")
    assert _pbs(tmp_path, "--sweep", "optim.lr=1,2,3,4,5") == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "hpc: error: --sweep: 5 tasks in arrays of at most 2 (max_array_size) leave one array "
        "of 1 task, and pbs takes no array of fewer than 2; allowed: a multiple of 2 tasks"
    ]
    assert _fake_calls(fake_bin, "qsub") == [] and not list((tmp_path / "runs").glob("*"))
    assert _pbs(tmp_path, "--dry-run", "--sweep", "optim.lr=1,2,3,4") == 0  # 2 + 2: fine


def test_pbs_unreadable_server_takes_the_cited_default(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No server answering: max_array_size's default, 10000 (pbs_server_attributes(7B))."""
    fake_bin("qstat", "echo 'Connection refused' >&2; exit 1")
    lrs = ",".join(str(i) for i in range(10001))
    assert _pbs(tmp_path, "--dry-run", "--sweep", f"optim.lr={lrs}") == 0
    out, err = capsys.readouterr()
    assert _array_line(out) == "#PBS -J 0-9998"  # 9999 + 2: no array of one subjob
    then = [ln for ln in out.splitlines() if ln.startswith("# then array")]
    assert len(then) == 1 and "qsub -J 0-1 -v HPC_SWEEP_OFFSET=9999 " in then[0]
    assert "(10000, max_array_size): one sweep of 2 arrays" in err
    assert _pbs(tmp_path, "--dry-run", "--sweep", "optim.lr=1,2,3") == 0  # fits: one array
    out = capsys.readouterr().out
    assert _array_line(out) == "#PBS -J 0-2" and "# then array" not in out


def test_pbs_submit_records_one_sweep_of_every_array(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bin("qstat", QSTAT_B5)
    fake_bin("qsub", 'n=$(grep -c "^qsub" "$FAKE_LOG"); echo "$((700 + n))[].vm-pbs"')
    assert _pbs(tmp_path, "--sweep", f"optim.lr={LRS12}") == 0
    assert capsys.readouterr().out.strip() == "701[].vm-pbs"
    qsub = _fake_calls(fake_bin, "qsub")
    assert len(qsub) == 3
    assert qsub[1].startswith("qsub -J 0-4 -v HPC_SWEEP_OFFSET=5 ") and qsub[1].endswith("job.pbs")
    assert qsub[2].startswith("qsub -J 0-1 -v HPC_SWEEP_OFFSET=10 ")
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["array_parts"] == [
        {"job_id": "701[].vm-pbs", "offset": 0, "count": 5},
        {"job_id": "702[].vm-pbs", "offset": 5, "count": 5},
        {"job_id": "703[].vm-pbs", "offset": 10, "count": 2},
    ]


def test_a_pbs_task_finds_its_point_by_the_offset_variable(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rendered script's task line, run by bash as subjob 1 of the first array (no
    variable) and of the third (``qsub -v HPC_SWEEP_OFFSET=10``): points 1 and 11."""
    from hpc import sweep

    fake_bin("qstat", QSTAT_B5)
    fake_bin("python", f'exec {sys.executable} "$@"')  # the command's python
    assert _pbs(tmp_path, "--dry-run", "--sweep", f"optim.lr={LRS12}") == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("task=$(")]
    sweep.write_manifest(tmp_path, sweep.tasks_from_flags([f"optim.lr={LRS12}"]))
    script = f'{line}\neval "$task"\necho "$HPC_SWEEP_LABEL"\n'
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join((root, str(Path(root) / "src")))  # hpc and hpc_ddp, as installed
    env = {**os.environ, "HPC_RUN_DIR": str(tmp_path), "PBS_ARRAY_INDEX": "1", "PYTHONPATH": path}
    env.pop("HPC_SWEEP_OFFSET", None)
    first = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    third = subprocess.run(
        ["bash", "-c", script],
        env={**env, "HPC_SWEEP_OFFSET": "10"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (first.returncode, first.stdout) == (0, "optim.lr=1\n"), first.stderr
    assert (third.returncode, third.stdout) == (0, "optim.lr=11\n"), third.stderr
