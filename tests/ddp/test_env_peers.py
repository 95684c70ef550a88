"""Launcher environments that other projects use in their own tests, and what ddp.env makes
of them. Each case names its source; where this project deliberately differs, it says why.

The point is the dangerous kind of disagreement: a rank that silently believes it is
alone, or two nodes that disagree about who they are (issue 14).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import ddp.env_layout
from ddp.env import PORT_BASE, PORT_SPAN, detect, expand_nodelist
from ddp.errors import ConfigError


@dataclass
class Case:
    source: str
    env: dict[str, str]
    #: (launcher, rank, local_rank, world, local_world, node_rank) expected from ddp.env
    want: tuple
    master: str | None = None
    port: int | None = None
    hostname: str = "not-in-any-list"
    files: dict[str, str] = field(default_factory=dict)  # env var -> file content
    argv: tuple[str, ...] = ()
    differs: str = ""  # why this project's answer is not the source's, where it is not


RANKFILE = "batch\n10.10.10.0\n10.10.10.1\n10.10.10.2\n10.10.10.3\n"

CASES = {
    # Lightning tests/tests_fabric/plugins/environments/test_lsf.py
    # (test_attributes_from_environment_variables, test_node_rank).
    "lightning-lsf": Case(
        "Lightning test_lsf.py",
        {
            "LSB_JOBID": "1234",
            "JSM_NAMESPACE_SIZE": "4",
            "JSM_NAMESPACE_RANK": "3",
            "JSM_NAMESPACE_LOCAL_RANK": "1",
        },
        ("lsf", 3, 1, 4, None, 2),
        master="10.10.10.0",
        port=PORT_BASE + 1234 % PORT_SPAN,
        hostname="10.10.10.2",
        files={"LSB_DJOB_RANKFILE": RANKFILE},
        differs="port 20000 + id % 9000 like every launcher here (Lightning: 10000 + id % "
        "1000); ranks per node stay unknown since jsrun's JSM_NAMESPACE_LOCAL_SIZE is absent",
    ),
    # Lightning test_torchelastic.py test_attributes_from_environment_variables.
    "lightning-torchelastic": Case(
        "Lightning test_torchelastic.py",
        {
            "MASTER_ADDR": "1.2.3.4",
            "MASTER_PORT": "500",
            "WORLD_SIZE": "20",
            "RANK": "1",
            "LOCAL_RANK": "2",
            "GROUP_RANK": "3",
        },
        ("torchrun", 1, 2, 20, None, 3),
        master="1.2.3.4",
        port=500,
    ),
    # Lightning test_slurm.py test_attributes_from_environment_variables, as srun sets
    # them for one task (SLURM_STEP_ID added: the test's values describe an srun task).
    "lightning-slurm": Case(
        "Lightning test_slurm.py",
        {
            "SLURM_NODELIST": "1.1.1.1, 1.1.1.2",
            "SLURM_JOB_ID": "0001234",
            "SLURM_NTASKS": "20",
            "SLURM_TASKS_PER_NODE": "10(x2)",
            "SLURM_LOCALID": "2",
            "SLURM_PROCID": "1",
            "SLURM_NODEID": "0",
            "SLURM_JOB_NAME": "JOB",
            "SLURM_STEP_ID": "0",
        },
        ("slurm", 1, 2, 20, 10, 0),
        master="1.1.1.1",
        port=PORT_BASE + 1234 % PORT_SPAN,
        differs="SLURM_NODEID=3 in the source does not exist in a 2-node list; 0 here",
    ),
    # submitit's SlurmJobEnvironment reads SLURM_PROCID/NTASKS/LOCALID/NODEID and
    # SLURM_JOB_NODELIST (submitit/slurm/slurm.py, _env mapping); 2 nodes x 4 tasks.
    "submitit-slurm": Case(
        "submitit slurm.py SlurmJobEnvironment",
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "6",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "2",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_NODELIST": "learnfair[0010-0011]",
        },
        ("slurm", 6, 2, 8, 4, 1),
        master="learnfair0010",
        port=PORT_BASE + 77,
    ),
    # Accelerate's MPI path (commands/launch.py, utils/environment.py) reads
    # MV2_COMM_WORLD_* for MVAPICH; the variables mpirun_rsh sets (MVAPICH source).
    "accelerate-mvapich": Case(
        "Accelerate get_int_from_env + MVAPICH mpirun_rsh",
        {
            "MV2_COMM_WORLD_RANK": "5",
            "MV2_COMM_WORLD_SIZE": "8",
            "MV2_COMM_WORLD_LOCAL_RANK": "1",
            "MV2_COMM_WORLD_LOCAL_SIZE": "4",
            "PMI_ID": "5",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29500",
        },
        ("mvapich", 5, 1, 8, 4, 1),
        master="h0",
        port=29500,
    ),
    # Open MPI's documented variables (docs: "Environment variables set for MPI
    # applications"); the same set Accelerate and Lightning's MPI env read.
    "openmpi-docs": Case(
        "Open MPI docs",
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29500",
        },
        ("openmpi", 3, 1, 4, 2, 1),
        master="h0",
        port=29500,
    ),
    # pytorch-ignite native.py _setup_ddp_vars_from_slurm_env, case 1: a hook (enroot's
    # 50-slurm-pytorch.sh) exports RANK/LOCAL_RANK/WORLD_SIZE equal to SLURM's.
    "ignite-enroot-hook": Case(
        "pytorch-ignite native.py (case 1)",
        {
            "SLURM_JOB_ID": "12",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "c1",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "c1",
            "MASTER_PORT": "15012",
        },
        ("torchrun", 1, 1, 2, 2, 0),
        master="c1",
        port=15012,
    ),
    # pytorch-ignite case 2: torch.distributed.launch (pre-elastic) on 4 local GPUs inside
    # `srun -n 1`: RANK >= SLURM_PROCID and WORLD_SIZE >= SLURM_NTASKS.
    "ignite-launch-in-srun": Case(
        "pytorch-ignite native.py (case 2)",
        {
            "SLURM_JOB_ID": "12",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "1",
            "SLURM_JOB_NODELIST": "c1",
            "RANK": "2",
            "LOCAL_RANK": "2",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
        ("torchrun", 2, 2, 4, 4, 0),
        master="127.0.0.1",
        port=29500,
    ),
    # torch 1.x torch/distributed/launch.py without --use_env: RANK, WORLD_SIZE,
    # MASTER_ADDR/PORT in the environment and --local_rank=N on the command line.
    # Node 1 of 2, 4 per node: no variable says how many ranks share a node.
    "torch-launch-legacy": Case(
        "torch 1.x distributed/launch.py",
        {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"},
        ("legacy", 5, 1, 8, None, None),
        master="n0",
        port=29500,
        argv=("--local_rank=1",),
        differs="ranks per node are not guessed (rank - local rank could be node 1 of 4/node "
        "or node 2 of 2/node); LOCAL_WORLD_SIZE/GROUP_RANK are left unset and the log says so",
    ),
    # ALCF Aurora users' PBS scripts: `mpiexec --pmi=pmix -n 24 -ppn 12` exports PALS
    # variables and PMIX_RANK but no PMI_SIZE; world = nodes in PBS_NODEFILE x ppn.
    "alcf-pals-pmix": Case(
        "ALCF Aurora job scripts (mpiexec --pmi=pmix)",
        {
            "PALS_RANKID": "13",
            "PALS_LOCAL_RANKID": "1",
            "PALS_LOCAL_SIZE": "12",
            "PALS_NODEID": "1",
            "PMIX_RANK": "13",
            "PMIX_NAMESPACE": "pals-1",
            "PBS_JOBID": "4242.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
        },
        ("pals", 13, 1, 24, 12, 1),
        master="x4102c5s0b0n0.hostmgmt2415.cm.aurora.alcf.anl.gov",
        port=PORT_BASE + 4242,
        files={
            "PBS_NODEFILE": "x4102c5s0b0n0.hostmgmt2415.cm.aurora.alcf.anl.gov\n"
            "x4102c5s1b0n0.hostmgmt2415.cm.aurora.alcf.anl.gov\n"
        },
    ),
    # ALCF's documented PALS variables (PMI_* and PALS_*), 2 nodes x 12 tiles.
    "alcf-pals": Case(
        "ALCF Aurora docs (PALS mpiexec)",
        {
            "PMI_RANK": "13",
            "PMI_SIZE": "24",
            "PMI_LOCAL_RANK": "1",
            "PMI_LOCAL_SIZE": "12",
            "PALS_RANKID": "13",
            "PALS_LOCAL_RANKID": "1",
            "PALS_NODEID": "1",
            "PBS_JOBID": "4242.aurora-pbs-0001",
            "DDP_MASTER_ADDR_SUFFIX": ".hsn.cm.aurora.alcf.anl.gov",
        },
        ("pals", 13, 1, 24, 12, 1),
        master="x4102c5s0b0n0.hsn.cm.aurora.alcf.anl.gov",
        files={"PBS_NODEFILE": "x4102c5s0b0n0\nx4102c5s1b0n0\n"},
    ),
    # MPICH hydra on a PBS job whose mpiexec gives no local rank: block placement over the
    # node file, confirmed by the host this rank runs on.
    "mpich-pbs-no-local-rank": Case(
        "MPICH hydra under PBS (ALCF Polaris-style node file)",
        {"PMI_RANK": "5", "PMI_SIZE": "8", "PBS_JOBID": "9.polaris"},
        ("mpich", 5, 1, 8, 4, 1),
        master="x3000c0s1b0n0",
        hostname="x3000c0s13b0n0",
        files={"PBS_NODEFILE": "x3000c0s1b0n0\nx3000c0s13b0n0\n"},
    ),
    # NERSC sc22-dl-tutorial export_DDP_vars.sh: RANK=$SLURM_PROCID etc. in each srun task.
    "nersc-export-ddp-vars": Case(
        "NERSC sc22-dl-tutorial export_DDP_vars.sh",
        {
            "SLURM_JOB_ID": "55",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "3",
            "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_NODELIST": "nid[001000-001001]",
            "RANK": "3",
            "LOCAL_RANK": "3",
            "WORLD_SIZE": "8",
            "MASTER_ADDR": "nid001000",
        },
        ("torchrun", 3, 3, 8, None, None),
        master="nid001000",
        port=PORT_BASE + 55,
        differs="without LOCAL_WORLD_SIZE the script's variables do not say ranks per node; "
        "SLURM's do, but the exported variables win, as they do under torchrun",
    ),
}


def _run(case: Case, tmp_path, monkeypatch):
    env = dict(case.env)
    for var, text in case.files.items():
        path = tmp_path / var.lower()
        path.write_text(text)
        env[var] = str(path)
    monkeypatch.setattr(ddp.env_layout, "_hostname", lambda: case.hostname)
    return detect(env, argv=list(case.argv))


@pytest.mark.parametrize("name", sorted(CASES))
def test_peer_environment(name, tmp_path, monkeypatch):
    case = CASES[name]
    got = _run(case, tmp_path, monkeypatch)
    assert (
        got.launcher,
        got.rank,
        got.local_rank,
        got.world_size,
        got.local_world_size,
        got.node_rank,
    ) == case.want, case.source
    if case.master is not None:
        assert got.master_addr == case.master
    if case.port is not None:
        assert got.master_port == case.port


@pytest.mark.parametrize(
    "text, first",
    [  # Lightning test_slurm.py test_main_address_from_slurm_node_list
        ("127.0.0.1", "127.0.0.1"),
        ("alpha", "alpha"),
        ("alpha,beta,gamma", "alpha"),
        ("alpha beta gamma", "alpha"),
        ("1.2.3.[100-110]", "1.2.3.100"),
        ("1.2.3.[089, 100-110]", "1.2.3.089"),
        ("host[22]", "host22"),
        ("host[1,5-9]", "host1"),
        ("host[5-9,1]", "host5"),
        ("alpha, host[5-9], gamma", "alpha"),
        ("alpha[3,1], beta", "alpha3"),
    ],
)
def test_lightning_node_lists(text, first):
    assert expand_nodelist(text)[0] == first


def test_whitespace_separated_node_list_splits_like_scontrol():
    assert expand_nodelist("n1 n2\tn[3-4]\nn5") == ["n1", "n2", "n3", "n4", "n5"]


@pytest.mark.parametrize("bad", ["invalid[]", "n[,]", "n[1-]", "n[ ]", "n[x1]"])
def test_empty_or_malformed_brackets_are_refused(bad):
    """pytorch-ignite's _expand_hostlist raises 'hostlist invalid' for `invalid[]`."""
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(bad)


