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
from pathlib import Path
from typing import Any

from hpc.errors import UserError


def factor(value: Any, where: str) -> float | None:
    """A charge factor from a profile: a finite number >= 0, or None when absent.

    Why strict: a NaN or negative factor would print a nonsensical charge that a user
    might budget by, so it is refused when the profile loads.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
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
        return (
            f"hpc: maximum charge: {base}; charge factor unverified "
            f"(queue {queue or 'default'}; see {source})"
        )
    total = hours * qfactor * (mfactor if mfactor is not None else 1.0)
    named = f"queue {queue} factor {qfactor:g}"
    if mfactor is not None:
        named += f" x machine factor {mfactor:g}"
    assert q is not None  # qfactor came from it
    src = q.charge_source or source
    return f"hpc: maximum charge: {total:g} {unit} ({base} x {named}; source: {src})"


# --- what a run used (hpc report) ------------------------------------------------------

_SACCT = ["sacct", "-X", "-n", "-P", "-o", "Start,End,NNodes"]


def _slurm_used(job_id: str) -> tuple[float, int] | str:
    """(seconds, nodes) from sacct's allocation line, or why not."""
    import subprocess
    from datetime import datetime

    lines: list[str] = []
    # the accounting database first; a cluster without one (AccountingStorageType=none)
    # keeps its finished jobs only in the jobcomp file, which `sacct -c` reads
    for extra in ([], ["-c"]):
        try:
            out = subprocess.run(
                [*_SACCT, *extra, "-j", job_id], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"sacct failed: {exc}"
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        if out.returncode == 0 and lines:
            break
    if not lines:
        return "sacct has no record of it"
    start, end, nodes = (lines[0].split("|") + ["", "", ""])[:3]
    try:
        secs = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
        return max(secs, 0.0), int(nodes)
    except ValueError:
        return f"not ended (start {start or '?'}, end {end or '?'})"


def _pbs_used(job_id: str) -> tuple[float, int] | str:
    """(seconds, nodes) from ``qstat -xf``: stime to obittime, Resource_List.nodect."""
    import subprocess
    from datetime import datetime

    try:
        out = subprocess.run(["qstat", "-xf", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"qstat failed: {exc}"
    fields = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep:
            fields[key] = value.strip()
    try:
        fmt = "%a %b %d %H:%M:%S %Y"
        secs = (
            datetime.strptime(fields["obittime"], fmt) - datetime.strptime(fields["stime"], fmt)
        ).total_seconds()
        return max(secs, 0.0), int(fields.get("Resource_List.nodect", "1"))
    except (KeyError, ValueError):
        return "qstat has no start and end time for it"


def used_lines(run_dir: Path) -> list[str]:
    """Per submission: node-hours used (scheduler's start and end); the run's total; the
    node-hours per 1,000 completed steps (steps from metrics.jsonl)."""
    import shutil

    from hpc import runs
    from hpc.report import find_metrics, read_metrics, summarize

    try:
        record = runs.read_record(run_dir)
    except UserError:
        return []
    entries = [*record.get("submissions", []), record]
    sched = str(record.get("scheduler", ""))
    from hpc import schedulers

    try:  # the scheduler says which client keeps a finished job's times (issue 29)
        scheduler = schedulers.get(sched)
    except UserError:
        scheduler = schedulers.Scheduler()  # an unknown name: no client, as for local
    tool = scheduler.usage_client
    if tool is None:
        return [f"node-hours: not known for scheduler {sched or 'local'} (no scheduler times)"]
    if shutil.which(tool) is None:
        return [f"node-hours: {tool} is not on PATH, so the used node-hours cannot be asked"]
    lines, total, counted = [], 0.0, 0
    for entry in entries:
        job_id = str(entry.get("job_id") or "")
        if not job_id:
            continue
        got = scheduler.job_usage(job_id)
        if isinstance(got, str):
            lines.append(f"job {job_id}: node-hours unknown ({got})")
            continue
        secs, nodes = got
        used = secs * nodes / 3600.0
        total += used
        counted += 1
        lines.append(f"job {job_id}: {nodes} nodes x {secs:.0f} s = {used:.6g} node-hours used")
    lines.append(f"total: {total:.6g} node-hours used over {counted} submission(s)")
    steps = None
    for label, path in find_metrics(run_dir):
        summary = summarize(read_metrics(path, label))
        if summary.steps:
            steps = max(steps or 0, summary.steps)
    if steps:
        lines.append(
            f"per 1,000 completed steps: {total * 1000 / steps:.6g} node-hours ({steps} steps)"
        )
    return lines


# --- the project's remaining balance (hpc submit) -------------------------------------

#: ALCF's documented balance query: ``sbank-list-allocations -p PROJECT -r RESOURCE``
#: ("sbank Example Commands", argonne-lcf/user-guides, linked from
#: https://docs.alcf.anl.gov/account-project-management/allocation-management/sbank-allocation-accounting-system);
#: its table's last column is "Available Balance" in node hours.
SBANK = "sbank-list-allocations"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def sbank_balance(project: str, resource: str) -> float | None:
    """The project's available node-hours on ``resource``; None when sbank cannot say."""
    import shutil
    import subprocess

    if shutil.which(SBANK) is None:
        return None
    try:
        out = subprocess.run(
            [SBANK, "-p", project, "-r", resource], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    total, seen = 0.0, False
    for line in out.stdout.splitlines():
        words = line.split()
        if line.startswith("Totals:"):
            break
        # a row: Id Start End Resource Project Jobs Charged Available-Balance
        if len(words) >= 8 and words[3] == resource and words[0].isdigit():
            value = _number(words[-1])
            if value is not None:
                total, seen = total + value, True
    return total if seen else None


#: OLCF's documented balance query on Frontier: ``showusage`` ("Viewing Usage",
#: https://docs.olcf.ornl.gov/systems/frontier_user_guide.html#viewing-usage, read at
#: olcf/olcf-user-docs @2745903): a "Project Totals" table whose rows are
#: ``abc123 | 20000 | 126.3 | 19873.7 | 1560.80`` under the header
#: "Project Allocation Usage Remaining Usage"; the fourth column is what is left.
SHOWUSAGE = "showusage"

#: charge.balance in a profile -> the command it runs (hpc.profiles checks the name).
BALANCE_COMMANDS = {"sbank": SBANK, "showusage": SHOWUSAGE}


def showusage_balance(project: str) -> float | None:
    """The project's remaining allocation from ``showusage``; None when it cannot say.

    The table lists every project of the user, so the project's own row is picked by
    its first column (OLCF project ids are lower case, e.g. ``abc123``; compared without
    case so ``-A ABC123`` finds it).
    """
    import shutil
    import subprocess

    if shutil.which(SHOWUSAGE) is None:
        return None
    try:
        out = subprocess.run([SHOWUSAGE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        # a row: Project | Allocation | Usage | Remaining | (your) Usage
        if len(cells) >= 4 and cells[0].lower() == project.lower():
            return _number(cells[3])
    return None


def balance_warning(
    cluster: Any, account: str | None, nodes: int, walltime_s: int, queue: str | None
) -> str | None:
    """A line when the request's maximum node-hours exceed the project's remaining balance.

    Only where the profile names its site's balance command and that command is on PATH;
    otherwise nothing (no balance known is not a problem worth a line).
    """
    charge = getattr(cluster, "charge", None) or {}
    kind = charge.get("balance")
    if kind not in BALANCE_COMMANDS or not account:
        return None
    resource = getattr(cluster, "system", None) or cluster.name
    balance = sbank_balance(account, resource) if kind == "sbank" else showusage_balance(account)
    if balance is None:
        return None
    q = cluster.queues.get(queue) if queue else None
    factor = q.charge_factor if q is not None and q.charge_factor is not None else 1.0
    factor *= charge.get("factor") or 1.0
    need = nodes * walltime_s / 3600.0 * factor
    if need <= balance:
        return None
    return (
        f"hpc: warning: this request may charge up to {need:g} node-hours, more than "
        f"project {account}'s remaining {balance:g} on {resource} "
        f"({BALANCE_COMMANDS[kind]})"
    )
