"""Chains past the walltime and dependencies between runs (``hpc submit --chain N``,
``--after JOBID[:ok|any|notok]``).

A chain is N segments of the same job, queued at once, each after the one before
(``afterany``: a segment the walltime killed still lets the next one start), so all of
them age in the queue together. Every segment runs in the same run directory, so the
trainer resumes from its checkpoints there (its usual resume). The segment whose
command exits 0 has finished the training: the script then writes :data:`DONE` into
the run directory (a rename, never half a file), and each later segment sees it and
ends at once without launching anything.

Why a marker and not ``scancel``/``qdel`` of the later segments from inside the job:
the marker needs no scheduler client on the compute nodes (not every site has one
there), cannot cancel the wrong job, keeps ``src/ddp`` free of scheduler code, and a
later segment costs the queue only a few seconds of one node. Why "exit 0" and not a
file the trainer writes: the chain works for any command, and a walltime kill, a crash
or a preemption never exit 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from hpc.errors import UserError

#: The run directory's marker that the training finished (see the module docstring).
DONE = "chain.done"
#: Most segments one ``--chain`` queues: past every site's per-user queued-job limit
#: that the profiles know, short of flooding a scheduler by a typo (``--chain 1000``).
MAX_CHAIN = 100
KINDS = ("ok", "any", "notok")


@dataclass(frozen=True)
class After:
    """``--after JOBID[:KIND]``: start only once that job ended (``any``), ended with
    exit 0 (``ok``) or ended otherwise (``notok``)."""

    job_id: str
    kind: str = "ok"


def parse_after(text: str, owns_id: Callable[[str], bool]) -> After:
    """``JOBID[:ok|any|notok]`` checked against the scheduler's id form (``owns_id``):
    one line naming what is allowed, never a string that reaches ``sbatch``/``qsub``
    unchecked."""
    job_id, sep, kind = text.strip().rpartition(":") if ":" in text else (text.strip(), "", "")
    kind = kind if sep else "ok"
    if kind not in KINDS or not job_id or not owns_id(job_id):
        raise UserError(
            f"--after: {text!r} is not allowed; allowed: JOBID[:ok|any|notok] with "
            "JOBID a job id of this cluster's scheduler (e.g. 123, 123_4, "
            "123.server, 123[].server)"
        )
    return After(job_id, kind)


def check_chain(count: int) -> int:
    """``--chain N``: 2..MAX_CHAIN segments (1 is a plain submit)."""
    if not 1 <= count <= MAX_CHAIN:
        raise UserError(f"--chain: {count} is not allowed; allowed: 1 to {MAX_CHAIN} segments")
    return count


_NUMBER = re.compile(r"^[0-9]{1,8}\Z")


def whole(text: str) -> int:
    """``--chain`` as given: ASCII digits only (``-1``, ``٣``, ``1e9`` refused by
    :func:`check_chain`'s line)."""
    if not _NUMBER.match(text.strip()):
        raise UserError(f"--chain: {text!r} is not allowed; allowed: 1 to {MAX_CHAIN} segments")
    return check_chain(int(text))
