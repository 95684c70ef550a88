"""No code outside a scheduler's own module branches on a scheduler's or launcher's name.

docs/architecture.md promises that a new scheduler is one module (``hpc/schedulers/``),
a template and a profile, and a new launcher one entry of ``hpc.schedulers.LAUNCHERS``.
That holds only while nothing else asks "is this SLURM?": each such question is a place
a newcomer must find and extend. This test reads every module of ``hpc/`` outside
``hpc/schedulers/`` (where the scheduler modules and the launcher table live) and fails
on each branch on a name: a comparison (``==``, ``!=``, ``in``, ``not in``) with a
scheduler or launcher name, or with a tuple/list/set constant holding one; a dict
literal keyed by such names that is looked up (``{"slurm": ...}.get(x)``, ``[x]``);
and a ``match`` case on one.

Words of a command line (``["srun", "--kill-on-bad-exit=1"]``) or a default value
(``"local" if debug else cluster``) are no branch and are not flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hpc import schedulers

ROOT = Path(__file__).resolve().parents[2]
HPC = ROOT / "hpc"
OWN = HPC / "schedulers"  # the scheduler modules and the launcher table

#: (file, name) -> why that comparison is not a branch on a scheduler or launcher.
ALLOWED: dict[tuple[str, str], str] = {
    ("hpc/core.py", "local"): (
        "`hpc run SPEC`: `spec.cluster != 'local'` asks whether the spec names the *cluster "
        "profile* 'local' (hpc/clusters/local.yaml), the profile hpc run runs a cluster "
        "spec on; a profile's name says nothing of its scheduler (a site may name a "
        "profile anything), and no scheduler is picked by it"
    ),
}


def names() -> set[str]:
    """Every scheduler module's name and every launcher kind."""
    return set(schedulers.names()) | set(schedulers.LAUNCHERS)


def _named(node: ast.AST, wanted: set[str], consts: dict[str, set[str]]) -> set[str]:
    """The names of ``wanted`` that ``node`` is (a string), holds (a literal
    tuple/list/set), or stands for (a name bound to such a literal in the module)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & wanted
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        found: set[str] = set()
        for elt in node.elts:
            found |= _named(elt, wanted, consts)
        return found
    if isinstance(node, (ast.Name, ast.Attribute)):
        key = node.id if isinstance(node, ast.Name) else node.attr
        return consts.get(key, set())
    return set()


def branches(source: str, wanted: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, what) of each branch on one of ``wanted`` in ``source``."""
    tree = ast.parse(source)
    consts: dict[str, set[str]] = {}
    for node in ast.walk(tree):  # NAME = ("slurm", "pbs"): compared later by its name
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            held = (
                _named(node.value, wanted, {})
                if not isinstance(node.value, ast.Constant)
                else set()
            )
            for target in targets:
                if held and isinstance(target, ast.Name):
                    consts[target.id] = held
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                for name in _named(operand, wanted, consts):
                    found.append((node.lineno, name, "comparison"))
        elif isinstance(node, (ast.Subscript, ast.Call)):
            table = (
                node.value
                if isinstance(node, ast.Subscript)
                else (
                    node.func.value
                    if isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    else None
                )
            )
            if isinstance(table, ast.Dict):
                for key in table.keys:
                    if key is not None:
                        for name in _named(key, wanted, {}):
                            found.append((node.lineno, name, "lookup table"))
        elif isinstance(node, ast.match_case):
            for sub in ast.walk(node.pattern):
                if isinstance(sub, ast.MatchValue):
                    for name in _named(sub.value, wanted, {}):
                        found.append((sub.lineno, name, "match case"))
    return found


def test_no_branch_on_a_scheduler_or_launcher_name_outside_its_module() -> None:
    wanted = names()
    assert {"slurm", "pbs", "local", "srun", "mpiexec", "torchrun"} <= wanted
    offenders, allowed_seen = [], set()
    for path in sorted(HPC.rglob("*.py")):
        if OWN in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in branches(path.read_text(encoding="utf-8"), wanted):
            if (rel, name) in ALLOWED:
                allowed_seen.add((rel, name))
                continue
            offenders.append(f"{rel}:{line}: {what} on {name!r}")
    assert not offenders, (
        "branches on a scheduler's or launcher's name outside "
        "hpc/schedulers/ (move each into its module):\n" + "\n".join(offenders)
    )
    assert allowed_seen == set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - allowed_seen}"


def test_the_reader_finds_each_form_of_branch() -> None:
    """The reader itself: each form a branch takes is caught; command words are not."""
    wanted = {"slurm", "pbs", "srun"}
    source = """
KNOWN = ("slurm", "debug")
def f(kind, job, x):
    if kind == "slurm": pass
    if job.launcher != "srun": pass
    if kind in ("pbs", "local"): pass
    if kind in KNOWN: pass
    tool = {"slurm": "sacct", "pbs": "qstat"}.get(kind)
    match kind:
        case "pbs": pass
    words = ["srun", "--label"]
    return "pbs" if x else kind
"""
    got = sorted((line, name) for line, name, _ in branches(source, wanted))
    assert got == [
        (4, "slurm"),
        (5, "srun"),
        (6, "pbs"),
        (7, "slurm"),
        (8, "pbs"),
        (8, "slurm"),
        (10, "pbs"),
    ]
