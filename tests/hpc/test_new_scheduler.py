"""A new scheduler is one module, its template and a profile: nothing else changes.

docs/architecture.md promises this; here a toy batch system ("toy": its
own script suffix, launcher, submit client, job ids and log names) is added from a
temporary folder only, and rendering, the dry run and ``hpc logs`` all take it. The
launcher table (``hpc.schedulers.LAUNCHERS``) gets the toy's builder in its ``mpiexec``
row, and a toy launcher (``toyrun``: one more row, built by the toy's own builder) is
then a choice of every spec and profile check and renders through that builder. With
it the test also drives the Python API end to end: ``hpc.executor`` on
the toy's profile submits a function through the toy's own ``submit`` (which runs the
script here, in the background), its ranks' results come back, ``map_array`` and
``cancel`` work, and the run directory's record serves ``hpc status``. No line of hpc
names the toy: the scheduler's default ``submitit_executor`` is the script executor.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import hpc
from hpc import core, logs, profiles, schedulers, spec
from hpc.cli import main as cli_main
from hpc.errors import SchedulerError
from tests.support.polling import wait_until

# Job functions travel by value: the toy's jobs need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOY = """
import os
import re
import signal
import subprocess
from pathlib import Path

from hpc.errors import SchedulerError
from hpc.schedulers import JobState, Scheduler, Submission

# toyrun: start N copies of the command here, each told its rank as torchrun would
TOYRUN = ('n=$1; shift; pids=; for r in $(seq 0 $((n - 1))); do RANK=$r LOCAL_RANK=$r '
          'WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n GROUP_RANK=0 "$@" & pids="$pids $!"; done; '
          'rc=0; for p in $pids; do wait $p || rc=$?; done; exit $rc')


def launch_mpiexec(job):
    from hpc import launchers

    return ["# toy preamble"], launchers.mpiexec(job)


def launch_toyrun(job):
    from hpc import launchers

    return ["# toy preamble"], ["bash", "-c", TOYRUN, "toyrun", str(job.ppn),
                                *launchers.wrapped(job)]


class Toy(Scheduler):
    name = "toy"
    script_suffix = ".toy"
    default_launcher = "mpiexec"
    log_patterns = (r"toy-(?P<job>T\\d+)\\.log",)
    job_id_var = "TOY_JOB_ID"
    array_index_var = "TOY_ARRAY_INDEX"  # a sweep: one process per task (submit below)

    def template_values(self, job):
        return {"array": self.array_spec(job)}

    def split_id(self, job_id):
        return (job_id, None) if job_id[:1] == "T" and job_id[1:].isdigit() else None

    def log_name(self, job_name, job_id, task, seq):
        return f"toy-{job_id}.log"

    def submit_command(self, script, after=None):
        return ["toysub", "--now", script]

    def parse_job_id(self, stdout):
        return stdout.strip()

    # The toy's "cluster" is this machine: submit starts the script in the background
    # (its own session) and keeps TOY_STATE/ID.pid, then ID.rc when it ends.

    def submit(self, script, run_dir, on_start=None, after=None):
        state = Path(os.environ["TOY_STATE"])
        job_id = f"T{len(list(state.glob('T*.id'))) + 1}"
        (state / f"{job_id}.id").write_text("")
        array = re.search(r"^#TOY array=0-([0-9]+)$", Path(script).read_text(), re.M)
        if array is None:
            self._start(state, script, run_dir, job_id, {})
        for index in range(int(array.group(1)) + 1 if array else 0):
            task = self.task_id(job_id, index)
            self._start(state, script, run_dir, task, {self.array_index_var: str(index)})
        return Submission(job_id)

    def _start(self, state, script, run_dir, job_id, env):
        log = open(Path(run_dir) / self.log_name("", job_id, None, 1), "wb")
        proc = subprocess.Popen(
            ["bash", "-c", 'bash "$0"; echo $? > "$1"', script, str(state / f"{job_id}.rc")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env, self.job_id_var: job_id})
        log.close()
        (state / f"{job_id}.pid").write_text(str(proc.pid))

    def status(self, job_id):
        state = Path(os.environ["TOY_STATE"])
        tasks = sorted(p.stem for p in state.glob(f"{job_id}_*.pid"))
        if tasks:  # an array: running while a task runs, else failed if one failed
            states = {self.status(t) for t in tasks}
            for answer in (JobState.RUNNING, JobState.FAILED, JobState.CANCELLED):
                if answer in states:
                    return answer
            return JobState.COMPLETED
        if (state / f"{job_id}.cancelled").exists():
            return JobState.CANCELLED
        rc = state / f"{job_id}.rc"
        if rc.exists() and rc.read_text().strip():
            return JobState.COMPLETED if rc.read_text().strip() == "0" else JobState.FAILED
        return JobState.RUNNING if (state / f"{job_id}.pid").exists() else JobState.UNKNOWN

    def cancel(self, job_id):
        state = Path(os.environ["TOY_STATE"])
        if self.status(job_id) != JobState.RUNNING:
            raise SchedulerError(f"toycancel {job_id} refused: the job is not running")
        (state / f"{job_id}.cancelled").write_text("")
        # SIGKILL: submitit's ranks log and ignore SIGTERM (SLURM's warning before the kill)
        os.killpg(int((state / f"{job_id}.pid").read_text()), signal.SIGKILL)


