"""ddp.init / wrap / reductions in one process (the world-1 path every laptop takes)."""

from __future__ import annotations

import subprocess
import sys

from tests.ddp.launch_utils import clean_env

SCRIPT = r"""
import torch, ddp
ctx = ddp.init(timeout=30)
assert ctx is ddp.init()
assert (ctx.rank, ctx.world_size, ctx.launcher, ctx.backend) == (0, 1, "single", "gloo")
assert ddp.is_main_process() and not ctx.distributed
m = torch.nn.Linear(2, 2)
assert ddp.wrap(m) is m
assert ddp.reduce_mean(torch.tensor([3.0])).item() == 3.0
assert ddp.reduce_sum(torch.tensor([3])).item() == 3
assert ddp.all_gather_object({"a": 1}) == [{"a": 1}]
ddp.barrier()
ddp.print0("printed-by-rank-0")
ddp.shutdown()
assert ddp.get_context() is None
"""


def test_world_one_without_launcher():
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Initialized DDP: rank=0, world_size=1, local_rank=0" in out.stdout
    assert "Using device: cpu" in out.stdout
    assert "printed-by-rank-0" in out.stdout


def test_exec_reports_bad_launcher_env_in_one_line():
    env = clean_env(RANK="5", LOCAL_RANK="0", WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-m", "ddp.exec", "--", "true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "RANK=5 is not below WORLD_SIZE=2" in out.stderr


def test_exec_exports_torchrun_variables():
    env = clean_env(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2",
                    MASTER_PORT="12345")
    code = "import os; print(*[os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE'," \
           "'LOCAL_WORLD_SIZE','GROUP_RANK','MASTER_ADDR','MASTER_PORT')])"
    out = subprocess.run([sys.executable, "-m", "ddp.exec", "--", sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "2", "2", "0", "localhost", "12345"]


def test_exec_usage_errors():
    out = subprocess.run([sys.executable, "-m", "ddp.exec"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no command given" in out.stderr


def test_unresolvable_master_fails_at_once_in_one_line():
    env = clean_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid",
                    MASTER_PORT="23456")
    out = subprocess.run([sys.executable, "-c", "import ddp; ddp.init(timeout=300)"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ddp: error: master address 'no-such-host.invalid' (torchrun) does not resolve; set "
        "MASTER_ADDR, or DDP_MASTER_ADDR_SUFFIX to the site's host-name suffix"
    ]


def test_site_suffix_falls_back_to_bare_host(tmp_path):
    """Aurora's profile appends .hsn...; off Aurora the bare node name must still work."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("localhost\n")
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", PBS_NODEFILE=str(nodefile),
                    DDP_MASTER_ADDR_SUFFIX=".hsn.cm.aurora.alcf.anl.gov")
    env.pop("RANK")
    env.pop("LOCAL_RANK")
    env.update(PMI_RANK="0", PMI_SIZE="2", PMI_LOCAL_RANK="0", PALS_RANKID="0",
               PALS_LOCAL_RANKID="0", MASTER_PORT="23457")
    code = ("import ddp.dist as d, ddp.env as e; info = d.check_resolves(e.detect()); "
            "print(info.master_addr)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "localhost"
