"""Aurora-style launch environment for tests: the PALS ``mpiexec`` shim and a PBS Pro job env.

Why: Aurora jobs run under PBS Pro + HPE PALS, neither of which exists here (no PBS server
package; MPICH hydra rejects PALS flags). The shim in this folder (``mpiexec``, see its
header) accepts the PALS command line and gives each rank the PALS variables;
``pbs_env`` gives the variables a PBS Pro batch job starts with.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

PALS_DIR = Path(__file__).resolve().parent
SHIM = PALS_DIR / "mpiexec"
RANK_WRAPPER = PALS_DIR / "pals-rank-env"

DEFAULT_JOBID = "12345.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"


def local_hostname() -> str:
    """The name the local node appears under in a nodefile (what ``hostname`` prints)."""
    return socket.gethostname()


def pbs_env(
    tmp_path: Path,
    nodes: Sequence[str] | None = None,
    *,
    job_id: str = DEFAULT_JOBID,
    job_name: str = "hpc-ddp-test",
    queue: str = "debug",
    account: str = "hpcddp",
    mpiprocs: int = 1,
    workdir: Path | None = None,
) -> dict[str, str]:
    """Variables PBS Pro sets in a batch job (only these; merge into ``os.environ`` yourself).

    ``nodes`` defaults to this host (real ``hostname``), so the shim/hydra can launch on
    it; other names are written as given (fine for code that only parses the nodefile).

    - PBS_NODEFILE: file, one line per MPI slot (host repeated ``mpiprocs`` times, PBS's
      ``select=N:mpiprocs=M``; Aurora uses 1), in node order. Real: /var/spool/pbs/aux/JOBID.
    - PBS_JOBID: ``<seq>.<server>`` e.g. 12345.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov.
    - PBS_JOBNAME (-N), PBS_QUEUE (queue run in), PBS_O_QUEUE (queue submitted to),
      PBS_ACCOUNT (-A).
    - PBS_O_WORKDIR: cwd of qsub (jobs start in $HOME and must ``cd $PBS_O_WORKDIR``).
    - PBS_O_HOST/PBS_O_HOME/PBS_O_LOGNAME/PBS_O_PATH/PBS_O_SHELL/PBS_O_SYSTEM: the
      submitting side's host, home, user, PATH, shell, OS.
    - PBS_ENVIRONMENT: PBS_BATCH (PBS_INTERACTIVE for ``qsub -I``).
    - PBS_JOBDIR (staging/home dir of the job), PBS_TASKNUM=1, PBS_NODENUM=0,
      PBS_MOMPORT=15003, TMPDIR (per-job dir PBS creates), NCPUS/OMP_NUM_THREADS (from
      the select's ncpus/ompthreads; 1 here).
    """
    node_list = list(nodes) if nodes is not None else [local_hostname()]
    if not node_list:
        raise ValueError("a PBS job has at least one node")
    aux = tmp_path / "pbs-aux"
    aux.mkdir(parents=True, exist_ok=True)
    nodefile = aux / job_id
    nodefile.write_text("".join(f"{n}\n" for n in node_list for _ in range(mpiprocs)))
    job_tmp = tmp_path / f"pbs.{job_id}"
    job_tmp.mkdir(exist_ok=True)
    home = os.environ.get("HOME", str(tmp_path))
    return {
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": job_id,
        "PBS_JOBNAME": job_name,
        "PBS_QUEUE": queue,
        "PBS_O_QUEUE": queue,
        "PBS_ACCOUNT": account,
        "PBS_O_WORKDIR": str(workdir or tmp_path),
        "PBS_O_HOST": local_hostname(),
        "PBS_O_HOME": home,
        "PBS_O_LOGNAME": os.environ.get("USER", "root"),
        "PBS_O_PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PBS_O_SHELL": os.environ.get("SHELL", "/bin/bash"),
        "PBS_O_SYSTEM": os.uname().sysname,
        "PBS_ENVIRONMENT": "PBS_BATCH",
        "PBS_JOBDIR": home,
        "PBS_TASKNUM": "1",
        "PBS_NODENUM": "0",
        "PBS_MOMPORT": "15003",
        "TMPDIR": str(job_tmp),
        "NCPUS": "1",
        "OMP_NUM_THREADS": "1",
    }
