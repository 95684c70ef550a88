"""Site known-issue rules through the CLI (issue 32): Aurora's rank layout, PBS comments.

Each test runs ``python -m hpc`` as a user would, at the ``ppn`` where the rule switches
(6 GPUs x 2 tiles on Aurora: ppn <= 6 one rank per GPU, 7-12 one rank per tile), and
reads the rendered script and the one stderr line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hpc.conftest import REPO

#: [AJ] https://docs.alcf.anl.gov/aurora/running-jobs-aurora/ "Each CPU has 52 physical
#: cores ... 104 physical cores and 208 logical processors": socket 0 is cores 0-51 and
#: their second threads 104-155, socket 1 cores 52-103 and 156-207.
SOCKET0 = set(range(0, 52)) | set(range(104, 156))


def _hpc(
    *argv: str,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PBS_ACCOUNT", "HPC_ACCOUNT", "HPC_DDP_CLUSTERS")
    }
    full.update({"PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "hpc", *argv],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _spec(tmp_path: Path, cluster: str = "aurora", **extra: object) -> Path:
    data = {
        "cluster": cluster,
        "nodes": 2,
        "queue": "debug",
        "walltime": "00:30:00",
        "command": ["python", "-m", "ddp", "dpo"],
        **extra,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _launch(text: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith("mpiexec "))


def _bind_lists(launch: str) -> list[set[int]]:
    """``--cpu-bind list:1-16:17-32`` -> [{1..16}, {17..32}] (one set per rank)."""
    spec = re.search(r"--cpu-bind list:(\S+)", launch)
    assert spec, launch
    ranks = []
    for item in spec.group(1).split(":"):
        cores: set[int] = set()
        for part in item.split(","):
            lo, _, hi = part.partition("-")
            cores |= set(range(int(lo), int(hi or lo) + 1))
        ranks.append(cores)
    return ranks


def test_aurora_ppn6_is_one_rank_per_gpu_over_both_sockets(tmp_path: Path) -> None:
    """Seed 001's ``mpiexec -n 12 -ppn 6``: each rank a whole GPU (both tiles, composite
    hierarchy: local rank r -> xpu:r = GPU r), cores on both sockets, nothing idle."""
    proc = _hpc("render", str(_spec(tmp_path)), "--ppn", "6", "--no-account")
    assert proc.returncode == 0, proc.stderr
    assert "export ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE" in proc.stdout.splitlines()
    launch = _launch(proc.stdout)
    assert launch.startswith("mpiexec -n 12 --ppn 6 --cpu-bind list:"), launch
    ranks = _bind_lists(launch)
    assert len(ranks) == 6
    on0 = [bool(r & SOCKET0) for r in ranks]
    assert on0 == [True, True, True, False, False, False], ranks  # GPUs 0-2 / 3-5 per socket
    assert all(not (r & SOCKET0) or r <= SOCKET0 for r in ranks)  # no rank split over sockets
    assert "idle" not in proc.stderr


def test_aurora_ppn12_keeps_one_rank_per_tile(tmp_path: Path) -> None:
    proc = _hpc("render", str(_spec(tmp_path)), "--ppn", "12", "--no-account")
    assert proc.returncode == 0, proc.stderr
    assert "ZE_FLAT_DEVICE_HIERARCHY" not in proc.stdout
    ranks = _bind_lists(_launch(proc.stdout))
    assert len(ranks) == 12 and sum(bool(r & SOCKET0) for r in ranks) == 6
    assert "idle" not in proc.stderr


@pytest.mark.parametrize(
    ("ppn", "said", "composite"),
    [
        ("4", "2 GPUs idle of 6", True),
        ("5", "1 GPU idle of 6", True),
        ("8", "4 GPU tiles idle of 12", False),
        ("11", "1 GPU tile idle of 12", False),
    ],
)
def test_aurora_idle_devices_are_said_once(
    tmp_path: Path, ppn: str, said: str, composite: bool
) -> None:
    spec = str(_spec(tmp_path))
    for argv in (
        ["render", spec, "--ppn", ppn, "--no-account"],
        [
            "submit",
            spec,
            "--ppn",
            ppn,
            "--account",
            "proj",
            "--dry-run",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
    ):
        proc = _hpc(*argv)
        assert proc.returncode == 0, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if "idle" in ln]
        assert len(lines) == 1 and said in lines[0], proc.stderr
        assert ("ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE" in proc.stdout) == composite
        assert f"--ppn {ppn} --cpu-bind list:" in proc.stdout


def test_spec_env_wins_over_the_layout(tmp_path: Path) -> None:
    """A user who wants tiles even at ppn 6 says so in the spec's env."""
    spec = _spec(tmp_path, env={"ZE_FLAT_DEVICE_HIERARCHY": "FLAT"})
    proc = _hpc("render", str(spec), "--ppn", "6", "--no-account")
    assert proc.returncode == 0, proc.stderr
    assert "export ZE_FLAT_DEVICE_HIERARCHY=FLAT" in proc.stdout
    assert "COMPOSITE" not in proc.stdout


