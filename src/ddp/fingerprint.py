"""What software ran where: the job's environment fingerprint, ``RUN/env-JOBID.json``.

Why: on a many-node job the questions after a failure or a changed result are "what ran
on that node" and "what changed since the last submission". A run directory that keeps,
per submission, the packages, the torch/CUDA/NCCL/oneCCL versions, the loaded modules,
the git commit with its uncommitted diff and the communication variables answers both
(``hpc report RUN`` compares the latest two), and a node whose software differs from
the others is named at start instead of being found by bisection later.

Rank 0 writes the full record. Each node's first rank (``local_rank`` 0) hashes its own
software view, and the hashes travel in one ``all_gather_object`` at start (once per
job, not per step). Variables are kept by prefix; any whose name looks like a secret
(token, secret, password, credential, key) is left out whatever its prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from ddp.heartbeat import node_name  # the scheduler's name for this node, one definition

__all__ = ["node_name", "record", "software", "variables"]

log = logging.getLogger("ddp")

FORMAT = 1
#: Variables recorded: communication, launcher, threading and this project's own.
PREFIXES = (
    "NCCL_",
    "CCL_",
    "FI_",
    "UCX_",
    "CXI_",
    "MPICH_",
    "I_MPI_",
    "PALS_",
    "ZE_",
    "ONEAPI_",
    "CUDA_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "KMP_",
    "SLURM_",
    "PBS_",
    "HPC_",
    "DDP_",
)
#: Those that describe this allocation (ids, node lists, times): kept, never compared.
ALLOCATION = ("SLURM_", "PBS_", "PALS_", "HPC_")
#: A name like a secret is never written, whatever its prefix.
SECRET = re.compile(
    r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE|AUTH|COOKIE|SESSION", re.IGNORECASE
)
DIFF_LIMIT = 256 * 1024  # bytes of `git diff HEAD` kept (a note says when it was cut)
UNTRACKED_LIMIT = 200


def job_id(env: Mapping[str, str] | None = None) -> str:
    """SLURM's id (an array task as ``ARRAY_TASK``), PBS's, else ``local-PID``."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or env.get("PBS_JOBID") or f"local-{os.getpid()}"


def file_name(job: str) -> str:
    """``env-JOBID.json`` with anything but ``[A-Za-z0-9._[]-]`` replaced (a job id is
    the scheduler's text, but the name must stay one file in the run directory)."""
    return "env-" + re.sub(r"[^A-Za-z0-9._\[\]-]", "_", job)[:200] + ".json"


def variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The recorded variables (see :data:`PREFIXES`), never one named like a secret."""
    env = os.environ if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith(PREFIXES) and not SECRET.search(k)}


def packages() -> dict[str, str]:
    """``{name: version}`` of the Python distributions this interpreter sees (what ``pip
    freeze`` lists, read through importlib.metadata: no subprocess), plus a conda
    environment's packages as ``conda:NAME`` from its ``conda-meta`` records."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        # typeshed's PackageMetadata has get() from Python 3.12 only; the object is an
        # email Message, with get(), on every version.
        name = dist.metadata.get("Name") if dist.metadata else None  # type: ignore[attr-defined]
        if name:
            out[re.sub(r"[-_.]+", "-", name).lower()] = str(dist.version)
    prefix = os.environ.get("CONDA_PREFIX")
    meta = Path(prefix) / "conda-meta" if prefix else None
    if meta is not None and meta.is_dir():
        for path in sorted(meta.glob("*.json"))[:5000]:
            try:
                info = json.loads(path.read_text(encoding="utf-8"))
                out[f"conda:{info['name']}"] = str(info["version"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a damaged record there is the environment's business
    return dict(sorted(out.items()))


def _libraries(prefixes: tuple[str, ...]) -> list[str]:
    """Shared libraries named ``PREFIX*`` on LD_LIBRARY_PATH (NCCL net plugins, oneCCL,
    the Level Zero loader): their presence, not their contents."""
    found: set[str] = set()
    for folder in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)[:64]:
        try:
            names = os.listdir(folder) if folder else []
        except OSError:
            continue
        found.update(n for n in names if n.startswith(prefixes) and ".so" in n)
    return sorted(found)


def devices() -> dict[str, Any]:
    """The accelerators and their stacks: CUDA (with NCCL and the driver), XPU (with
    oneCCL and Level Zero), or none."""
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "xpu": getattr(torch.version, "xpu", None),
    }
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            out["nccl"] = None
        try:
            with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
                out["nvidia_driver"] = fh.readline().strip()
        except OSError:
            out["nvidia_driver"] = None
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        out["xpu_devices"] = [xpu.get_device_name(i) for i in range(xpu.device_count())]
    out["libraries"] = _libraries(
        ("libnccl-net", "libnccl.", "libccl", "libze_loader", "libfabric")
    )
    return out


