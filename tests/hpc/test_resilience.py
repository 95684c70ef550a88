"""``resilience:`` in a spec: the values allowed, and the launch rendered under
``python -m ddp.supervise`` (the real SLURM run: tests/test_e2e_resilience.py)."""

from __future__ import annotations

import subprocess

import pytest

from hpc.errors import UserError
from hpc.render import render
from hpc.spec import RESILIENCE, JobSpec
from tests.hpc.conftest import REPO, make_job


def _script(cluster: str, resilience: object, **kw: object) -> str:
    return render(
        make_job(cluster, command=["python", "t.py"], resilience=resilience, **kw), cwd=REPO
    )


def test_slurm_srun_runs_under_the_supervisor_with_no_kill() -> None:
    text = _script("slurm", {"hang_timeout_s": 90, "max_restarts": 5}, nodes="2", queue="debug")
    assert "#SBATCH --no-kill" in text
    assert (
        "python -m ddp.supervise --hang-timeout-s=90 --max-restarts=5 --min-nodes=1 "
        "--spares=0 -- srun --kill-on-bad-exit=1 --label python -m ddp.exec -- python t.py"
    ) in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    plain = render(make_job("slurm", command=["python", "t.py"], queue="debug"), cwd=REPO)
    assert "--no-kill" not in plain and "ddp.supervise" not in plain


def test_pbs_mpiexec_runs_under_the_supervisor_tolerating_node_failures() -> None:
    """Aurora: ``-W tolerate_node_failures=all`` among the directives (a dead node does
    not end the job), the PALS line under the supervisor, and Aurora's ``--no-vni`` for
    the probe's second mpiexec; the generic PBS profile has no such flag."""
    text = _script("aurora", {"max_restarts": 2, "spares": 1}, account="p", nodes="3")
    directives = [x for x in text.splitlines() if x.startswith("#PBS")]
    assert "#PBS -W tolerate_node_failures=all" in directives
    first_comment = next(i for i, x in enumerate(text.splitlines()[1:], 1) if x.startswith("# "))
    assert all(text.splitlines().index(d) < first_comment for d in directives)  # ALCF: no
    # comment before or among the directives
    assert (
        "-m ddp.supervise --hang-timeout-s=600 --max-restarts=2 --min-nodes=1 --spares=1 "
        "--concurrent-args=--no-vni -- mpiexec -n 36 --ppn 12"
    ) in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    generic = _script("pbs", True, nodes="2")
    assert "#PBS -W tolerate_node_failures=all" in generic and "--concurrent-args" not in generic
    assert "-- mpiexec -n 2 -ppn 1" in generic
    plain = render(make_job("aurora", command=["python", "t.py"], account="p"), cwd=REPO)
    assert "tolerate_node_failures" not in plain and "ddp.supervise" not in plain


def test_true_takes_the_defaults_and_local_runs_it_too() -> None:
    assert JobSpec.from_mapping({"command": ["x"], "resilience": True}).resilience == RESILIENCE
    assert JobSpec.from_mapping({"command": ["x"], "resilience": False}).resilience is None
    assert "-m ddp.supervise --hang-timeout-s=600" in _script("local", True, ppn="2")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("yes", "allowed: true, false or a mapping"),
        ({"hang_timeout_s": float("nan")}, "seconds from 1"),
        ({"hang_timeout_s": 0}, "seconds from 1"),
        ({"hang_timeout_s": True}, "seconds from 1"),
        ({"max_restarts": -1}, "from 0"),
        ({"max_restarts": 1.5}, "whole number"),
        ({"min_nodes": 0}, "from 1"),
        ({"spares": "2"}, "whole number"),
        ({"retries": 3}, "unknown key 'retries'"),
    ],
)
def test_bad_values_are_one_line(value: object, says: str) -> None:
    with pytest.raises(UserError, match="resilience") as info:
        JobSpec.from_mapping({"command": ["x"], "resilience": value})
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("cluster", "kw", "says"),
    [
        (
            "slurm",
            {"queue": "debug", "launcher": "torchrun"},
            "not available for slurm with launcher torchrun",
        ),
        ("slurm", {"queue": "debug", "nodes": "2"}, "more than the job's 2 node(s)"),
    ],
)
def test_what_the_supervisor_cannot_run_is_refused(cluster: str, kw: dict, says: str) -> None:
    res = {"min_nodes": 3} if "nodes" in kw else True
    with pytest.raises(UserError) as info:
        _script(cluster, res, **kw)
    assert says in str(info.value) and "\n" not in str(info.value)