def test_tiles_that_do_not_divide_the_devices_are_one_line(tmp_path: Path) -> None:
    site = tmp_path / "sites"
    site.mkdir()
    (site / "tiled.yaml").write_text("extends: aurora\ntiles: {per_gpu: 5}\n", encoding="utf-8")
    proc = _hpc(
        "render",
        str(_spec(tmp_path, cluster="tiled")),
        "--no-account",
        env={"HPC_DDP_CLUSTERS": str(site)},
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "tiles: per_gpu: 5" in proc.stderr, proc.stderr


def test_composite_devices_are_one_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """ddp's device choice under ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE (6 xpu devices):
    local rank r of 6 drives xpu:r, each GPU once."""
    import torch

    from ddp import backends

    monkeypatch.setattr(backends, "available_devices", lambda: ["xpu", "cpu"])
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 6)
    chosen = [backends.choose_device("auto", r, 12) for r in range(6)]
    assert chosen == [torch.device("xpu", r) for r in range(6)]


# --- PBS: no comment before or among the directives -----------------------------------


def _comments_before_last_directive(text: str) -> list[str]:
    lines = text.splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith("#PBS"))
    return [ln for ln in lines[1:last] if not ln.startswith("#PBS")]


@pytest.mark.parametrize("cluster", ["aurora", "polaris", "pbs"])
def test_pbs_comments_follow_all_directives(tmp_path: Path, cluster: str) -> None:
    """ALCF: comments only after ALL #PBS directives; the header, the deferred account
    and the signal notes included (each of them was on or among the directives)."""
    spec = _spec(tmp_path, cluster=cluster, signal="USR1@90")
    proc = _hpc("render", str(spec), "--no-account")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!")
    assert _comments_before_last_directive(proc.stdout) == []
    assert ("# account: none in the spec" in proc.stdout) == (cluster != "pbs")  # required?
    assert "# signal USR1@90" in proc.stdout
    assert "# Generated by hpc render" in proc.stdout


def test_checked_in_pbs_jobs_have_no_comment_among_directives() -> None:
    jobs = sorted((REPO / "jobs").glob("*.pbs"))
    assert jobs
    for path in jobs:
        assert _comments_before_last_directive(path.read_text(encoding="utf-8")) == [], path


# --- environment rules (hpc.cluster.Rule) ----------------------------------------------


@pytest.mark.parametrize("cluster", ["aurora", "polaris"])
def test_alcf_tmpdir_is_short_unless_the_spec_sets_it(tmp_path: Path, cluster: str) -> None:
    """ALCF known issues: AF_UNIX path too long under mpiexec -> TMPDIR=/tmp by default."""
    proc = _hpc("render", str(_spec(tmp_path, cluster=cluster)), "--no-account")
    assert proc.returncode == 0, proc.stderr
    assert "export TMPDIR=/tmp" in proc.stdout.splitlines()
    own = _hpc(
        "render", str(_spec(tmp_path, cluster=cluster, env={"TMPDIR": "/local/t"})), "--no-account"
    )
    assert "export TMPDIR=/local/t" in own.stdout.splitlines() and "TMPDIR=/tmp" not in own.stdout
    slurm = _hpc("render", str(_spec(tmp_path, cluster="perlmutter")), "--account", "m1")
    assert "TMPDIR" not in slurm.stdout  # a rule of the ALCF profiles, not of every site


