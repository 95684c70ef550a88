"""The login side asks once (issue 28, item 4): batched status, a backed-off ``logs -f``,
an index of job ids beside ``runs/``, a streaming qstat reader, server names normalised.

Counts, never times: scheduler calls are counted by fake clients that log each call,
record reads by wrapping the one reader of run files, memory by tracemalloc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from hpc import core, logs, runs, runs_index, schedulers
from hpc.cli import main
from hpc.errors import UserError
from hpc.schedulers import JobState, _pbs_json, _pbs_qstat
from hpc.schedulers import pbs as pbs_mod
from tests.hpc.conftest import REPO

N_TASKS = 1000


def _sweep_run(runs_dir: Path, scheduler: str, job_id: str, n: int = N_TASKS) -> Path:
    """A sweep run's record as ``hpc submit --sweep`` writes it (n tasks)."""
    run = runs_dir / "sweep-1"
    run.mkdir(parents=True)
    runs.write_record(
        run,
        {
            "name": "sweep",
            "cluster": scheduler,
            "scheduler": scheduler,
            "job_id": job_id,
            "sweep": [{"index": i, "label": f"x={i}", "dir": f"{i:03d}-x-{i}"} for i in range(n)],
        },
    )
    return run


def _calls(fake_bin: Any) -> list[str]:
    return fake_bin.log.read_text().splitlines() if fake_bin.log.exists() else []


# ---- one batched query per refresh ------------------------------------------------------


