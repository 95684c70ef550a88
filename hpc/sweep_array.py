"""A sweep as job arrays: how wide each array may be (:func:`split` by the scheduler's
array size limit, :func:`throttle` by the queue's), ``--max-parallel``, and which task
an array task is (its index from the scheduler's variable, plus its part's offset).
Re-exported by :mod:`hpc.sweep`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from hpc.errors import UserError


def array_index_vars() -> tuple[str, ...]:
    """Each scheduler's array-task variable (``Scheduler.array_index_var``), from the
    schedulers themselves: a new scheduler module brings its own."""
    from hpc import schedulers

    found = (schedulers.get(name).array_index_var for name in schedulers.names())
    return tuple(var for var in found if var)


"""Where a task finds its array index: SLURM, then PBS Pro/OpenPBS (both 0-based here:
the array is submitted as ``0-(N-1)``)."""


def check_max_parallel(value: Any, n_tasks: int) -> int:
    """How many tasks may run at once (SLURM ``--array=0-N%M``): 1 .. number of tasks."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,6}", text):  # not \d: ١٢٣
        raise UserError(
            f"--max-parallel: {str(value)!r} is not a number; "
            f"allowed: 1 to {n_tasks} (the number of tasks)"
        )
    number = int(text)
    if not 1 <= number <= n_tasks:
        raise UserError(f"--max-parallel: {number}; allowed: 1 to {n_tasks} (the number of tasks)")
    return number


def split(n_tasks: int, limit: int | None) -> list[tuple[int, int]]:
    """``(offset, count)`` of each array a sweep of ``n_tasks`` is submitted as, where one
    array may hold at most ``limit`` tasks (indices ``0 .. limit-1``).

    Why offsets and not index ranges: SLURM's ``MaxArraySize`` caps the array *index*
    ("the maximum job array task index value will be one less than MaxArraySize",
    slurm.conf(5)), so ``--array=1001-2000`` is refused at the default 1001 just as
    ``--array=0-1999`` is. Every part is therefore ``0 .. count-1``, and a task finds its
    place in the sweep as ``offset + SLURM_ARRAY_TASK_ID`` (the offset is the part
    script's first argument, or ``$HPC_SWEEP_OFFSET`` under PBS: the scheduler's
    ``array_offset_word``, read by ``python -m hpc.sweep shell ... --offset``). PBS caps the
    count instead (``max_array_size``, see ``hpc.schedulers.pbs``); the same parts fit.

    No part of one task where the limit allows it: PBS refuses an array of one subjob
    (``qsub -J 0-0``: "qsub: illegal -J value", seen on OpenPBS 23.06; its range parser
    wants start < end, src/lib/Libutil/range.c ``parse_subjob_index``), so a lone last
    task joins the part before it, which gives one up (``(0, 5), (5, 4), (9, 2)`` for 11
    tasks at 5). SLURM takes either.
    """
    if limit is None or n_tasks <= limit:
        return [(0, n_tasks)]
    parts = [(start, min(limit, n_tasks - start)) for start in range(0, n_tasks, limit)]
    if parts[-1][1] == 1 and limit >= 3:
        (before, count), (last, _) = parts[-2], parts[-1]
        parts[-2:] = [(before, count - 1), (last - 1, 2)]
    return parts


def throttle(
    n_tasks: int, max_parallel: int | None, limit: int | None, where: str
) -> tuple[int | None, str | None]:
    """``(max_parallel, note)`` for an array of ``n_tasks`` in a queue that lets at most
    ``limit`` subjobs be queued or running at once (the profile's ``array_limit``).

    Why: PBS accepts an array wider than Polaris' ``prod`` routing limit, and the
    subjobs past it "sit forever without running" (ALCF, "Limits on job arrays"). With
    no ``--max-parallel`` the array is throttled to the limit (``-J 0-14%10``) and the
    note says so once. An explicit ``--max-parallel`` above it is refused in one line
    rather than clamped: the user asked for a number, the site cannot honour it, and a
    refusal before anything is written costs nothing, where a silent clamp would run a
    different sweep than the one asked for (and a clamp with a message is still a
    request overruled).
    """
    if limit is None or n_tasks <= limit:
        return max_parallel, None
    if max_parallel is None:
        return limit, (
            f"hpc: {where} runs at most {limit} subjobs of an array at once; the "
            f"sweep's {n_tasks} tasks run {limit} at a time (%{limit})"
        )
    if max_parallel > limit:
        raise UserError(
            f"--max-parallel: {max_parallel}; {where} runs at most {limit} subjobs "
            f"of an array at once (the others would wait forever); allowed: 1 to "
            f"{limit}"
        )
    return max_parallel, None


def array_index(index: int | str | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The task's array index: ``index`` if given, else the scheduler's variable."""
    env = os.environ if environ is None else environ
    where = "--index"
    if index is None:
        names = array_index_vars()
        for var in names:
            if env.get(var, "").strip():
                index, where = env[var], f"${var}"
                break
        else:
            raise UserError(
                "sweep: no array index; allowed: --index N, or run as an array task "
                f"({' or '.join('$' + v for v in names)} set)"
            )
    text = str(index).strip()
    if isinstance(index, bool) or not re.fullmatch(r"[0-9]{1,6}", text):
        raise UserError(
            f"sweep: {where} {str(index)!r} is not an array index; "
            "allowed: a whole number from 0 to 999999 in ASCII digits"
        )
    return int(text)


def _offset(offset: int | str | None) -> int:
    """``--offset`` as the part's submit command gave it ("" or None: 0, the first or
    only array); ASCII digits only, as :func:`array_index` takes an index."""
    text = "" if offset is None else str(offset).strip()
    if not text:
        return 0
    if isinstance(offset, bool) or not re.fullmatch(r"[0-9]{1,6}", text):
        raise UserError(
            f"sweep: --offset {str(offset)!r} is not an array offset; "
            "allowed: a whole number from 0 to 999999 in ASCII digits"
        )
    return int(text)