def _frontier(tmp_path: Path, nodes: int, **env: str) -> subprocess.CompletedProcess[str]:
    spec = _spec(tmp_path, cluster="frontier", env=env)
    data = yaml.safe_load(spec.read_text())
    data.pop("queue")
    data["nodes"] = nodes
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")
    return _hpc("render", str(spec), "--account", "abc123")


def test_frontier_refuses_memhooks_in_one_line(tmp_path: Path) -> None:
    proc = _frontier(tmp_path, 2, FI_MR_CACHE_MONITOR="memhooks")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "memhooks" in proc.stderr and "allowed: kdreg2" in proc.stderr
    assert "pytorch_frontier.html" in proc.stderr
    assert _frontier(tmp_path, 2, FI_MR_CACHE_MONITOR="userfaultfd").returncode == 0


def test_frontier_nccl_net_ofi_only_from_two_nodes(tmp_path: Path) -> None:
    """OLCF: the plugin never initialises on one node; NCCL_NET=OFI is for multi-node."""
    one = _frontier(tmp_path, 1, NCCL_NET="OFI")
    assert one.returncode == 2 and one.stderr.count("\n") == 1
    assert "1-node job" in one.stderr and "allowed: NCCL_NET=Socket" in one.stderr
    two = _frontier(tmp_path, 2, NCCL_NET="OFI")
    assert two.returncode == 0, two.stderr
    assert "export NCCL_NET=OFI" in two.stdout.splitlines()
    assert _frontier(tmp_path, 1, NCCL_NET="Socket").returncode == 0


PLUGIN_VARS = ["NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_COLLNET_ENABLE", "NCCL_NET"]


def test_polaris_aws_ofi_nccl_switch(tmp_path: Path) -> None:
    """Off by default (ALCF's recommended plugin variables exported); switched on in the
    user's own profile, the four variables ALCF names are unset after every export and
    said once."""
    spec = str(_spec(tmp_path, cluster="polaris"))
    default = _hpc("render", spec, "--no-account")
    assert default.returncode == 0 and "unset" not in default.stdout
    assert "export NCCL_NET='AWS Libfabric'" in default.stdout.splitlines()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "polaris.yaml").write_text(
        "rules: {aws_ofi_nccl_off: {enabled: true}}\n", encoding="utf-8"
    )
    proc = _hpc("render", spec, "--no-account", env={"HPC_DDP_CLUSTERS": str(mine)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"unset {' '.join(PLUGIN_VARS)}" in lines
    at = lines.index(f"unset {' '.join(PLUGIN_VARS)}")
    assert not [ln for ln in lines if ln.startswith(tuple(f"export {v}=" for v in PLUGIN_VARS))]
    assert (
        max(
            i
            for i, ln in enumerate(lines)
            if ln.startswith("export ")
            and "=" in ln
            and not ln.startswith("export LD_LIBRARY_PATH")
        )
        < at
    )
    said = [ln for ln in proc.stderr.splitlines() if "aws_ofi_nccl_off" in ln]
    assert len(said) == 1 and "/libraries/nccl/" in said[0]
    # the job's shell really has them unset when a module had set them
    run = subprocess.run(
        [
            "bash",
            "-c",
            "export NCCL_NET=x NCCL_CROSS_NIC=1; "
            + "\n".join(lines[at : at + 1])
            + '\necho "[${NCCL_NET-}${NCCL_CROSS_NIC-}]"',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        ("{x: {env: {A: b}}}", "rules: x: source: ''"),
        ("{x: {when: {nodes: 0-1}, warn: w, source: 'https://a'}}", "rules: x: when: nodes"),
        ("{x: {when: {queue: debug}, source: 'https://a'}}", "queue"),
    ],
)
def test_a_bad_rule_is_one_line(tmp_path: Path, rule: str, said: str) -> None:
    site = tmp_path / "sites"
    site.mkdir()
    (site / "ruled.yaml").write_text(f"extends: pbs\nrules: {rule}\n", encoding="utf-8")
    proc = _hpc(
        "render", str(_spec(tmp_path, cluster="ruled")), env={"HPC_DDP_CLUSTERS": str(site)}
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert said in proc.stderr
