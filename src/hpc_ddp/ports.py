"""The rendezvous port rule: which ``MASTER_PORT`` a job's ranks use when none is set.

Every rank of a job must compute the same port without talking to the others, and two
jobs sharing a node should not collide: so the port is derived from the scheduler's job
id, ``PORT_BASE + id % PORT_SPAN`` (20000-28999, below Linux's default ephemeral range
32768-60999, so a client socket's port never takes it), and is torch's own default 29500
when there is no job id. The compute side applies it in ``ddp.env`` (from SLURM_JOB_ID,
PBS_JOBID, ...); the login side's Python API applies it to submitit's local tasks
(``hpc.executors.ranks``) and the rendered scripts use :data:`DEFAULT_PORT` for torchrun's
rendezvous endpoint.
"""

from __future__ import annotations

import re

DEFAULT_PORT = 29500
"""torch's own default ``MASTER_PORT`` (``torchrun --master-port``)."""

PORT_BASE = 20000
PORT_SPAN = 9000


def job_number(job_id: object) -> int | None:
    """The leading digits of a scheduler's job id (``12345.pbs01`` -> 12345, ``678_3`` ->
    678, an array task shares its job's port); None when it starts with none."""
    match = re.match(r"\d+", str(job_id) if job_id is not None else "")
    return int(match.group(0)) if match else None


def port_for(number: int | None) -> int:
    """The port for a job (or process) number; :data:`DEFAULT_PORT` for None."""
    return DEFAULT_PORT if number is None else PORT_BASE + number % PORT_SPAN


def valid_port(port: int) -> bool:
    """Whether ``port`` can be a TCP port to listen on (1-65535)."""
    return 0 < port < 65536
