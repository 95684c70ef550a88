"""Built-in site profiles against their sites' own pages: one test per documented fact.

Each test names the fact it checks; the profile line it checks cites the page
(hpc/clusters/*.yaml). Refusals are checked through ``python -m hpc render`` in a
subprocess: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import profiles as clusters
from hpc.core import build_job
from hpc.errors import UserError
from hpc.render import render
from tests.hpc.conftest import REPO, make_job

SITES = ("aurora", "polaris", "frontier", "perlmutter")
CMD = ["python", "-m", "ddp", "dpo"]


def _render(cluster: str, **overrides: object) -> str:
    overrides.setdefault("account", "proj")
    overrides.setdefault("command", CMD)
    return render(make_job(cluster, **overrides))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m hpc render ARGS`` with this checkout first on the path, no account env."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    )
    for var in (
        "HPC_ACCOUNT",
        "PBS_ACCOUNT",
        "SBATCH_ACCOUNT",
        "SLURM_ACCOUNT",
        "HPC_DDP_CLUSTERS",
    ):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "hpc", "render", *args, "--", "python", "t.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _refused(*args: str) -> str:
    """The one stderr line of a refused render (exit 2, nothing on stdout)."""
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _directives(text: str, prefix: str) -> list[str]:
    return [ln[len(prefix) :].strip() for ln in text.splitlines() if ln.startswith(prefix)]


# --- Polaris: https://docs.alcf.anl.gov/polaris/ ---------------------------------------


def test_polaris_enables_aws_ofi_nccl_plugin() -> None:
    """[PN] NCCL page: NCCL_NET="AWS Libfabric" and the aws-ofi-nccl v1.9.1-aws library path."""
    text = _render("polaris", nodes="2")
    lines = text.splitlines()
    assert "export NCCL_NET='AWS Libfabric'" in lines
    plugin = (
        "export LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib"
        "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    )
    hwloc = "export LD_LIBRARY_PATH=/soft/libraries/hwloc/lib/${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    assert lines.index(plugin) < lines.index(hwloc)  # the page's order
    # both before the launch line, so every rank inherits them
    assert lines.index(hwloc) < next(i for i, ln in enumerate(lines) if ln.startswith("mpiexec"))


def test_polaris_sets_every_variable_of_alcf_nccl_page() -> None:
    """[PN] "the following best environment setup": every variable, none left out."""
    text = _render("polaris", nodes="2")
    for line in (
        "export NCCL_NET_GDR_LEVEL=PHB",
        "export NCCL_CROSS_NIC=1",
        "export NCCL_COLLNET_ENABLE=1",
        "export FI_CXI_DISABLE_HOST_REGISTER=1",
        "export FI_MR_CACHE_MONITOR=userfaultfd",
        "export FI_CXI_DEFAULT_CQ_SIZE=131072",
    ):
        assert line in text.splitlines(), line


def test_polaris_ranks_drive_the_gpu_nearest_their_cores() -> None:
    """[PG] GPU 3 <-> CPUs 0-7 ... GPU 0 <-> CPUs 24-31; gpu = num_gpus - 1 - local_rank % num_gpus."""
    text = _render("polaris", nodes="2")
    order = re.search(r"^export CUDA_VISIBLE_DEVICES=([\d,]+)$", text, re.M)
    depth = re.search(r"--depth (\d+) --cpu-bind depth", text)
    assert order and depth
    visible = [int(i) for i in order.group(1).split(",")]
    nearest = {3: range(0, 8), 2: range(8, 16), 1: range(16, 24), 0: range(24, 32)}  # [PG]
    for local_rank in range(4):
        first_core = local_rank * int(depth.group(1))  # PALS --cpu-bind depth
        gpu = visible[local_rank % len(visible)]  # ddp.backends: cuda:(local_rank % count)
        assert first_core in nearest[gpu]
        assert gpu == 4 - 1 - local_rank % 4  # ALCF's set_affinity_gpu_polaris.sh


def test_polaris_job_that_fits_no_regular_queue_is_refused_not_preemptable() -> None:
    """[PJ] preemptable jobs "can be killed at any time": never chosen for the user."""
    line = _refused(
        "--cluster", "polaris", "--nodes", "5", "--walltime", "02:00:00", "--account", "p"
    )
    assert line.startswith("hpc: error: nodes/walltime: no queue of polaris takes 5 nodes")
    assert "preemptable 1-10 nodes, <= 72:00:00 (by request: --queue preemptable)" in line
    with pytest.raises(UserError, match="no queue of polaris takes 10 nodes for 06:00:00"):
        make_job("polaris", nodes="10", walltime="06:00:00", account="p", command=CMD)


def test_polaris_preemptable_asked_for_renders_rerun_and_advice() -> None:
    """[PJ] "To make your job rerunnable, add the following PBS directive: #PBS -r y"."""
    text = _render("polaris", nodes="5", walltime="02:00:00", queue="preemptable")
    pbs = _directives(text, "#PBS")
    assert "-q preemptable" in pbs and pbs.count("-r y") == 1
    assert "# preemptable: jobs may be killed without any warning" in text
    requeued = _render("polaris", nodes="5", walltime="02:00:00", queue="preemptable", requeue=True)
    assert _directives(requeued, "#PBS").count("-r y") == 1  # not twice with the spec's requeue
    assert "-r y" not in _directives(_render("polaris", nodes="1"), "#PBS")


def test_polaris_capacity_queue_takes_4_nodes_for_48_hours() -> None:
    """[PJ] capacity: 1 / 4 nodes, 168 hrs."""
    assert "-q capacity" in _directives(_render("polaris", nodes="4", walltime="48:00:00"), "#PBS")
    assert "-q capacity" in _directives(_render("polaris", nodes="1", walltime="168:00:00"), "#PBS")
    with pytest.raises(UserError, match="does not fit queue capacity of polaris; allowed: 1-4"):
        make_job(
            "polaris", nodes="5", walltime="48:00:00", queue="capacity", account="p", command=CMD
        )


def test_polaris_prod_bins_limit_walltime_by_size() -> None:
    """[PJ] small 10-24 3 hrs, medium 25-99 6 hrs, large 100-496 24 hrs."""
    assert "-q prod" in _directives(_render("polaris", nodes="24", walltime="03:00:00"), "#PBS")
    with pytest.raises(UserError, match="allowed: up to 03:00:00"):
        make_job("polaris", nodes="24", walltime="03:00:01", queue="prod", account="p", command=CMD)
    assert "-q prod" in _directives(_render("polaris", nodes="100", walltime="24:00:00"), "#PBS")


def test_polaris_minimum_walltime_is_5_minutes() -> None:
    """[PJ] "Time Min 5 min" for every queue."""
    line = _refused("--cluster", "polaris", "--walltime", "00:04:00", "--account", "p")
    assert line == (
        "hpc: error: walltime: 00:04:00 is below the minimum of queue debug of polaris; "
        "allowed: 00:05:00 or more"
    )
    assert "#PBS -l walltime=00:05:00" in _render("polaris", walltime="00:05:00")


def test_polaris_keeps_output_streaming_with_k_doe() -> None:
    """[RJ] "We automatically add -k doe ... we enforce that option"."""
    assert "-k doe" in _directives(_render("polaris"), "#PBS")


def test_polaris_script_is_a_login_shell() -> None:
    """[PJ]/[PG] example scripts start with "#!/bin/bash -l"."""
    assert _render("polaris").startswith("#!/bin/bash -l\n")


# --- Aurora: https://docs.alcf.anl.gov/aurora/running-jobs-aurora/ --------------------


def test_aurora_prod_300_nodes_20h_refused() -> None:
    """[AJ] prod routes 256-1024 nodes to small, at most 12 hrs."""
    line = _refused(
        "--cluster", "aurora", "--nodes", "300", "--walltime", "20:00:00", "--account", "p"
    )
    assert line.startswith(
        "hpc: error: nodes/walltime: no queue of aurora takes 300 nodes for 20:00:00"
    )
    assert "prod 256-10624 nodes, <= 12:00:00 for 256-1024" in line
    line = _refused(
        "--cluster",
        "aurora",
        "--nodes",
        "300",
        "--walltime",
        "20:00:00",
        "--queue",
        "prod",
        "--account",
        "p",
    )
    assert line == (
        "hpc: error: walltime: 20:00:00 exceeds queue prod of aurora for 300 nodes; "
        "allowed: up to 12:00:00"
    )


def test_aurora_prod_bins_small_medium_large() -> None:
    """[AJ] small 256-1024 12 hrs, medium 1025-1999 18 hrs, large 2000-10,624 24 hrs."""
    for nodes, ok, too_long in (
        ("1024", "12:00:00", "12:00:01"),
        ("1025", "18:00:00", "18:00:01"),
        ("2000", "24:00:00", "24:00:01"),
    ):
        assert "-q prod" in _directives(_render("aurora", nodes=nodes, walltime=ok), "#PBS")
        with pytest.raises(UserError, match=f"allowed: up to {ok}"):
            make_job(
                "aurora", nodes=nodes, walltime=too_long, queue="prod", account="p", command=CMD
            )


def test_aurora_minimum_walltime_is_5_minutes() -> None:
    """[AJ] "Time Min 5 min" for every queue."""
    line = _refused("--cluster", "aurora", "--walltime", "00:04:59", "--account", "p")
    assert line == (
        "hpc: error: walltime: 00:04:59 is below the minimum of queue debug of aurora; "
        "allowed: 00:05:00 or more"
    )


def test_aurora_keeps_output_streaming_with_k_doe() -> None:
    """[AJ] recommended options "#PBS -k doe"."""
    assert "-k doe" in _directives(_render("aurora"), "#PBS")


def test_aurora_script_is_a_login_shell() -> None:
    """[AJ] recommended options start with "#!/bin/bash -l"."""
    assert _render("aurora").startswith("#!/bin/bash -l\n")


def test_aurora_visualization_queue_only_by_request() -> None:
    """[AJ] visualization 1-32 nodes, 8 hrs, "By request only"."""
    with pytest.raises(UserError, match="no queue of aurora takes 20 nodes for 02:00:00"):
        make_job("aurora", nodes="20", walltime="02:00:00", account="p", command=CMD)
    text = _render("aurora", nodes="20", walltime="02:00:00", queue="visualization")
    assert "-q visualization" in _directives(text, "#PBS")


# --- Frontier: https://docs.olcf.ornl.gov/ ---------------------------------------------


def test_frontier_loads_rccl_net_plugin_after_rocm_and_gfx90a() -> None:
    """[FP] "load the rccl-net-plugin module after having loaded rocm"; craype-accel-amd-gfx90a."""
    lines = _render("frontier", nodes="2").splitlines()
    order = [ln for ln in lines if ln.startswith("module load ")]
    assert order == [
        "module load PrgEnv-gnu",
        "module load rocm",
        "module load rccl-net-plugin",
        "module load craype-accel-amd-gfx90a",
    ]


def test_frontier_sets_a_per_job_miopen_cache(tmp_path: Path) -> None:
    """[FP] MIOPEN_USER_DB_PATH and MIOPEN_CUSTOM_CACHE_DIR, emptied and created: "Needed to
    bypass MIOpen, Disk I/O Errors"; one directory per job id."""
    text = _render("frontier", nodes="2")
    start = text.index("export MIOPEN_USER_DB_PATH=")
    end = text.index("\n", text.index("mkdir -p", start))
    block = text[start : end + 1]
    block = block.replace("/tmp/", f"{tmp_path}/")
    out = subprocess.run(
        ["bash", "-c", block + 'echo "$MIOPEN_USER_DB_PATH $MIOPEN_CUSTOM_CACHE_DIR"'],
        env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [f"{tmp_path}/miopen-cache-4242"] * 2
    assert (tmp_path / "miopen-cache-4242").is_dir()


def test_frontier_refuses_torchrun_launcher() -> None:
    """[FP] torchrun "can take up to 10 minutes"; "nesting torchrun within srun ... does not help"."""
    line = _refused(
        "--cluster", "frontier", "--nodes", "2", "--launcher", "torchrun", "--account", "p"
    )
    assert line.startswith("hpc: error: launcher: 'torchrun' is refused on frontier: OLCF reports")
    assert "https://docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html" in line
    assert line.endswith("; allowed: auto, srun")


def test_frontier_refusal_is_profile_data_a_user_profile_can_lift(tmp_path: Path) -> None:
    """The refusal is ``launcher.refuse`` in the profile, not code: ``null`` lifts it."""
    (tmp_path / "frontier.yaml").write_text("launcher: {refuse: {torchrun: null}}\n")
    job = build_job(
        None,
        {
            "cluster": "frontier",
            "account": "p",
            "nodes": "2",
            "launcher": "torchrun",
            "command": ["python", "t.py"],
        },
        environ={"HPC_DDP_CLUSTERS": str(tmp_path)},
        cwd=REPO,
    )
    assert job.launcher == "torchrun"


def test_frontier_batch_takes_up_to_9472_nodes() -> None:
    """[FU] bins 1-5 of the batch partition: 1 to 9,472 nodes, 12 hrs from 184 nodes."""
    text = _render("frontier", nodes="9472", walltime="12:00:00")
    assert "--partition=batch" in _directives(text, "#SBATCH")
    line = _refused("--cluster", "frontier", "--nodes", "9473", "--account", "p")
    assert "no queue of frontier takes 9473 nodes" in line


def test_frontier_batch_bins_limit_walltime_by_size() -> None:
    """[FU] Bin 5 1-91 2 h, Bin 4 92-183 6 h, Bins 3-1 184-9,472 12 h."""
    with pytest.raises(UserError, match="allowed: up to 02:00:00"):
        make_job(
            "frontier", nodes="91", walltime="02:00:01", queue="batch", account="p", command=CMD
        )
    assert "--partition=batch" in _directives(
        _render("frontier", nodes="92", walltime="06:00:00"), "#SBATCH"
    )


def test_frontier_debug_qos_renders_q_debug_on_the_default_partition() -> None:
    """[FU] "add ... #SBATCH -q debug to your job script"; batch is the default partition."""
    sbatch = _directives(_render("frontier", nodes="2", queue="debug"), "#SBATCH")
    assert "--qos=debug" in sbatch
    assert not any(d.startswith("--partition") for d in sbatch)


def test_frontier_debug_qos_is_at_most_2_hours() -> None:
    """[FU] "cannot have a walltime greater than 2 hours"."""
    line = _refused(
        "--cluster", "frontier", "--queue", "debug", "--walltime", "02:00:01", "--account", "p"
    )
    assert "exceeds queue debug of frontier for 1 nodes; allowed: up to 02:00:00" in line


def test_frontier_debug_qos_only_by_request() -> None:
    """[FU] "Production work ... using the debug QOS is prohibited": never picked unasked."""
    sbatch = _directives(_render("frontier", nodes="1", walltime="00:30:00"), "#SBATCH")
    assert "--partition=batch" in sbatch and "--qos=debug" not in sbatch


def test_frontier_asks_for_disable_rdzv_get_network() -> None:
    """[FP] batch script "#SBATCH --network=disable_rdzv_get" (the plugin sets alt_read)."""
    assert "--network=disable_rdzv_get" in _directives(_render("frontier"), "#SBATCH")


def test_frontier_nccl_socket_ifname_as_olcf_recommends() -> None:
    """[FP] NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3."""
    assert "export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3" in _render("frontier").splitlines()


def test_frontier_srun_binds_one_gcd_per_task() -> None:
    """[FP] "srun -N2 -n16 -c7 --gpus-per-task=1 --gpu-bind=closest"."""
    launch = _render("frontier", nodes="2").splitlines()[-1]
    assert launch.startswith(
        "srun --kill-on-bad-exit=1 --cpus-per-task=7 --gpus-per-task=1 --gpu-bind=closest "
    )


# --- Perlmutter: https://docs.nersc.gov/ -----------------------------------------------


def test_perlmutter_queue_is_a_qos_on_gpu_nodes() -> None:
    """[NP] "Each queue corresponds to a Quality of Service (QOS)"; -C gpu (unverified)."""
    sbatch = _directives(
        _render("perlmutter", nodes="2", walltime="02:00:00", account="m1_g"), "#SBATCH"
    )
    assert "--qos=regular" in sbatch and "--constraint=gpu" in sbatch


def test_perlmutter_ranks_drive_the_gpu_nearest_their_cores() -> None:
    """[NS] NERSC's tutorial: "Reversing order of GPUs to match default CPU affinities"."""
    text = _render("perlmutter", nodes="2", account="m1_g")
    assert "export CUDA_VISIBLE_DEVICES=3,2,1,0" in text.splitlines()
    assert "export FI_MR_CACHE_MONITOR=userfaultfd" in text.splitlines()


def test_perlmutter_unreadable_facts_are_marked_unverified() -> None:
    """NERSC's QOS table, -C gpu, the _g suffix and NCCL settings could not be read."""
    text = (REPO / "hpc" / "clusters" / "perlmutter.yaml").read_text()
    for fact in ("debug: {", "regular: {", "constraint: gpu", "_g", "NCCL"):
        line = next(ln for ln in text.splitlines() if fact in ln)
        assert "unverified" in line, line


# --- every site ------------------------------------------------------------------------


def _parent_cites(lines: list[str], i: int, cited: re.Pattern[str]) -> bool:
    """True when a key that ``lines[i]`` is nested under cites a page on its own line."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    for line in reversed(lines[:i]):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        level = len(line) - len(line.lstrip())
        if level < indent:
            if cited.search(line):
                return True
            indent = level
            if level == 0:
                return False
    return False


@pytest.mark.parametrize("site", SITES)
def test_every_site_fact_cites_its_source(site: str) -> None:
    """Build rule: each fact line carries a page reference or "unverified: <reason>"."""
    lines = (REPO / "hpc" / "clusters" / f"{site}.yaml").read_text().splitlines()
    cited = re.compile(r"#.*(\[[A-Z]{2}\]|https?://|unverified)")
    wiring = ("description:", "account_env:")  # the project's own text and variables
    uncited = []
    for i, line in enumerate(lines):
        body = line.split("#", 1)[0].strip()
        if not body or body.endswith(":") or body.startswith(wiring) or cited.search(line):
            continue
        # else the comment block right above it (above its list items) must cite,
        # or a parent key's line (a queue cited as a whole)
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("- "):
            j -= 1
        block = []
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j])
            j -= 1
        if any(cited.search(c) for c in block) or _parent_cites(lines, i, cited):
            continue
        uncited.append(line)
    assert not uncited, uncited


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("nodes", ["1", "2", "64", "300"])
def test_sites_render_at_1_2_64_300_nodes(site: str, nodes: str, tmp_path: Path) -> None:
    """Every site renders a valid script at 1, 2, 64 and 300 nodes (default walltime)."""
    text = _render(site, nodes=nodes)
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    first_cmd = next(i for i, ln in enumerate(text.splitlines()) if ln and not ln.startswith("#"))
    assert all(
        i < first_cmd
        for i, ln in enumerate(text.splitlines())
        if ln.startswith(("#PBS", "#SBATCH"))
    )


def test_new_profile_keys_are_still_checked(tmp_path: Path) -> None:
    """User profiles use the same keys; a misspelt one is named with the nearest key."""
    (tmp_path / "site.yaml").write_text(
        "extends: polaris\nqueues: {special: {nodes: 1-2, walltime: '01:00:00', by_requst: true}}\n"
    )
    with pytest.raises(UserError, match="unknown key 'by_requst' .did you mean by_request"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(tmp_path)}, cwd=REPO)
    (tmp_path / "site.yaml").write_text("extends: polaris\nmin_walltme: '00:05:00'\n")
    with pytest.raises(UserError, match="did you mean min_walltime"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(tmp_path)}, cwd=REPO)
    (tmp_path / "site.yaml").write_text("extends: polaris\ndevice_order: [0, 0, 1, 2]\n")
    with pytest.raises(UserError, match="device_order"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(tmp_path)}, cwd=REPO)
    for bad, match in (
        ("device_order: [a, b, c, d]", "device_order"),
        ("shell: 'bash; rm -rf /'", "shell: .* allowed: an absolute path"),
        ("launcher: {refuse: {mpirun: no}}", "refuse: .* allowed: a mapping of launcher"),
        ("env_prepend: {LD_LIBRARY_PATH: ['/a:/b']}", "without ':'"),
        ("queues: {debug: {by_request: maybe}}", "by_request: 'maybe'"),
        ('directives: ["-k doe\\n#PBS -l x"]', "one line of printable text"),
    ):
        (tmp_path / "site.yaml").write_text(f"extends: polaris\n{bad}\n")
        with pytest.raises(UserError, match=match):
            clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(tmp_path)}, cwd=REPO)