SCHEDULER = Toy
"""

TEMPLATE = """#!{{ shell }}
# {{ header|comment }}
#TOY nodes={{ job.nodes }} name={{ name|q }}
{% if array %}
#TOY array={{ array }}
{% endif %}
{% include "_common.sh.j2" %}
{% if sweep %}
{% include "_sweep.sh.j2" %}
{% endif %}
{% for line in preamble %}
{{ line }}
{% endfor %}
{{ launch }}
"""


@pytest.fixture()
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The toy's module on the scheduler package's path, its builder in the launcher
    table's mpiexec row, its template and its profile."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "toy.py").write_text(TOY)
    monkeypatch.setattr(schedulers, "__path__", [*schedulers.__path__, str(mods)])
    module = importlib.import_module("hpc.schedulers.toy")
    row = schedulers.LAUNCHERS["mpiexec"]
    builders = {**row.builders, "toy": module.launch_mpiexec}
    monkeypatch.setitem(schedulers.LAUNCHERS, "mpiexec", replace(row, builders=builders))
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "toy.sh.j2").write_text(TEMPLATE)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "toybox.yaml").write_text(
        "scheduler: toy\nppn: 2\nlauncher:\n  kind: mpiexec\n  flavor: hydra\n"
    )
    monkeypatch.chdir(tmp_path)  # ./templates is the project's template folder
    yield {"HPC_DDP_CLUSTERS": str(tmp_path / "profiles")}
    sys.modules.pop("hpc.schedulers.toy", None)


def test_a_toy_scheduler_renders_submits_dry_and_finds_its_logs(
    toy: dict[str, str], tmp_path: Path
) -> None:
    assert "toy" in schedulers.names()
    job = core.build_job(
        None,
        {"cluster": "toybox", "nodes": 2, "name": "t1", "command": ["python", "train.py"]},
        environ=toy,
    )
    assert job.cluster.script_suffix == ".toy" and job.launcher == "mpiexec"
    script = core.render_job(job)
    assert "#TOY nodes=2 name=t1" in script and "# toy preamble" in script
    assert "mpiexec" in script and "python train.py" in script
    plan = core.plan_submit(job, tmp_path / "runs", environ=toy)
    assert plan.argv[:2] == ("toysub", "--now") and plan.script.suffix == ".toy"
    assert plan.argv[2] == str(plan.script) and "#TOY nodes=2" in plan.text

    run = tmp_path / "runs" / "t1-x"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"scheduler": "toy", "job_id": "T42", "name": "t1"}))
    assert logs.find_log(run) == run / "toy-T42.log"  # pending: the name the toy will write
    (run / "toy-T42.log").write_text("hello\n")
    assert logs.find_log(run, "T42") == run / "toy-T42.log"
    assert "not a job of" in _error(logs.find_log, run, "T7")


def test_without_the_module_the_profile_is_refused(tmp_path: Path) -> None:
    (tmp_path / "toybox.yaml").write_text("scheduler: toy\n")
    with pytest.raises(
        core.UserError, match="scheduler: 'toy' is not allowed; allowed: local, pbs, slurm"
    ):
        core.build_job(
            None,
            {"cluster": "toybox", "command": ["python", "x.py"]},
            environ={"HPC_DDP_CLUSTERS": str(tmp_path)},
            cwd=tmp_path,
        )


def _error(fn, *args) -> str:
    with pytest.raises(core.UserError) as info:
        fn(*args)
    return str(info.value)


def test_every_scheduler_launches_with_known_launcher_kinds() -> None:
    """The launcher kinds are listed once (hpc.schedulers.LAUNCHERS); a scheduler's
    launchers are the rows with a builder for it, its default first, and the spec and
    profile choices are read from that table."""
    for name in schedulers.names():
        sched = schedulers.get(name)
        assert sched.launchers[0] == sched.default_launcher, name
        for kind in sched.launchers:
            assert name in schedulers.LAUNCHERS[kind].builders, (name, kind)
    assert schedulers.get("slurm").launchers == ("srun", "torchrun")
    assert spec.launcher_choices() == ("auto", *schedulers.LAUNCHERS)
    assert profiles.launcher_kinds() == tuple(schedulers.LAUNCHERS)


# --- the Python API through the toy scheduler and a toy launcher ----------------------


@pytest.fixture()
def toyrun(
    toy: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """The toy launcher as one more row of the launcher table (nothing else is told of
    it), the toy's job state folder, and the toy's profiles for this process."""
    module = importlib.import_module("hpc.schedulers.toy")
    kind = schedulers.LauncherKind(  # per_rank False: it exports torchrun's variables
        "toyrun", per_rank=False, builders={"toy": module.launch_toyrun}
    )
    monkeypatch.setitem(schedulers.LAUNCHERS, "toyrun", kind)
    state = tmp_path / "toy-state"
    state.mkdir()
    (tmp_path / "profiles" / "toyrunbox.yaml").write_text(
        "scheduler: toy\nppn: 2\nlauncher:\n  kind: toyrun\n"
    )
    monkeypatch.setenv("TOY_STATE", str(state))
    for key, value in toy.items():
        monkeypatch.setenv(key, value)
    yield toy


def test_a_launcher_added_later_is_a_choice_of_specs_and_profiles_and_renders(
    toyrun: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy launcher's row, added after every module was imported, is what the
    spec's and the profile's checks allow (no copy of the table taken at import), the
    toy scheduler's launchers hold it, and a render builds its line with its builder;
    with the row gone, the same spec is refused naming the table's kinds."""
    command = ["python", "train.py"]
    assert spec.JobSpec.from_mapping({"command": command, "launcher": "toyrun"}).launcher == (
        "toyrun"
    )
    cluster = profiles.load("toyrunbox")  # its launcher.kind is the toy's
    assert cluster.launcher.kind == "toyrun"
    (tmp_path / "profiles" / "strict.yaml").write_text(
        "extends: toybox\nlauncher:\n  refuse:\n    toyrun: not on this site\n"
    )
    assert profiles.load("strict").launcher.refuse == {"toyrun": "not on this site"}
    assert schedulers.get("toy").launchers == ("mpiexec", "toyrun")

    job = core.build_job(None, {"cluster": "toyrunbox", "name": "t2", "command": command})
    assert job.launcher == "toyrun" and not job.wrapped  # per_rank False: no ddp.exec
    script = core.render_job(job)
    assert "# toy preamble" in script
    assert "toyrun 2 python train.py" in script and "mpiexec" not in script

    monkeypatch.delitem(schedulers.LAUNCHERS, "toyrun")
    with pytest.raises(
        core.UserError,
        match=r"^launcher: 'toyrun' is not allowed.*; allowed: auto, mpiexec, srun, torchrun$",
    ):
        spec.JobSpec.from_mapping({"command": command, "launcher": "toyrun"})
    with pytest.raises(core.UserError, match=r"launcher: kind: .*allowed: mpiexec, srun, torchrun"):
        profiles.load("toyrunbox")


