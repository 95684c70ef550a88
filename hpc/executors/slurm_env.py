"""What a rank of an ``hpc.executor`` SLURM job runs: submitit's, with a requeue that
survives the requeue's own SIGTERM.

submitit requeues a checkpointed job from inside it: rank 0's USR2 handler runs
``scontrol requeue $SLURM_JOB_ID`` and exits. slurmctld 22.05 (``_slurm_rpc_requeue`` ->
``job_requeue`` in ``src/slurmctld/proc_req.c`` and ``job_mgr.c``) queues the kill of
the job's processes (``deallocate_nodes``) *before* it sends scontrol its reply, and
slurmd's SIGTERM reaches every process of the job, scontrol included. When the kill
wins (a busy node: CI's loaded runs hit it), scontrol dies of SIGTERM although the
requeue happened, submitit's ``check_call`` raises, and ``process_job`` writes an
``"error"`` result, which ``job.result()`` returns at once while the requeued job is
still to run.

Here scontrol starts with SIGTERM ignored (a disposition ``exec`` keeps), so it reads
its reply and exits with the requeue's own status. The rank itself already lets
SIGTERM pass (submitit's ``bypass``) and leaves through ``_exit``, writing no result.
The batch script's srun gets the job's SIGTERM too and answers it with SIGKILL to
every task of the step (``_srun_signal_mgr``, ``src/srun/libsrun/srun_job.c``); when
that comes first, the rank and scontrol die before "Requeued job" is logged, also
without a result, and the requeue stands. Either way ``job.result()`` waits for the
requeued run.

The class keeps submitit's name (``SlurmJobEnvironment`` -> ``slurm``), so jobs read the
same variables and ``SUBMITIT_EXECUTOR=slurm`` still selects it; :func:`main` puts it in
place of submitit's own in this process only.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from submitit.core import logger, plugins
from submitit.slurm import slurm

__all__ = ["SlurmJobEnvironment", "main"]

#: How long ``scontrol requeue`` may take (submitit's own bound).
REQUEUE_TIMEOUT_S = 60


class SlurmJobEnvironment(slurm.SlurmJobEnvironment):
    """submitit's SLURM job environment; ``_requeue`` is immune to the job's SIGTERM."""

    def _requeue(self, countdown: int) -> None:
        jid = self.job_id
        log = logger.get_logger()
        log.info(f"Requeuing job {jid}: scontrol requeue {jid}")
        # SIG_IGN across fork+exec only: the rank's own handler is back before the wait
        # (submitit calls this from its signal handler, in the main thread, where
        # signal.signal works; elsewhere scontrol starts as submitit starts it). A child
        # another thread forks in this window (a DataLoader worker) also starts with
        # SIGTERM ignored; the SIGKILL that follows a job's SIGTERM (srun's, or slurmd's
        # after KillWait) still ends it.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main_thread else None
        try:
            proc = subprocess.Popen(["scontrol", "requeue", jid])
        finally:
            if main_thread:  # None: a handler set from C, which Python cannot put back
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        try:
            code = proc.wait(timeout=REQUEUE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        if code != 0:
            raise subprocess.CalledProcessError(code, proc.args)
        log.info(f"Requeued job {jid} ({countdown} remaining timeouts)")


def _install(env: slurm.SlurmJobEnvironment) -> None:
    """Make ``env`` the one submitit finds under its name, in this process."""
    envs = plugins._get_plugins()[1]
    # in place: the first activated environment wins, and submitit's debug one (active
    # wherever SUBMITIT_DEBUG_JOB_ID leaked in) must stay behind this one, as before
    envs[:] = [env if e.name() == env.name() else e for e in envs]
    plugins.get_job_environments.cache_clear()


def main(argv: list[str] | None = None) -> None:
    """``python -m hpc.executors.slurm_env FOLDER``: one srun task of a submitit job."""
    from submitit.core.submission import process_job

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m hpc.executors.slurm_env FOLDER")
    _install(SlurmJobEnvironment())
    process_job(args[0])


if __name__ == "__main__":
    # Run the importable module's main, so its class is the one installed.
    from hpc.executors.slurm_env import main as _main

    _main()