# ----------------------------------------------------------------- never train alone


@pytest.mark.parametrize(
    "env, names",
    [
        # LSF jsrun before this project knew it: JSM_* only.
        ({"JSM_NAMESPACE_SIZE": "4", "LSB_JOBID": "1"}, "JSM_NAMESPACE_SIZE=4"),
        # A PMI size with no rank variable (an unknown PMI launcher).
        ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
        # MVAPICH local size without the rank (a broken or unknown launcher).
        ({"MV2_COMM_WORLD_LOCAL_SIZE": "4"}, "MV2_COMM_WORLD_LOCAL_SIZE=4"),
        # A stale WORLD_SIZE with nothing else.
        ({"WORLD_SIZE": "8"}, "WORLD_SIZE=8"),
    ],
)
def test_unknown_launcher_with_several_processes_is_refused(env, names):
    with pytest.raises(ConfigError, match=names):
        detect(env, argv=[])


def test_forced_single_is_not_second_guessed():
    assert detect({"PMI_SIZE": "2", "DDP_LAUNCHER": "single"}, argv=[]).world_size == 1


SRUN_2 = {
    "SLURM_JOB_ID": "31",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "c1",
}


@pytest.mark.parametrize("task", [0, 1])
def test_stale_rank_variables_under_srun_are_refused(task):
    """`RANK=0 LOCAL_RANK=0 WORLD_SIZE=1` left in the shell, then `srun -n 2`."""
    env = SRUN_2 | {
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    with pytest.raises(
        ConfigError,
        match=r"stale.*RANK=0 WORLD_SIZE=1.*slurm.*rank "
        rf"{task} of 2",
    ):
        detect(env, argv=[])
    # The user may choose either side explicitly.
    assert detect(env | {"DDP_LAUNCHER": "slurm"}, argv=[]).rank == task
    assert detect(env | {"DDP_LAUNCHER": "torchrun"}, argv=[]).world_size == 1


def test_stale_rank_variables_under_mpich_are_refused():
    env = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
    }
    with pytest.raises(ConfigError, match="mpich, which started this process as rank 1 of 2"):
        detect(env, argv=[])