def rank_sum(a: int, b: int) -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a + b


def wait_cancelled(marker: str) -> str:
    Path(marker).write_text(os.environ["TOY_JOB_ID"])
    time.sleep(60)
    return "not cancelled"


def _done(job: Any, timeout: float = 60) -> None:
    wait_until(
        lambda: job.done(force_check=True),
        timeout,
        f"toy job {job.job_id} done",
        log=lambda: job.stderr() or "",
    )


def test_the_python_api_runs_through_the_toy_scheduler_and_launcher(
    toyrun: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpc.executors.script import ScriptExecutor

    ex = hpc.executor(cluster="toybox", ppn=2, launcher="toyrun", name="fn")
    assert type(ex) is ScriptExecutor  # the default of Scheduler.submitit_executor
    (run_dir,) = (tmp_path / "runs").iterdir()
    job = ex.submit(rank_sum, 2, 3)
    assert job.job_id == "T1"
    _done(job)
    assert job.results() == [(0, 2, 5), (1, 2, 5)]  # each rank's own, through toyrun
    script = job.paths.submission_file.read_text()
    assert "#TOY nodes=1 name=fn" in script and "# toy preamble" in script
    assert "toyrun 2" in script and "-m hpc.executors.script" in script
    assert 'export HPC_SUBMITIT_JOB_ID="${TOY_JOB_ID}"' in script
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["scheduler"], record["cluster"], record["job_ids"]) == ("toy", "toybox", ["T1"])
    assert record["executor"] == "submitit ScriptExecutor"
    toy_sched = schedulers.get("toy")  # the results come before the script's own end
    wait_until(lambda: toy_sched.status("T1") == "COMPLETED", 30, "toy job T1 ended")
    assert cli_main(["status", str(run_dir)]) == 0  # the record names the toy's job
    assert capsys.readouterr().out == "T1 COMPLETED\n"

    jobs = ex.map_array(rank_sum, [1, 2], [10, 20])  # no array form: a job per call
    assert [j.job_id for j in jobs] == ["T2", "T3"]
    for j in jobs:
        _done(j)
    assert [j.results() for j in jobs] == [[(0, 2, 11), (1, 2, 11)], [(0, 2, 22), (1, 2, 22)]]
    assert json.loads((run_dir / "run.json").read_text())["job_ids"] == ["T1", "T2", "T3"]

    marker = tmp_path / "started"
    late = ex.submit(wait_cancelled, str(marker))
    wait_until(marker.exists, 60, "toy job started", log=lambda: late.stderr() or "")
    assert late.state == "RUNNING"
    late.cancel()  # the toy's own cancel
    _done(late)
    assert late.state == "CANCELLED"
    with pytest.raises(Exception, match="T4"):  # submitit's UncompletedJobError names it
        late.result()
    with pytest.raises(SchedulerError, match="^toycancel T4 refused: the job is not running$"):
        late.cancel()  # a refusal is the scheduler's own one line
    late.cancel(check=False)  # not checked: ignored, as submitit's executors do


