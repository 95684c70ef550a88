"""Launcher detection, table-driven with the exact variables each launcher sets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp.env import PORT_BASE, PORT_SPAN, detect, expand_nodelist
from ddp.errors import ConfigError

# What each launcher really exports (see shared/notes/real-schedulers.md and the MPICH /
# Open MPI runs in test_launchers.py), for rank 3 of 4 with 2 ranks per node.
CASES = {
    "torchrun": (
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "x",
        },
        (3, 1, 4, 2, 1, "n0", 29400),
    ),
    "slurm": (
        {
            "SLURM_JOB_ID": "123456",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_NODELIST": "nid[001002-001003]",
        },
        (3, 1, 4, 2, 1, "nid001002", PORT_BASE + 123456 % PORT_SPAN),
    ),
    "pals": (
        {
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "PMI_LOCAL_RANK": "1",
            "PALS_RANKID": "3",
            "PALS_LOCAL_RANKID": "1",
            "PBS_JOBID": "98765.aurora-pbs-0001.hostmgmt.cm",
            "PALS_NODEID": "1",
            "PMI_LOCAL_SIZE": "2",
        },
        (3, 1, 4, 2, 1, None, PORT_BASE + 98765 % PORT_SPAN),
    ),
    "mpich": (
        {
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "PMI_FD": "6",
            "MASTER_ADDR": "h0",
        },
        (3, 1, 4, 2, 1, "h0", None),
    ),
    "openmpi": (
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "1",
            "OMPI_MCA_ess_base_jobid": "2055340033",
            "MASTER_ADDR": "h0",
        },
        (3, 1, 4, 2, 1, "h0", PORT_BASE + 2055340033 % PORT_SPAN),
    ),
}


@pytest.mark.parametrize("launcher", sorted(CASES))
def test_each_launcher(launcher, tmp_path):
    env, (rank, local, world, local_world, node, addr, port) = CASES[launcher]
    env = dict(env)
    if launcher == "pals":
        nodefile = tmp_path / "nodefile"
        nodefile.write_text("x1000c0s0b0n0\nx1000c0s0b0n1\n")
        env["PBS_NODEFILE"] = str(nodefile)
        addr = "x1000c0s0b0n0"
    got = detect(env, argv=[])
    assert got.launcher == launcher
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size, got.node_rank) == (
        rank,
        local,
        world,
        local_world,
        node,
    )
    assert got.master_addr == addr
    if port is not None:
        assert got.master_port == port


def test_torchrun_inside_slurm_is_torchrun():
    env = dict(CASES["slurm"][0]) | dict(CASES["torchrun"][0])
    assert detect(env, argv=[]).launcher == "torchrun"


def test_mpich_inside_slurm_batch_shell_is_mpich():
    env = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"} | CASES["mpich"][0]
    assert detect(env, argv=[]).launcher == "mpich"


def test_single_process():
    got = detect({}, argv=[])
    assert (got.launcher, got.rank, got.world_size, got.master_addr, got.master_port) == (
        "single",
        0,
        1,
        "localhost",
        29500,
    )


def test_legacy_local_rank_flag():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1234"}
    for argv in (["--local_rank=1"], ["--local-rank", "1"], ["x", "--local-rank=1"]):
        got = detect(env, argv=argv)
        assert (got.launcher, got.local_rank, got.rank) == ("legacy", 1, 1)


def test_batch_shell_without_srun_is_refused():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NODELIST": "n1",
    }
    with pytest.raises(ConfigError, match="srun"):
        detect(env, argv=[])
    # One task in the batch shell is just a single process.
    assert detect(env | {"SLURM_NTASKS": "1"}, argv=[]).launcher == "single"
    # A SLURM that marks the batch step with its reserved id is still the batch shell.
    with pytest.raises(ConfigError, match="srun"):
        detect(env | {"SLURM_STEP_ID": "4294967294"}, argv=[])
    # And the user can insist.
    assert detect(env | {"DDP_LAUNCHER": "single"}, argv=[]).world_size == 1


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "not below WORLD_SIZE=2"),
        ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE"),
        ({"PMI_RANK": "0"}, "PMI_SIZE"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "not an integer"),
        ({"DDP_LAUNCHER": "bogus"}, "allowed: auto"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
            "MASTER_ADDR",
        ),
        (
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "out of range",
        ),
    ],
)
def test_inconsistent_values_are_clear(env, message):
    with pytest.raises(ConfigError, match=message):
        detect(env, argv=[])


def test_port_is_same_on_every_rank_and_in_range():
    ports = {
        detect(
            {
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(r),
                "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "c1",
            },
            argv=[],
        ).master_port
        for r in range(2)
    }
    assert len(ports) == 1 and PORT_BASE <= ports.pop() < PORT_BASE + PORT_SPAN


def test_master_addr_suffix_and_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4102c5s0b0n0\nx4102c5s1b0n0\n")
    env = {
        "PMI_RANK": "0",
        "PMI_SIZE": "24",
        "PMI_LOCAL_RANK": "0",
        "PALS_RANKID": "0",
        "PALS_LOCAL_RANKID": "0",
        "PALS_LOCAL_SIZE": "12",
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "1.x",
        "DDP_MASTER_ADDR_SUFFIX": ".hsn.cm.aurora.alcf.anl.gov",
    }
    got = detect(env, argv=[])
    assert got.master_addr == "x4102c5s0b0n0.hsn.cm.aurora.alcf.anl.gov"
    assert got.local_world_size == 12 and got.num_nodes == 2
    # An explicit MASTER_ADDR is taken as it is.
    assert detect(env | {"MASTER_ADDR": "h"}, argv=[]).master_addr == "h"


def test_torchrun_vars_round_trip():
    env, _ = CASES["slurm"]
    got = detect(env, argv=[])
    again = detect(got.torchrun_vars(), argv=[])
    assert again.launcher == "torchrun"
    assert (
        again.rank,
        again.local_rank,
        again.world_size,
        again.local_world_size,
        again.node_rank,
        again.master_addr,
        again.master_port,
    ) == (
        got.rank,
        got.local_rank,
        got.world_size,
        got.local_world_size,
        got.node_rank,
        got.master_addr,
        got.master_port,
    )


@pytest.mark.parametrize(
    "text, hosts",
    [
        (
            "nid[001002-001004,001010],login1",
            ["nid001002", "nid001003", "nid001004", "nid001010", "login1"],
        ),
        ("n1", ["n1"]),
        ("c[08-10]", ["c08", "c09", "c10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b[3,5]", ["a", "b3", "b5"]),
    ],
)
def test_expand_nodelist_examples(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[3-1]", "n[a-b]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ConfigError):
        expand_nodelist(bad)


_prefix = st.text(alphabet="abcxyz", min_size=1, max_size=4)


@given(
    groups=st.lists(
        st.tuples(_prefix, st.integers(0, 999), st.integers(0, 20), st.integers(1, 6)),
        min_size=1,
        max_size=4,
    )
)
def test_expand_nodelist_property(groups):
    """Compressing hosts the way SLURM does and expanding them gives the hosts back."""
    expected, parts = [], []
    for prefix, start, length, width in groups:
        width = max(width, len(str(start + length)))
        nums = [str(i).zfill(width) for i in range(start, start + length + 1)]
        expected.extend(prefix + n for n in nums)
        parts.append(f"{prefix}[{nums[0]}-{nums[-1]}]" if len(nums) > 1 else prefix + nums[0])
    assert expand_nodelist(",".join(parts)) == expected


def test_srun_step_smaller_than_the_job_uses_the_step_size():
    env = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "c1",
    }
    got = detect(env, argv=[])
    assert (got.world_size, got.local_world_size, got.rank) == (2, 2, 1)


SRUN_TASK = {
    "SLURM_JOB_ID": "123",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "nid[001-002]",
}


def test_srun_with_cray_shasta_plugin_is_slurm():
    """Perlmutter/Frontier: srun's cray_shasta plugin adds PALS_RANKID/PALS_NODEID only."""
    got = detect(SRUN_TASK | {"PALS_RANKID": "5", "PALS_NODEID": "1"}, argv=[])
    assert (got.launcher, got.rank, got.local_rank, got.local_world_size, got.node_rank) == (
        "slurm",
        5,
        1,
        4,
        1,
    )


