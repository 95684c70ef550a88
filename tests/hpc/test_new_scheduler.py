"""A new scheduler is one module, its template and a profile: nothing else changes.

docs/architecture.md promises this; here a toy batch system ("toy": its
own script suffix, launcher, submit client, job ids and log names) is added from a
temporary folder only, and rendering, the dry run and ``hpc logs`` all take it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc import core, logs, schedulers

TOY = '''
from hpc.schedulers import Scheduler


class Toy(Scheduler):
    name = "toy"
    script_suffix = ".toy"
    launchers = ("mpiexec",)
    log_patterns = (r"toy-(?P<job>T\\d+)\\.log",)

    def split_id(self, job_id):
        return (job_id, None) if job_id[:1] == "T" and job_id[1:].isdigit() else None

    def log_name(self, job_name, job_id, task, seq):
        return f"toy-{job_id}.log"

    def launch(self, job):
        from hpc import launchers

        return ["# toy preamble"], launchers.mpiexec(job)

    def submit_command(self, script):
        return ["toysub", "--now", script]

    def parse_job_id(self, stdout):
        return stdout.strip()


SCHEDULER = Toy
'''

TEMPLATE = """#!{{ shell }}
# {{ header|comment }}
#TOY nodes={{ job.nodes }} name={{ name|q }}
{% include "_common.sh.j2" %}
{% for line in preamble %}
{{ line }}
{% endfor %}
{{ launch }}
"""


@pytest.fixture()
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The toy's module on the scheduler package's path, its template and its profile."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "toy.py").write_text(TOY)
    monkeypatch.setattr(schedulers, "__path__", [*schedulers.__path__, str(mods)])
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "toy.sh.j2").write_text(TEMPLATE)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "toybox.yaml").write_text(
        "scheduler: toy\nppn: 2\nlauncher:\n  kind: mpiexec\n  flavor: hydra\n")
    monkeypatch.chdir(tmp_path)  # ./templates is the project's template folder
    yield {"HPC_DDP_CLUSTERS": str(tmp_path / "profiles")}
    sys.modules.pop("hpc.schedulers.toy", None)


def test_a_toy_scheduler_renders_submits_dry_and_finds_its_logs(toy: dict[str, str],
                                                                tmp_path: Path) -> None:
    assert "toy" in schedulers.names()
    job = core.build_job(None, {"cluster": "toybox", "nodes": 2, "name": "t1",
                                "command": ["python", "train.py"]}, environ=toy)
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
    with pytest.raises(core.UserError, match="scheduler: 'toy' is not allowed; allowed: local, pbs, slurm"):
        core.build_job(None, {"cluster": "toybox", "command": ["python", "x.py"]},
                       environ={"HPC_DDP_CLUSTERS": str(tmp_path)}, cwd=tmp_path)


def _error(fn, *args) -> str:
    with pytest.raises(core.UserError) as info:
        fn(*args)
    return str(info.value)


def test_every_scheduler_launches_with_known_launcher_kinds() -> None:
    """The launcher kinds are listed once (hpc.schedulers.LAUNCHERS); a scheduler's own
    list names only those, and the spec and profile choices are read from that table."""
    from hpc import profiles, schedulers, spec

    for name in schedulers.names():
        assert set(schedulers.get(name).launchers) <= set(schedulers.LAUNCHERS), name
    assert spec.LAUNCHERS == ("auto", *schedulers.LAUNCHERS)
    assert profiles.LAUNCHER_KINDS == tuple(schedulers.LAUNCHERS)
