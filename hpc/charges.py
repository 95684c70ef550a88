"""What a job may cost: the request's maximum charge in the site's own unit.

A profile's ``charge:`` block names the site's unit (node-hours) and the page that
defines it; a queue's ``charge_factor`` and the profile's machine ``factor`` multiply
it (NERSC: walltime x nodes x QOS factor x machine charge factor). A factor a profile
leaves out is one nobody could verify from the site's docs, so the line says
"charge factor unverified" instead of printing a guessed number. Profiles without a
``charge:`` block (the generic slurm/pbs/local ones) print nothing: their cost is unknown.
"""

from __future__ import annotations

import math
from typing import Any

from hpc.errors import UserError


def factor(value: Any, where: str) -> float | None:
    """A charge factor from a profile: a finite number >= 0, or None when absent.

    Why strict: a NaN or negative factor would print a nonsensical charge that a user
    might budget by, so it is refused when the profile loads.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise UserError(f"{where}: {value!r} is not allowed; allowed: a finite number >= 0")
    return float(value)


def max_charge_line(cluster: Any, nodes: int, walltime_s: int, queue: str | None) -> str | None:
    """One line: nodes x walltime x factors in the profile's unit, factors and source named."""
    charge = getattr(cluster, "charge", None)
    if not charge:
        return None
    hours = nodes * walltime_s / 3600.0
    q = cluster.queues.get(queue) if queue else None
    qfactor = q.charge_factor if q is not None else None
    mfactor = charge.get("factor")
    unit = charge.get("unit", "node-hours")
    source = charge.get("source", "")
    base = f"{nodes} nodes x {walltime_s / 3600.0:g} h = {hours:g} node-hours"
    if qfactor is None or (charge.get("machine_factor_required") and mfactor is None):
        return (f"hpc: maximum charge: {base}; charge factor unverified "
                f"(queue {queue or 'default'}; see {source})")
    total = hours * qfactor * (mfactor if mfactor is not None else 1.0)
    named = f"queue {queue} factor {qfactor:g}"
    if mfactor is not None:
        named += f" x machine factor {mfactor:g}"
    src = q.charge_source or source
    return f"hpc: maximum charge: {total:g} {unit} ({base} x {named}; source: {src})"
