"""Validation: every mistake is one UserError naming the field, the value and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc._util import format_walltime, job_name, parse_walltime
from hpc.core import build_job
from hpc.errors import UserError
from hpc.job import default_name, is_ddp_command, resolve
from hpc.spec import JobSpec, load_spec
from tests.hpc.conftest import REPO, make_job

CMD = ["python", "-m", "ddp", "dpo"]


def _err(cluster: str, **overrides: object) -> str:
    with pytest.raises(UserError) as info:
        make_job(cluster, **{"command": CMD, **overrides})
    return str(info.value)


def test_unknown_cluster_suggests_the_nearest() -> None:
    msg = _err("auroa")
    assert "'auroa'" in msg and "did you mean aurora?" in msg and "polaris" in msg


def test_unknown_spec_key_suggests_the_nearest(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("cluster: slurm\nnodse: 2\ncommand: [x]\n")
    with pytest.raises(UserError, match=r"unknown key 'nodse' \(did you mean nodes\?\)"):
        load_spec(path)


def test_queue_is_picked_by_nodes_and_walltime() -> None:
    assert make_job("aurora", account="p", command=CMD, nodes="2").queue == "debug"
    assert make_job("aurora", account="p", command=CMD, nodes="64").queue == "debug-scaling"
    assert (
        make_job("aurora", account="p", command=CMD, nodes="8", walltime="48:00:00").queue
        == "capacity"
    )
    assert (
        make_job("aurora", account="p", command=CMD, nodes="512", walltime="12:00:00").queue
        == "prod"
    )
    assert (
        make_job("perlmutter", account="m", command=CMD, nodes="2", walltime="00:20:00").queue
        == "debug"
    )
    assert make_job("perlmutter", account="m", command=CMD, nodes="2").queue == "regular"


def test_nodes_outside_the_queue() -> None:
    msg = _err("aurora", account="p", nodes="300", queue="debug")
    assert msg.startswith("nodes: 300") and "allowed: 1-2" in msg and "queue prod takes it" in msg


def test_no_queue_fits() -> None:
    msg = _err("polaris", account="p", nodes="12", walltime="04:00:00")
    assert "no queue of polaris takes 12 nodes for 04:00:00" in msg
    assert "03:00:00 for 10-24" in msg


def test_walltime_over_the_queue_limit() -> None:
    msg = _err("aurora", account="p", queue="debug", walltime="02:00:00")
    assert msg.startswith("walltime: 02:00:00 exceeds queue debug") and "01:00:00" in msg


def test_frontier_walltime_bins_by_job_size() -> None:
    assert (
        make_job("frontier", account="a", command=CMD, nodes="100", walltime="05:00:00").queue
        == "batch"
    )
    msg = _err("frontier", account="a", queue="batch", nodes="10", walltime="05:00:00")
    assert "allowed: up to 02:00:00" in msg


@pytest.mark.parametrize("bad", ["1:00", "1h", "01:60:00", "00:00:00", "abc", "-1:00:00"])
def test_walltime_format(bad: str) -> None:
    msg = _err("slurm", walltime=bad)
    assert msg.startswith("walltime:") and "HH:MM:SS" in msg


def test_walltime_forms() -> None:
    assert parse_walltime("168:00:00") == 168 * 3600
    assert parse_walltime(5400) == 5400  # seconds, from the Python API
    assert format_walltime(90061) == "25:01:01"
    assert make_job("slurm", command=CMD, walltime="30:00:00").walltime == 30 * 3600


def test_ppn_above_devices() -> None:
    msg = _err("aurora", account="p", ppn="13")
    assert msg == "ppn: 13 exceeds the 12 xpu devices per node of aurora; allowed: 1-12"


def test_account_required_and_taken_from_the_environment() -> None:
    msg = _err("aurora")
    assert msg.startswith("account: missing") and "PBS_ACCOUNT" in msg
    spec = JobSpec.from_mapping({"command": CMD})
    from hpc import profiles as clusters

    aurora = clusters.load("aurora", environ={}, cwd=REPO)
    assert resolve(spec, aurora, {"HPC_ACCOUNT": "envproj"}).account == "envproj"
    assert resolve(spec, aurora, {"PBS_ACCOUNT": "a", "HPC_ACCOUNT": "b"}).account == "a"
    deferred = resolve(spec, aurora, {}, defer_account=True)
    assert deferred.account is None and deferred.account_deferred
    with pytest.raises(UserError, match=r"account \(from \$HPC_ACCOUNT\)"):
        resolve(spec, aurora, {"HPC_ACCOUNT": "x; rm -rf /"})


def test_generic_slurm_needs_no_account_and_asks_no_gpus() -> None:
    job = make_job("slurm", command=CMD)
    assert job.account is None and job.gpus_per_node is None and job.queue is None
    assert make_job("slurm", command=CMD, gpus_per_node="2").gpus_per_node == 2


def test_gpus_per_node_refused_where_nodes_are_whole() -> None:
    assert _err("aurora", account="p", gpus_per_node="2").startswith(
        "gpus_per_node: 2 cannot be asked"
    )


def test_launcher_must_suit_the_scheduler() -> None:
    msg = _err("aurora", account="p", launcher="srun")
    assert "launcher: 'srun'" in msg and "allowed: auto, mpiexec" in msg
    assert _err("slurm", launcher="bogus").startswith("launcher: 'bogus' is not allowed")


def test_directive_values_are_checked() -> None:
    assert "queue: 'a b'" in _err("slurm", queue="a b")
    with pytest.raises(UserError, match="signal"):
        JobSpec.from_mapping({"signal": "USR1; reboot", "command": CMD})
    with pytest.raises(UserError, match="directives"):
        JobSpec.from_mapping({"directives": ["--mem=1G\nrm -rf /"], "command": CMD})
    with pytest.raises(UserError, match="output_dir"):
        JobSpec.from_mapping({"output_dir": "logs dir", "command": CMD})


def test_partition_is_an_alias_of_queue() -> None:
    assert JobSpec.from_mapping({"partition": "gpu"}).queue == "gpu"
    with pytest.raises(UserError, match="conflicts"):
        JobSpec.from_mapping({"partition": "gpu", "queue": "cpu"})


def test_types_are_checked() -> None:
    for data, field in (
        ({"nodes": 0}, "nodes"),
        ({"nodes": True}, "nodes"),
        ({"env": ["A"]}, "env"),
        ({"env": {"1A": "x"}}, "env"),
        ({"requeue": "yes"}, "requeue"),
        ({"python": {"pip": "x"}}, "python"),
        ({"wrap": "sometimes"}, "wrap"),
        ({"command": {"a": 1}}, "command"),
    ):
        with pytest.raises(UserError) as info:
            JobSpec.from_mapping(data)
        assert str(info.value).startswith(field), (data, str(info.value))
        assert "allowed" in str(info.value)


def test_command_string_is_split_and_missing_command_refused() -> None:
    assert JobSpec.from_mapping({"command": "python train.py --x 'a b'"}).command == [
        "python",
        "train.py",
        "--x",
        "a b",
    ]
    with pytest.raises(UserError, match="command: missing"):
        build_job(None, {"cluster": "slurm"}, environ={}, cwd=REPO)


def test_yaml_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("cluster: slurm\ncommand: [x\n")
    with pytest.raises(UserError, match="bad.yaml.*line"):
        load_spec(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="allowed: a mapping"):
        load_spec(path)


def test_names() -> None:
    assert job_name("my job; rm -rf /") == "my_job_rm_-rf"
    assert job_name("1st") == "j1st"
    assert job_name("$$$") == "job"
    assert len(job_name("x" * 300)) == 64
    assert default_name(["python", "-m", "ddp", "dpo"]) == "dpo"
    assert default_name(["python", "-u", "train.py"]) == "train"
    assert default_name(["python", "-m", "pkg.mod"]) == "mod"
    assert default_name(["./run.sh"]) == "run.sh"


def test_is_ddp_command() -> None:
    assert is_ddp_command(["python", "-m", "ddp", "dpo"])
    assert is_ddp_command(["/usr/bin/python3.11", "-m", "ddp.exec", "--", "x"])
    assert not is_ddp_command(["python", "train.py"])
    assert not is_ddp_command(["python", "-m", "ddpx"])


def test_resolved_spec_round_trips(tmp_path: Path) -> None:
    import yaml

    job = make_job("aurora", account="p", nodes="2", command=["python", "train.py"], env={"A": "1"})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(job.to_dict()))
    again = build_job(str(path), {}, environ={}, cwd=REPO)
    assert again.to_dict() == job.to_dict()


def test_trailing_newlines_never_pass_a_check() -> None:
    for data in (
        {"env": {"A\n": "x"}},
        {"account": "p\n"},
        {"queue": "q\n"},
        {"signal": "USR1\n"},
        {"output_dir": "logs\n"},
    ):
        with pytest.raises(UserError):
            JobSpec.from_mapping({**data, "command": CMD})


def test_a_same_size_edit_in_the_same_second_is_read(tmp_path: Path) -> None:
    """No stat-keyed cache can serve the old spec (mtime ticks are 1 s on NFS/Lustre)."""
    from hpc._util import load_yaml

    path = tmp_path / "s.yaml"
    path.write_text("nodes: 2\n")
    assert load_yaml(path, "spec") == {"nodes": 2}
    st = path.stat()
    path.write_text("nodes: 3\n")  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, as `cp -p` leaves it
    assert load_yaml(path, "spec") == {"nodes": 3}


def test_unquoted_walltime_is_read_as_written_or_refused(tmp_path: Path) -> None:
    from hpc._util import load_yaml

    path = tmp_path / "s.yaml"
    path.write_text("walltime: 1:30:00\nother: 1:00\n")
    data = load_yaml(path, "spec")
    assert data == {"walltime": "1:30:00", "other": "1:00"}  # text, not YAML 1.1's base 60
    assert parse_walltime(data["walltime"]) == 5400
    with pytest.raises(UserError, match="not a walltime; allowed: HH:MM:SS"):
        parse_walltime(data["other"])  # one hour to a person, one minute to SLURM and PBS


def test_duplicate_key_in_a_spec_is_refused(tmp_path: Path) -> None:
    from hpc._util import load_yaml

    path = tmp_path / "s.yaml"
    path.write_text("nodes: 2\nwalltime: '01:00:00'\nnodes: 16\n")
    with pytest.raises(UserError, match=r"line 3: duplicate key 'nodes' \(first at line 1\)"):
        load_yaml(path, "spec")


def test_alias_bomb_in_a_spec_fails_fast(tmp_path: Path) -> None:
    import time

    from hpc._util import load_yaml

    text = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    prev = "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    path = tmp_path / "bomb.yaml"
    path.write_text("description: hello\n" + text)
    t0 = time.monotonic()
    with pytest.raises(UserError, match="aliases are expanded"):
        load_yaml(path, "spec")
    assert time.monotonic() - t0 < 1.0