def test_the_python_api_refuses_a_scheduler_without_a_job_id_variable(
    toyrun: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script executor needs the job's id inside the job: one line, nothing left."""
    module = importlib.import_module("hpc.schedulers.toy")
    monkeypatch.setattr(module.Toy, "job_id_var", None)
    with pytest.raises(core.UserError, match="^cluster: the toy scheduler names no variable"):
        hpc.executor(cluster="toybox", launcher="toyrun")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_sweep_runs_through_the_toy_scheduler_and_launcher(
    toyrun: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hpc submit --sweep`` on a profile whose default launcher is the toy's: one toy
    array, each task in its own folder with its overrides, on every rank; ``hpc status``
    asks the toy for the array and each task."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "name = f\"argv-{os.environ['RANK']}.json\"\n"
        "json.dump(sys.argv[1:], open(os.path.join(os.environ['HPC_RUN_DIR'], name), 'w'))\n"
    )
    assert (
        cli_main(
            [
                "submit",
                "--cluster",
                "toyrunbox",
                "--runs-dir",
                "runs",
                "--sweep",
                "a=1,2",
                "--",
                sys.executable,
                str(probe),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == "T1"
    (run,) = (tmp_path / "runs").iterdir()
    script = (run / "job.toy").read_text()
    assert "#TOY array=0-1\n" in script and "toyrun 2" in script
    toy_sched = schedulers.get("toy")
    wait_until(
        lambda: toy_sched.status("T1") == "COMPLETED",
        60,
        "toy sweep ended",
        log=lambda: "".join(p.read_text() for p in run.glob("toy-*.log")),
    )
    seen = {
        p.relative_to(run).as_posix(): json.loads(p.read_text()) for p in run.glob("*/argv-*.json")
    }
    assert seen == {
        "000-a-1/argv-0.json": ["--set", "a=1"],
        "000-a-1/argv-1.json": ["--set", "a=1"],
        "001-a-2/argv-0.json": ["--set", "a=2"],
        "001-a-2/argv-1.json": ["--set", "a=2"],
    }
    assert cli_main(["status", str(run), "--runs-dir", "runs"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "T1 COMPLETED",
        "T1_0 COMPLETED a=1",
        "T1_1 COMPLETED a=2",
    ]


def test_the_pbs_executor_refuses_a_launcher_that_does_not_start_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kind added to PBS later that starts one process per node (per_rank False) is
    refused by the PBS executor with the line SLURM's gives (one check, the scheduler's
    ``check_submitit_launcher``), the choices read from the table; nothing is written."""
    from hpc import launchers

    row = schedulers.LauncherKind("pernode", per_rank=False, builders={"pbs": launchers.mpiexec})
    monkeypatch.setitem(schedulers.LAUNCHERS, "pernode", row)
    monkeypatch.chdir(tmp_path)
    assert schedulers.get("pbs").launchers == ("mpiexec", "pernode")
    with pytest.raises(
        core.UserError,
        match=r"^launcher: 'pernode' cannot start submitit's ranks on pbs; allowed: auto, mpiexec$",
    ):
        hpc.executor(cluster="pbs", launcher="pernode")
    assert not list((tmp_path / "runs").iterdir())  # the run directory made is gone
