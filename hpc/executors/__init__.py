"""Submit Python functions, not scripts: ``hpc.executor`` and ``hpc.distributed``.

``hpc.executor(cluster="aurora", nodes=2, queue="debug", account="proj")`` returns a
submitit executor configured from the same cluster profile, the same job spec
resolution and the same checks as ``hpc render`` / ``hpc submit``: a bad value raises
the same one-line ``UserError`` the CLI prints. ``executor.submit(fn, *args)`` pickles
the call; ``job.result()`` brings the return value back, ``job.cancel()`` cancels, and
``executor.map_array(fn, items)`` submits one job array.

The profile's scheduler builds the executor (``Scheduler.submitit_executor``):

- SLURM profiles -> ``submitit.SlurmExecutor`` (one srun task per rank, each running
  ``hpc.executors.slurm_env``);
- PBS profiles -> ``hpc.executors.pbs.PBSExecutor`` (one mpiexec rank per rank);
- ``local`` -> ``submitit.LocalExecutor`` (processes on this machine);
- any other scheduler -> ``hpc.executors.script.ScriptExecutor`` (its own template,
  submit, status and cancel);
- ``debug`` -> ``submitit.DebugExecutor`` (in this process, for a debugger).

``hpc.distributed(fn)`` runs ``fn`` on every rank with the environment ``ddp.init()``
needs. submitit starts one process per rank (srun tasks, mpiexec ranks, or the local
executor's tasks); on SLURM and PBS ``ddp.env`` reads the launcher's own variables, and
for the local executor, whose variables ddp does not know, the wrapper exports
torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from submitit's
``JobEnvironment``. submitit keeps every rank's return value: ``job.results()`` is the
list by rank, and ``job.task(0).result()`` is rank 0's (``job.result()`` refuses jobs
with several tasks).

This package is the only part of ``hpc`` that imports submitit (``api`` and
``params`` only when called; ``recorded``, ``script``, ``pbs`` and ``pbs_env`` at
module level, imported only by the schedulers' ``submitit_executor`` and submitit's
plugin discovery), and nothing else imports it but ``hpc.__init__``'s lazy
``hpc.executor``/``hpc.distributed``, so ``import hpc`` stays cheap.

Modules: ``api`` (``executor``, run directories), ``params`` (the job as submitit's
own executors' parameters), ``recorded`` (executors that note their job ids in the
run record), ``script`` (the executor for any scheduler), ``ranks``
(``distributed``: every rank's environment), ``slurm_env`` (a SLURM rank's entry: a
requeue that survives the requeue's own SIGTERM), ``pbs`` and ``pbs_env`` (the PBS
plugin).
"""

from __future__ import annotations

from hpc.executors.api import executor
from hpc.executors.ranks import distributed

__all__ = ["distributed", "executor"]