def software() -> dict[str, Any]:
    """What one node runs, the part compared across nodes and submissions."""
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "modules": [m for m in os.environ.get("LOADEDMODULES", "").split(":") if m],
        "devices": devices(),
        "packages": packages(),
    }


def digest(view: dict[str, Any]) -> str:
    """A short hash of a software view (its JSON with sorted keys)."""
    blob = json.dumps(view, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _git(args: list[str], cwd: str, limit: int) -> tuple[str, bool] | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    data = proc.stdout
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def git_state(cwd: str | None = None) -> dict[str, Any] | None:
    """The commit the job runs, its uncommitted diff and untracked files (the code a
    job ran may differ from the code at submit: goodfire-ai/spd#205); None outside git."""
    cwd = cwd or os.getcwd()
    head = _git(["rev-parse", "HEAD"], cwd, 100)
    if head is None:
        return None
    diff = _git(["diff", "HEAD", "--no-color", "--no-ext-diff"], cwd, DIFF_LIMIT) or ("", False)
    untracked = _git(["ls-files", "--others", "--exclude-standard"], cwd, 1 << 20) or ("", False)
    files = untracked[0].splitlines()
    return {
        "commit": head[0].strip(),
        "dirty": bool(diff[0]),
        "diff": diff[0],
        "diff_truncated": diff[1],
        "untracked": files[:UNTRACKED_LIMIT],
        "untracked_more": max(0, len(files) - UNTRACKED_LIMIT),
    }


def record(run_dir: str | Path, ctx: Any) -> Path | None:
    """Every rank calls this once at start; rank 0 writes ``run_dir/env-JOBID.json``.

    Returns the file written (rank 0), else None. A node whose software hash differs
    from the most common one is named in the file and in one warning.
    """
    import ddp

    view = software() if ctx.local_rank == 0 else None
    mine = (node_name(), digest(view) if view is not None else None)
    pairs = ddp.all_gather_object(mine) if ctx.world_size > 1 else [mine]
    if not ctx.is_main:
        return None
    nodes: dict[str, str] = {}
    for node, h in pairs:
        if h is not None:
            nodes.setdefault(node, h)
    counts: dict[str, int] = {}
    for h in nodes.values():
        counts[h] = counts.get(h, 0) + 1
    common = max(counts, key=lambda h: (counts[h], h)) if counts else None
    differ = sorted(n for n, h in nodes.items() if h != common)
    if differ:
        log.warning(
            "environment: node(s) %s run other software than the other %d node(s) "
            "(hash %s); see env-%s.json",
            ", ".join(differ),
            len(nodes) - len(differ),
            common,
            job_id(),
        )
    from ddp.checkpoint import atomic_write_text

    job = job_id()
    data = {
        "format": FORMAT,
        "job_id": job,
        "time": round(time.time(), 3),
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "launcher": ctx.launcher,
        "node": node_name(),
        "nodes": nodes,
        "nodes_differ": differ,
        "software": view if view is not None else software(),
        "env": variables(),
        "allocation_prefixes": list(ALLOCATION),
        "git": git_state(),
    }
    path = Path(run_dir) / file_name(job)
    try:
        atomic_write_text(json.dumps(data, indent=1, default=str) + "\n", path, durable=False)
    except OSError as exc:  # a full or read-only run dir must not stop the training
        log.warning("environment: cannot write %s: %s", path, exc.strerror or exc)
        return None
    log.info("environment: %s (%d node(s), software %s)", path.name, len(nodes), common)
    return path