def test_real_torchrun_inside_srun_wins():
    """torchrun (TORCHELASTIC_RUN_ID) under `srun -N1 -n1` starting 4 workers per task."""
    env = SRUN_2 | {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "31",
    }
    assert detect(env, argv=[]).launcher == "torchrun"


def test_stale_rank_beyond_the_nested_block_is_refused():
    """RANK=0 WORLD_SIZE=4 stale in both tasks of `srun -n 2`: task 1 cannot be ranks 2-3."""
    env = SRUN_2 | {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "c1",
    }
    with pytest.raises(ConfigError, match="stale"):
        detect(env, argv=[])


# ----------------------------------------------------------------- layout without local size


def test_legacy_layout_is_the_same_answer_on_every_node():
    """torch 1.x launch.py, 2 nodes x 4: every rank leaves ranks-per-node unknown instead of
    deriving 8 on node 0 and 2..4 on node 1 (the old guess)."""
    seen = set()
    for rank in range(8):
        env = {"RANK": str(rank), "WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
        got = detect(env, argv=[f"--local_rank={rank % 4}"])
        seen.add(got.local_world_size)
        assert got.local_rank == rank % 4
        assert "LOCAL_WORLD_SIZE" not in got.torchrun_vars(full=True)
    assert seen == {None}


def test_mpich_without_local_rank_on_a_host_that_breaks_block_placement_stops(
    tmp_path, monkeypatch
):
    """Rank 5 of 8 on the *first* of two nodes: not block placement, so no device can be
    chosen safely; one line instead of cuda:5 on a 4-GPU node."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("a1\nb2\n")
    monkeypatch.setattr(ddp.env_layout, "_hostname", lambda: "a1")
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "1"}
    with pytest.raises(ConfigError, match="local rank is not set"):
        detect(env, argv=[])


def test_pmix_world_needs_the_node_file():
    env = {"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "12"}
    with pytest.raises(ConfigError, match="PMI_SIZE"):
        detect(env, argv=[])


def test_pmix_derivation_is_said(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1\nx2\n")
    got = detect(
        {
            "PALS_RANKID": "0",
            "PALS_LOCAL_RANKID": "0",
            "PALS_LOCAL_SIZE": "12",
            "PALS_NODEID": "0",
            "PBS_NODEFILE": str(nodefile),
        },
        argv=[],
    )
    assert got.world_size == 24
    assert any("PMI_SIZE is not set" in note for note in got.notes)


# ----------------------------------------------------------------- ddp.exec's environment


def test_exec_exports_what_torchrun_exports(monkeypatch):
    import torch.distributed as tdist

    from ddp.exec import exec_vars

    env = {
        "SLURM_JOB_ID": "123",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "nid[001-002]",
    }
    out = exec_vars(detect(env, argv=[]), env)
    # The keys torch's elastic agent sets for a worker (local_elastic_agent.py), plus
    # LOCAL_RANK (set per worker) and OMP_NUM_THREADS (run.py, several per node).
    agent = {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "LOCAL_RANK",
        "OMP_NUM_THREADS",
    }
    assert agent <= set(out)
    assert (out["GROUP_WORLD_SIZE"], out["GROUP_RANK"], out["LOCAL_WORLD_SIZE"]) == ("2", "1", "4")
    assert (out["ROLE_RANK"], out["ROLE_WORLD_SIZE"], out["ROLE_NAME"]) == ("5", "8", "default")
    assert out["TORCHELASTIC_RUN_ID"] == "123" and out["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    for key, value in out.items():
        monkeypatch.setenv(key, value)
    assert tdist.is_torchelastic_launched()
    # The exported set reads back as torchrun with the same answer.
    again = detect(out, argv=[])
    assert (again.launcher, again.rank, again.local_world_size, again.node_rank) == (
        "torchrun",
        5,
        4,
        1,
    )


def test_exec_under_real_torchrun_keeps_the_agent_values():
    from ddp.exec import exec_vars

    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "ROLE_NAME": "trainer",
        "TORCHELASTIC_RUN_ID": "abc",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    out = exec_vars(detect(env, argv=[]), env)
    for key in (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "ROLE_NAME",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
    ):
        assert key not in out  # left as torchrun set them