def test_srun_with_pmi2_is_slurm():
    """`srun --mpi=pmi2` exports PMI_RANK/PMI_SIZE but no local rank."""
    got = detect(SRUN_TASK | {"PMI_RANK": "5", "PMI_SIZE": "8"}, argv=[])
    assert (got.launcher, got.local_rank, got.local_world_size) == ("slurm", 1, 4)


def test_mpirun_inside_a_slurm_batch_shell_keeps_its_ranks():
    env = {
        "SLURM_JOB_ID": "5",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
    }
    assert detect(env, argv=[]).launcher == "mpich"


def test_aurora_full_node_names_take_the_site_suffix(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4415c6s5b0n0.hostmgmt2415.cm.aurora.alcf.anl.gov\n")
    env = {
        "PMI_RANK": "0",
        "PMI_SIZE": "2",
        "PMI_LOCAL_RANK": "0",
        "PALS_RANKID": "0",
        "PALS_LOCAL_RANKID": "0",
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "1.x",
        "DDP_MASTER_ADDR_SUFFIX": ".hsn.cm.aurora.alcf.anl.gov",
    }
    assert detect(env, argv=[]).master_addr == "x4415c6s5b0n0.hsn.cm.aurora.alcf.anl.gov"


def test_pals_partial_node_without_local_size(tmp_path):
    """mpiexec -n 4 --ppn 4 in a 2-node job, no local size exported: rank 3 knows its
    local rank and node, but not how many ranks share the node; an even-spread guess
    (2) would differ from what other ranks could guess, so it stays unknown."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("a\nb\n")
    env = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "PMI_LOCAL_RANK": "3",
        "PALS_RANKID": "3",
        "PALS_LOCAL_RANKID": "3",
        "PALS_NODEID": "0",
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "1.x",
    }
    got = detect(env, argv=[])
    assert (got.local_rank, got.local_world_size, got.node_rank) == (3, None, 0)
    assert "LOCAL_WORLD_SIZE" not in got.torchrun_vars() and got.notes