def test_status_of_a_1000_task_slurm_sweep_is_one_squeue_call(fake_bin, tmp_path, capsys):
    """Was 1,001 calls (``squeue -j ID`` per task): now the array's id answers all."""
    fake_bin("squeue", f'for i in $(seq 0 {N_TASKS - 1}); do echo "77_$i|77|PENDING"; done')
    run = _sweep_run(tmp_path / "runs", "slurm", "77")
    assert main(["status", str(run), "--runs-dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(_calls(fake_bin)) <= 2, _calls(fake_bin)[:5]
    assert lines[0] == "77 PENDING" and len(lines) == 1 + N_TASKS
    assert lines[1:] == [f"77_{i} PENDING x={i}" for i in range(N_TASKS)]


def _qstat_array_json(number: int, n: int, server: str = "srv", state: str = "Q") -> str:
    jobs = {f"{number}[].{server}": {"job_state": "B", "array": "True"}}
    for i in range(n):
        jobs[f"{number}[{i}].{server}"] = {
            "job_state": state,
            "array_index": str(i),
            "array_id": f"{number}[].{server}",
        }
    return json.dumps({"pbs_version": "23.06", "Jobs": jobs}, indent=4)


def test_status_of_a_1000_task_pbs_sweep_is_one_qstat_call(fake_bin, tmp_path, capsys):
    """The array's id with ``-t`` lists every subjob: one qstat instead of 1,001."""
    answer = tmp_path / "qstat.json"
    answer.write_text(_qstat_array_json(88, N_TASKS))
    fake_bin("qstat", f'[ "$*" = "-x -f -F json -t 88[].srv" ] || exit 1; cat "{answer}"')
    run = _sweep_run(tmp_path / "runs", "pbs", "88[].srv")
    assert main(["status", str(run), "--runs-dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert _calls(fake_bin) == ["qstat -x -f -F json -t 88[].srv"]
    assert lines[0] == "88[].srv RUNNING" and len(lines) == 1 + N_TASKS
    assert lines[-1] == f"88[{N_TASKS - 1}].srv PENDING x={N_TASKS - 1}"


def test_a_long_id_list_is_split_to_fit_the_command_line(fake_bin):
    """2,500 jobs of no array: three squeue calls, each -j list within the bound."""
    fake_bin("squeue", 'for j in $(echo "$6" | tr , " "); do echo "$j|$j|RUNNING"; done')
    ids = [str(10_000_000 + i) for i in range(2500)]
    states = schedulers.get("slurm").statuses(ids)
    assert set(states.values()) == {JobState.RUNNING} and list(states) == ids
    calls = _calls(fake_bin)
    assert len(calls) == 3
    assert all(len(c.split()[6]) <= schedulers.MAX_ID_CHARS for c in calls)


def test_qstat_asks_each_array_once_and_a_lone_subjob_alone(fake_bin):
    fake_bin("qstat", "exit 1")
    pbs_mod.query(["5[1].s", "5[2].s", "6[3].s", "7.s"])
    (call,) = _calls(fake_bin)[:1]
    assert call.split()[5:] == ["-t", "5[].s", "6[3].s", "7.s"]


def test_a_new_scheduler_without_a_batched_form_still_answers(monkeypatch):
    """The interface's default asks ``status`` once per id (tests/hpc/test_new_scheduler.py
    shows a new scheduler is one module): every id gets its state."""
    asked: list[str] = []

    class Plain(schedulers.Scheduler):
        name = "plain"

        def status(self, job_id: str) -> JobState:
            asked.append(job_id)
            return JobState.RUNNING if job_id == "1" else JobState.PENDING

    assert Plain().statuses(["1", "2", "1"]) == {"1": JobState.RUNNING, "2": JobState.PENDING}
    assert asked == ["1", "2"]


def test_slurm_sacct_fallback_reads_a_pending_array_range(fake_bin):
    """Past squeue and scontrol: ``sacct`` prints an array not started as ``N_[a-b]``."""
    fake_bin("squeue", "exit 1")
    fake_bin("scontrol", "exit 1")
    fake_bin(
        "sacct",
        """if [ "$1" = "-c" ]; then printf '9_0|COMPLETED\\n9_[1-3%%2]|PENDING\\n'; else
echo 'Slurm accounting storage is disabled' >&2; exit 1; fi""",
    )
    states = schedulers.get("slurm").statuses(["9", "9_0", "9_2", "9_7"])
    assert states == {"9": "PENDING", "9_0": "COMPLETED", "9_2": "PENDING", "9_7": "UNKNOWN"}


# ---- hpc logs -f: the file read stays fast, the scheduler is asked less and less ----------


def test_backoff_doubles_from_one_second_to_the_profiles_interval():
    now = [0.0]
    backoff = logs.Backoff(1.0, 60.0, clock=lambda: now[0])
    asked = []
    while now[0] < 400:
        if backoff.due():
            asked.append(now[0])
        now[0] += 0.5  # one read of the log per half second
    assert asked[:8] == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0, 63.0, 123.0]
    assert all(b - a == 60.0 for a, b in zip(asked[7:], asked[8:], strict=False))
    assert len(asked) < 400 / 0.5 / 50  # was one query per read: 800


def test_follow_reads_every_poll_but_asks_the_scheduler_by_the_backoff(tmp_path, monkeypatch):
    log = tmp_path / "job.out"
    log.write_text("")
    now = [0.0]

    def sleep(seconds: float) -> None:  # the job writes a line between every two reads
        now[0] += seconds
        with log.open("a") as fh:
            fh.write(f"{now[0]}\n")

    monkeypatch.setattr(logs.time, "sleep", sleep)
    asks: list[float] = []

    def running() -> bool:
        asks.append(now[0])
        return now[0] < 100

    import io

    out = io.StringIO()
    logs.follow(log, running, out, poll_s=0.5, ask=logs.Backoff(1.0, 30.0, clock=lambda: now[0]))
    assert asks[:4] == [0.0, 1.0, 3.0, 7.0]
    assert len(asks) <= 10, asks  # was one query per read: 200+
    assert len(out.getvalue().splitlines()) >= 200  # every line, read every half second


def test_logs_follow_finds_the_run_once_not_every_poll(tmp_path, monkeypatch, fake_bin):
    fake_bin("squeue", "echo '5|5|RUNNING'")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    runs.write_record(
        run, {"scheduler": "slurm", "cluster": "perlmutter", "job_id": "5", "name": "t"}
    )
    found = []
    real = runs.find
    monkeypatch.setattr(runs, "find", lambda *a, **k: found.append(a) or real(*a, **k))
    state, poll_s = core.watch(str(run), tmp_path / "runs")
    before = len(found)
    assert [state() for _ in range(20)] == [JobState.RUNNING] * 20
    assert len(found) == before and poll_s == 60.0  # the profile's poll_s


@pytest.mark.parametrize("value", [0, -1, "fast", True, float("nan"), 1e9, [1]])
def test_a_bad_poll_interval_in_a_profile_is_one_line(value, tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "mine.yaml").write_text(
        f"extends: slurm\npoll_s: {json.dumps(value)}\n".replace("NaN", ".nan")
    )
    from hpc import profiles

    with pytest.raises(UserError) as info:
        profiles.load("mine", {"HPC_DDP_CLUSTERS": str(folder)}, tmp_path)
    assert "poll_s" in str(info.value) and "allowed" in str(info.value)


# ---- job-id lookups through the index beside runs/ ---------------------------------------


def _many_runs(runs_dir: Path, n: int) -> None:
    """``n`` records as hpc submit leaves them (written directly: fast)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        run = runs_dir / f"job-{i:05d}"
        run.mkdir()
        rec = {
            "name": "job",
            "scheduler": "pbs",
            "cluster": "pbs",
            "job_id": f"{100000 + i}.pbs-01.site.example",
        }
        (run / "run.json").write_text(json.dumps(rec))


def _count_record_reads(monkeypatch) -> list[Path]:
    opened: list[Path] = []
    real = runs.read_regular

    def counting(path: Path, *a: Any, **k: Any) -> bytes:
        if Path(path).name == runs.RECORD:
            opened.append(Path(path))
        return real(path, *a, **k)

    monkeypatch.setattr(runs, "read_regular", counting)
    return opened


def test_a_job_id_lookup_among_10000_records_reads_one_record(tmp_path, monkeypatch):
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 10_000)
    assert runs.find("100005", runs_dir) is not None  # the first lookup builds the index
    opened = _count_record_reads(monkeypatch)
    for ident, run in [
        ("107777.pbs-01.site.example", "job-07777"),
        ("100042", "job-00042"),
        ("109999.pbs-01", "job-09999"),
    ]:  # another spelling of the server
        del opened[:]
        found = runs.find(ident, runs_dir)
        assert found is not None and found[0].name == run
        assert len(opened) <= 2, (ident, len(opened))  # was 10,000 (and each read twice)
    del opened[:]
    assert runs.find("555", runs_dir) is None and opened == []  # a miss reads none


def test_the_index_keeps_every_entry_of_concurrent_submits(tmp_path, fake_bin):
    """Several ``hpc submit`` at once into one runs/: no index entry lost (the index
    lock), and every one is then found by reading its one record."""
    fake_bin("sbatch", 'echo "$$"')  # each submit gets its own id: the fake's pid
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 3)
    assert runs.find("100001", runs_dir) is not None  # the index exists from here on
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpc",
                "submit",
                "--cluster",
                "slurm",
                "--runs-dir",
                str(runs_dir),
                "--name",
                f"c{i}",
                "--",
                "true",
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ids.append(out.strip())
    index = runs_index._read_index(runs_dir)
    assert index is not None and all(j in index.runs for j in ids), (ids, index.runs)
    for job_id in ids:
        found = runs.find(job_id, runs_dir)
        assert found is not None and found[1]["job_id"] == job_id


def _index_file(runs_dir: Path) -> Path:
    return runs_dir / runs_index.INDEX_DIR / runs_index.INDEX


DAMAGE = ["deleted", "garbage", "binary", "outside", "gone", "fifo", "symlink", "dir-link"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_deleted_or_damaged_index_is_rebuilt_and_never_followed_outside(damage, tmp_path):
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 20)
    assert runs.find("100003", runs_dir) is not None
    index = _index_file(runs_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "run.json").write_text(json.dumps({"scheduler": "pbs", "job_id": "100007.x"}))
    secret = tmp_path / "secret"
    secret.write_text('"100007"\t"job-00007"\n')
    if damage == "deleted":
        index.unlink()
    elif damage == "garbage":
        index.write_text("{not json\n\t\t\n" * 50)
    elif damage == "binary":
        index.write_bytes(os.urandom(4096))
    elif damage == "outside":  # entries naming folders outside runs/
        index.write_text(
            '@99999999999999999999\n"100007"\t"../outside"\n"100007"\t"/"\n'
            f'"100007"\t{json.dumps(str(outside))}\n'
        )
    elif damage == "gone":  # the run it names was removed (and another holds the id now)
        index.write_text(f'@{os.stat(runs_dir).st_mtime_ns}\n"100007"\t"job-99999"\n')
    elif damage == "fifo":
        index.unlink()
        os.mkfifo(index)
    elif damage == "symlink":
        index.unlink()
        index.symlink_to(secret)
    elif damage == "dir-link":
        import shutil

        shutil.rmtree(index.parent)
        index.parent.symlink_to(tmp_path)  # the index folder made a link elsewhere
    found = runs.find("100007", runs_dir)
    assert found is not None and found[0] == runs_dir / "job-00007", found
    assert index.parent.is_dir() and not index.parent.is_symlink()
    assert index.is_file() and not index.is_symlink()
    assert secret.read_text() == '"100007"\t"job-00007"\n'  # nothing written through a link
    assert runs_index._read_index(runs_dir).runs["100007"] == ["job-00007"]


def test_a_run_copied_into_runs_is_found_although_the_index_predates_it(tmp_path):
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 5)
    assert runs.find("100001", runs_dir) is not None
    new = runs_dir / "copied-in"
    new.mkdir()
    (new / "run.json").write_text(json.dumps({"scheduler": "slurm", "job_id": "4242"}))
    found = runs.find("4242", runs_dir)
    assert found is not None and found[0] == new


def test_a_read_only_runs_dir_is_still_searched(tmp_path, monkeypatch):
    """Where the index cannot be written it is built in memory for the lookup."""
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 5)
    monkeypatch.setattr(runs_index, "_index_dir", lambda runs_dir: None)
    found = runs.find("100004", runs_dir)
    assert found is not None and found[0].name == "job-00004"
    assert not (runs_dir / runs_index.INDEX_DIR).exists()


def test_submit_without_a_lookup_leaves_runs_holding_only_runs(tmp_path, fake_bin):
    fake_bin("sbatch", "echo 12")
    assert (
        main(["submit", "--cluster", "slurm", "--runs-dir", str(tmp_path / "runs"), "--", "true"])
        == 0
    )
    assert [p.name for p in (tmp_path / "runs").iterdir()] != []
    assert not (tmp_path / "runs" / runs_index.INDEX_DIR).exists()


def test_an_index_that_exists_gets_each_new_record(tmp_path, fake_bin, monkeypatch):
    fake_bin("sbatch", "echo 31")
    runs_dir = tmp_path / "runs"
    _many_runs(runs_dir, 3)
    assert runs.find("100001", runs_dir) is not None
    assert main(["submit", "--cluster", "slurm", "--runs-dir", str(runs_dir), "--", "true"]) == 0
    opened = _count_record_reads(monkeypatch)
    found = runs.find("31", runs_dir)
    assert found is not None and found[1]["job_id"] == "31" and len(opened) == 1


# ---- the qstat reader: streamed, only the jobs asked for ----------------------------------


def _qstat_file(path: Path, n: int) -> Path:
    """``qstat -x -f -F json`` of ``n`` jobs, each with a realistic few hundred bytes."""
    with path.open("w") as fh:
        fh.write(
            '{\n    "timestamp":1795475428,\n    "pbs_version":"23.06.06",\n'
            '    "pbs_server":"srv",\n    "Jobs":{\n'
        )
        for i in range(n):
            attrs = {
                "Job_Name": f"job{i}",
                "job_state": "F",
                "substate": 92,
                "Exit_status": 0,
                "queue": "debug",
                "Resource_List": {"ncpus": 1, "select": "1:ncpus=1"},
                "Variable_List": {"PBS_O_PATH": "/usr/bin:/bin" * 20, "PBS_O_HOME": "/h"},
            }
            sep = "," if i < n - 1 else ""
            fh.write(f'        "{i}.srv.example":{json.dumps(attrs, indent=12)}{sep}\n')
        fh.write("    }\n}\n")
    return path


def _peak(path: Path, wanted: list[str]) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        with path.open("rb") as fh:
            info = pbs_mod.read_qstat_json(fh, wanted)
        return tracemalloc.get_traced_memory()[1], info
    finally:
        tracemalloc.stop()


def test_qstat_memory_is_flat_in_jobs_not_asked_for(tmp_path):
    small = _qstat_file(tmp_path / "1k.json", 1_000)
    big = _qstat_file(tmp_path / "10k.json", 10_000)
    peak_small, info = _peak(small, ["500.srv"])
    peak_big, info_big = _peak(big, ["500.srv"])
    assert info["500.srv.example"]["State"] == "COMPLETED"
    assert pbs_mod.lookup(info_big, "500.srv")["State"] == "COMPLETED"
    assert list(info_big) == ["500.srv.example"]  # the one job asked for: no other kept
    # 10x the jobs, the same memory (was ~10x: 961 MB for 50k jobs)
    assert peak_big < 1.5 * peak_small, (peak_small, peak_big)
    assert peak_big < big.stat().st_size / 5, (peak_big, big.stat().st_size)


def test_the_streamed_reader_reads_what_the_whole_reader_read(tmp_path, monkeypatch):
    """Chunks as small as 7 characters: every job, value and escape cut at a chunk
    boundary somewhere; old servers' unescaped backslashes read leniently per job."""
    monkeypatch.setattr(_pbs_json, "_CHUNK", 7)
    jobs = {
        f"{i}.s": {
            "job_state": "R" if i % 2 else "Q",
            "Exit_status": i,
            "n": 1.5e3,
            "ok": True,
            "none": None,
            "list": [1, {"a": "}{]["}],
            "comment": 'say "hi" caf\u00e9 \u2603',
        }
        for i in range(40)
    }
    text = json.dumps({"Jobs": jobs, "timestamp": 1})
    text = text.replace('"3.s": {', '"3.s": {"Variable_List": "PS1=\\u@\\h", ')  # old PBS
    import io

    for source in (io.StringIO(text), io.BytesIO(text.encode()), text):
        info = pbs_mod.read_qstat_json(source)
        assert sorted(k for k in info if "_" not in k) == sorted(jobs), type(source)
        assert [info[f"{i}.s"]["State"] for i in range(4)] == [
            "PENDING",
            "RUNNING",
            "PENDING",
            "RUNNING",
        ]
    assert pbs_mod.read_qstat_json("") == {} and pbs_mod.read_qstat_json("  \n") == {}
    for bad in ('{"Jobs": [1]}', '{"Jobs": {"1.s": {"job_state": "R"', "[1, 2]", '{"Jobs" 1}'):
        with pytest.raises(ValueError):
            pbs_mod.read_qstat_json(bad)


def test_the_text_and_plain_readers_keep_only_the_jobs_asked_for():
    text = "".join(f"Job Id: {i}.s\n    job_state = R\n    Job_Name = j{i}\n" for i in range(50))
    info = pbs_mod.read_qstat_text(text, ["7.s.example"])
    assert set(info) == {"7.s"} and info["7.s"]["State"] == "RUNNING"
    plain = "".join(f"{i}.s  name  user  00:00:01 R debug\n" for i in range(50))
    info = pbs_mod.read_qstat_plain(plain, ["8"])
    assert set(info) == {"8.s"}


def test_another_spelling_of_the_server_needs_no_scan(monkeypatch):
    """qsub printed ``N.host.domain``, qstat prints ``N.host``: each id is one dict
    access (was a scan of every job per id: ~320 s per update of a 10k-subjob array)."""
    text = _qstat_array_json(12, 10_000, server="host")
    info = pbs_mod.read_qstat_json(text)

    def no_scan(self: Any) -> Any:
        raise AssertionError("lookup scanned every job")

    monkeypatch.setattr(type(info), "items", no_scan)
    monkeypatch.setattr(type(info), "__iter__", no_scan)
    for i in (0, 4321, 9999):
        assert pbs_mod.lookup(info, f"12[{i}].host.domain.example")["State"] == "PENDING"
        assert pbs_mod.lookup(info, f"12[].host.domain_{i}")["State"] == "PENDING"
    assert pbs_mod.lookup(info, "12[10000].host") is None


def test_unknown_ids_in_qstats_errors_are_matched_without_a_scan():
    ids = [f"{i}.s" for i in range(10_000)]
    gone = _pbs_qstat._gone(
        "qstat: Unknown Job Id 4242.s.example\nqstat: 17.s Job has finished, "
        "use -x or -H to obtain historical job information\n",
        ids,
    )
    assert gone == {"4242.s", "17.s"}


def test_a_damaged_streamed_answer_ends_the_client_and_tries_the_next_form(fake_bin):
    """The reader stops at the damage; the client, still writing, is ended (not waited
    for), and the next form answers."""
    fake_bin(
        "qstat",
        """case "$*" in
  *"-F json"*) echo '{"Jobs": {"1.s": [oops, "the rest of a damaged line"],'; exec sleep 600 ;;
  *) printf 'Job Id: 1.s\\n    job_state = R\\n' ;;
esac""",
    )
    assert pbs_mod.query(["1.s"])["1.s"]["State"] == "RUNNING"
    assert [c.split()[3] for c in _calls(fake_bin)] == ["-F", "1.s"]


def test_a_qstat_that_hangs_mid_answer_is_given_up(fake_bin, monkeypatch):
    """The bound is the point here: a client that never finishes its answer."""
    monkeypatch.setattr(_pbs_qstat, "QSTAT_TIMEOUT_S", 0.5)
    fake_bin("qstat", """echo '{"Jobs": {"1.s": {"job_state": "R"},'; exec sleep 600""")
    assert pbs_mod.query(["1.s"]) == {}
    assert len(_calls(fake_bin)) == 1  # a hung client: no form after it is tried either


def test_a_ctrl_c_while_a_client_streams_ends_it_without_waiting_out_the_timeout(fake_bin):
    """Ctrl-C (KeyboardInterrupt in the reader) ends the client at once and leaves no
    thread that would hold the process until the client's timeout: the watchdog timer is
    a daemon, and cancelled."""
    import threading

    from hpc.schedulers._client import stream

    fake_bin("qstat", "echo partial; exec sleep 600")
    seen: list[threading.Thread] = []

    def reader(text):
        text.readline()
        seen.extend(t for t in threading.enumerate() if isinstance(t, threading.Timer))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream(["qstat"], reader, timeout=600)
    assert seen and all(t.daemon for t in seen), seen
    for t in seen:
        t.join(timeout=30)  # cancelled: ends at once
        assert not t.is_alive()
