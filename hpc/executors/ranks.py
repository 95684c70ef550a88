"""``hpc.distributed``: a function run on every rank of a submitit job with ddp's environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


class Distributed:
    """``fn`` run on every rank of a submitit job with the DDP environment in place.

    A top-level class (not a closure) so that pickle finds it by name on the compute
    node. On the local executor it exports torchrun's variables from submitit's
    JobEnvironment; elsewhere the launcher's own variables (SLURM_PROCID, PALS_RANKID,
    ...) are what ``ddp.env`` reads. A process group ``fn`` leaves open is destroyed
    afterwards, so ranks exit cleanly.
    """

    def __init__(self, fn: Callable[..., R]) -> None:
        if not callable(fn):
            raise TypeError(f"hpc.distributed needs a callable, not {type(fn).__name__}")
        self.fn = fn
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"hpc.distributed({self.fn!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        export_rank_env()
        had_group = _process_group_initialized()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if not had_group:
                _destroy_process_group()


class CheckpointableDistributed(Distributed):
    """A ``Distributed`` around a checkpointable function: submitit calls ``checkpoint``
    on preemption or timeout, and the resubmitted call is wrapped again."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self.fn, "__submitit_checkpoint__", None) or self.fn.checkpoint  # type: ignore[attr-defined]
        delayed = inner(*args, **kwargs)
        if delayed is not None and not isinstance(delayed.function, Distributed):
            delayed.function = distributed(delayed.function)
        return delayed


def distributed(fn: Callable[..., R]) -> Callable[..., R]:
    """Wrap ``fn`` (or decorate it) to run on every rank; see :class:`Distributed`."""
    if isinstance(fn, Distributed):
        return fn
    if hasattr(fn, "checkpoint") or hasattr(fn, "__submitit_checkpoint__"):
        return CheckpointableDistributed(fn)
    return Distributed(fn)


def rank_env(env: Any) -> dict[str, str]:
    """torchrun's variables for a rank described by a submitit ``JobEnvironment``.

    The variable set and the port rule are the compute side's own
    (:func:`hpc_ddp.torchrun_vars.torchrun_vars`, :mod:`hpc_ddp.ports`): the port is
    derived from the job id as ``ddp.env`` derives it for SLURM and PBS, so every rank of
    the job computes the same one.
    """
    from hpc_ddp.ports import job_number, port_for
    from hpc_ddp.torchrun_vars import torchrun_vars

    hosts = list(env.hostnames)
    single_node = env.num_nodes <= 1
    return torchrun_vars(
        rank=env.global_rank,
        local_rank=env.local_rank,
        world_size=env.num_tasks,
        master_addr="127.0.0.1" if single_node or not hosts else hosts[0],
        master_port=port_for(job_number(env.job_id)),
        local_world_size=max(1, env.num_tasks // max(1, env.num_nodes)),
        node_rank=env.node,
    )


def export_rank_env() -> dict[str, str]:
    """Export torchrun's variables when no launcher ddp.env knows has set any; returns them.

    Outside a submitit job (a plain call) and under torchrun this does nothing.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return {}
    try:
        import submitit

        env = submitit.JobEnvironment()
    except RuntimeError:  # not inside a submitit job
        return {}
    from submitit.local.local import LocalJobEnvironment

    # Only submitit's local tasks need them: srun and PALS/MPICH mpiexec set variables
    # ddp.env reads itself, the debug executor runs one rank in this process, and the
    # script executor's launcher (or ddp.exec) exports torchrun's already.
    if not isinstance(env, LocalJobEnvironment):
        return {}
    values = {k: v for k, v in rank_env(env).items() if k not in os.environ}
    os.environ.update(values)
    return values


def _process_group_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _destroy_process_group() -> None:
    """Close a process group the function left open (only if torch is loaded already:
    ``hpc`` never imports torch itself, so the loaded module is taken from sys.modules)."""
    if _process_group_initialized():
        sys.modules["torch"].distributed.destroy_process_group()
