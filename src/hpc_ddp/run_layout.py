"""What a run directory holds, named once for both sides.

``hpc submit`` makes the run directory and exports it to the job as ``$HPC_RUN_DIR``; the
compute side writes into it (metrics, checkpoints, per-rank logs, the supervisor's beats
and evidence) and the login side reads the same files back (``hpc report``, ``hpc logs``,
``hpc status --watch``). A name changed on one side only would leave the other reading
nothing, quietly: so each name is here, and both sides import it.
"""

from __future__ import annotations

from pathlib import Path

#: The run's record: ``hpc submit`` writes it, ``ddp.supervise`` appends its events.
RUN_RECORD = "run.json"
#: The trainer's default ``checkpoint.dir`` (relative: under ``$HPC_RUN_DIR``).
CHECKPOINTS = "checkpoints"
#: ``ddp.loggers``' metrics file: in the run directory, or the checkpoint folder without one.
METRICS = "metrics.jsonl"
#: Per-rank logs (``per_rank_logs``): ``ranks/rank-NNNNN.log``.
RANKS = "ranks"
#: The ranks' heartbeat files under ``ddp.supervise``.
HEARTBEATS = "heartbeats"
#: ``failures/N/``: the evidence of the supervisor's N-th failed attempt.
FAILURES = "failures"


def rank_log_name(rank: int) -> str:
    """``rank-NNNNN.log``: five digits at least, so a listing sorts by rank to 99,999."""
    return f"rank-{rank:05d}.log"


def metrics_paths(run_dir: Path) -> tuple[Path, Path]:
    """Where a run's ``metrics.jsonl`` may be, in the order the trainer prefers them (the
    run directory when ``$HPC_RUN_DIR`` is set, else the checkpoint folder)."""
    return (run_dir / METRICS, run_dir / CHECKPOINTS / METRICS)
