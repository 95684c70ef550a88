"""The launcher table: every way to start a job's ranks, once.

A row says what the rest of ``hpc`` asks of a launcher kind: the function that builds
its command line on each scheduler that accepts it (the schedulers are the keys), and
whether it starts every rank itself, so a plain script needs ``python -m ddp.exec``.
The spec's and the profile's choices, a scheduler's :attr:`~hpc.schedulers.Scheduler.launchers`
and its launch line are read from this table when they are checked or rendered, never
copied at import: a kind added later (a site's own launcher, the toy launcher of
``tests/hpc/test_new_scheduler.py``) is one more row, or one more builder in a row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc import launchers

if TYPE_CHECKING:
    from hpc.job import Job

#: Builds a job's launch: its words, or (shell lines before it, its words) where the
#: launch needs a preamble of its own (one torchrun per node finds its first node).
Builder = Callable[["Job"], list[str] | tuple[list[str], list[str]]]


@dataclass(frozen=True)
class LauncherKind:
    """One way to start a job's ranks: a row of :data:`LAUNCHERS`."""

    name: str
    #: Starts every rank itself, without torchrun's variables (RANK, LOCAL_RANK, ...): a
    #: command that is not ``python -m ddp`` runs under ``python -m ddp.exec`` (wrap: auto).
    per_rank: bool
    #: Scheduler name -> the builder of this kind's launch there: the schedulers that
    #: accept the kind are its keys (the built-ins' builders live in :mod:`hpc.launchers`).
    builders: Mapping[str, Builder]


#: Every launcher kind, once (spec, profiles, job, the schedulers and the Python API read
#: it from here, each time they check).
LAUNCHERS: dict[str, LauncherKind] = {
    kind.name: kind
    for kind in (
        LauncherKind("mpiexec", per_rank=True, builders={"pbs": launchers.mpiexec}),
        LauncherKind("srun", per_rank=True, builders={"slurm": launchers.srun}),
        # one per node (SLURM: through srun) or --standalone here; it exports the variables
        LauncherKind(
            "torchrun",
            per_rank=False,
            builders={"slurm": launchers.torchrun_per_node, "local": launchers.local},
        ),
    )
}
