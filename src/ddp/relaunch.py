"""How :mod:`ddp.supervise` relaunches a launch line on fewer nodes, and how each
launcher names the node of a rank it saw killed.

Why a module of its own: the supervisor's loop (watch, collect, decide) is the same for
every launcher; what differs is a table of facts per launcher, kept here:

* ``srun`` (SLURM): the nodes are the job's ``$SLURM_JOB_NODELIST``; a relaunch names
  them with ``--nodelist``/``--exclude``, and srun reports a task killed by a signal as
  ``srun: error: NODE: task(s) R: Killed``.
* ``mpiexec`` under PBS (PALS on ALCF's Aurora and Polaris, MPICH hydra elsewhere): the
  nodes are the unique lines of the job's host file (``--hostfile F`` in the line, else
  ``$PBS_NODEFILE``); a relaunch gets a rewritten host file ``RUN/hostfile-N`` without the
  failed nodes, which is ALCF's own recipe for routing around a bad node: "cat
  $PBS_NODEFILE > local.hostfile; # edit local.hostfile to remove problem nodes; mpiexec
  --hostfile local.hostfile" (https://docs.alcf.anl.gov/aurora/running-jobs-aurora/,
  "Working around node failures"). The launchers' reports of a killed rank are below.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.files import write_atomic

# ---- srun -------------------------------------------------------------------------------
# srun's own report of a task killed by a signal: "srun: error: n2: task 1: Killed",
# "srun: error: n2: tasks 2-3: Killed" (an exit by error is "Exited with exit code N")
_SRUN_KILLED = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: (?:Killed|Terminated|.*[Ss]ignal)")

# ---- mpiexec ------------------------------------------------------------------------------
# PALS, as captured from real Aurora and Sunspot jobs by ALCF's ezpz (saforem2/ezpz,
# src/ezpz/failover/patterns/aurora.py and src/ezpz/launch auto-retry): a node whose
# PALS daemon was killed prints "HOST: shepherd died from signal 9"; a rank killed by a
# signal "HOST: rank N died from signal S", where S 11 and 15 are the cascade every other
# rank gets once one has died (ezpz job 8466848: "the signal-11 message named the
# *second*" node), so only SIGKILL names a node. HPE's PALS mpiexec(1) is behind HPE's
# support portal: unverified against it; tests/support/pals reproduces hydra's report.
_PALS_SHEPHERD = re.compile(r"^(?:\d+: )?(\S+): shepherd died from signal 9\b")
_PALS_RANK = re.compile(r"^(?:\d+: )?(\S+): rank \d+ died from signal (\d+)\b")
# MPICH hydra (4.0, as run here): a banner of "=" lines per bad termination:
#   =   PID 11453 RUNNING AT nodeB
#   =   EXIT CODE: 9                   (or "KILLED BY SIGNAL: 9 (Killed)")
_HYDRA_AT = re.compile(r"^=\s+PID \d+ RUNNING AT (\S+)\s*$")
_HYDRA_CODE = re.compile(r"^=\s+(?:EXIT CODE|KILLED BY SIGNAL): (\d+)\b")
_SIGKILL = 9

#: mpiexec options that take a value (PALS's and hydra's spellings); every other word
#: starting with "-" before the program is a flag. Hydra's -env/-genv take two.
_VALUE_OPTS = frozenset(
    {
        "-n",
        "-np",
        "--np",
        "--n",
        "-ppn",
        "--ppn",
        "-d",
        "--depth",
        "-depth",
        "--cpu-bind",
        "-cpu-bind",
        "--mem-bind",
        "-mem-bind",
        "-f",
        "-hostfile",
        "--hostfile",
        "-machinefile",
        "--hosts",
        "-hosts",
        "-host",
        "--env",
        "--envlist",
        "-envlist",
        "-genvlist",
        "-wdir",
        "--wdir",
        "-prepend-pattern",
        "-bind-to",
        "-map-by",
        "-launcher",
        "-bootstrap",
    }
)
_TWO_VALUE_OPTS = frozenset({"-env", "-genv"})
#: the options a relaunch sets itself: counts, ranks per node and hosts
_REPLACED = frozenset(
    {
        "-n",
        "-np",
        "--np",
        "--n",
        "-ppn",
        "--ppn",
        "-f",
        "-hostfile",
        "--hostfile",
        "-machinefile",
        "--hosts",
        "-hosts",
        "-host",
    }
)
_HOSTFILE_LIMIT = 16 << 20  # a host file of 10,624 Aurora nodes is well under 1 MiB


def short(host: str) -> str:
    """A host's first DNS label: PBS_NODEFILE spells Aurora nodes with a domain
    (``x4102c5s2b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov``), ``gethostname()`` and
    PALS's reports may not; the label is what names the node in all of them."""
    return host.split(".", 1)[0]


def launcher_kind(cmd: Sequence[str]) -> str:
    """``srun``, ``mpiexec`` (also ``mpirun``, ``mpiexec.hydra``) or ``other``."""
    name = os.path.basename(cmd[0]) if cmd else ""
    if name == "srun":
        return "srun"
    return "mpiexec" if name.split(".")[0] in ("mpiexec", "mpirun") else "other"


# ---- srun lines ----------------------------------------------------------------------------
def tasks_per_node(cmd: list[str], n_nodes: int) -> int:
    """Tasks per node: the srun line's ``--ntasks-per-node=K``, else the job's
    ``$SLURM_NTASKS_PER_NODE``, else ``$SLURM_NTASKS`` over the nodes, else 1."""
    for a in cmd:
        if a.startswith("--ntasks-per-node="):
            return max(1, int(a.split("=", 1)[1]))
    per = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0].split(",")[0]
    if per.isdigit():
        return max(1, int(per))
    total = os.environ.get("SLURM_NTASKS", "")
    return max(1, int(total) // max(1, n_nodes)) if total.isdigit() else 1


def srun_command(cmd: list[str], nodes: list[str], excluded: list[str], per_node: int) -> list[str]:
    """``cmd`` (an srun line, options in ``--opt=value`` form) on ``nodes`` only:
    ``--nodes``, ``--ntasks`` (``per_node`` each: the world shrinks with the nodes; the
    batch step's ``$SLURM_NTASKS`` would otherwise ask for the old world) and
    ``--exclude=EXCLUDED`` go first; the line's own node and task counts are dropped, and
    so is ``--kill-on-bad-exit``: srun would kill the healthy nodes' tasks too and report
    them "Killed", hiding which node failed (they end through their failed collective)."""
    rest, skip = [], False
    for i, a in enumerate(cmd[1:], 1):
        if skip:
            skip = False
            continue
        if a in ("-N", "--nodes", "-x", "--exclude", "-w", "--nodelist", "-n", "--ntasks"):
            skip = True
            continue
        if a.startswith(
            (
                "--nodes=",
                "--exclude=",
                "--nodelist=",
                "--ntasks=",
                "--ntasks-per-node=",
                "--kill-on-bad-exit",
                "-K",
            )
        ) or (a.startswith(("-N", "-x", "-w", "-n")) and len(a) > 2 and not a.startswith("--")):
            continue
        if not a.startswith("-"):  # the program: srun's options end here
            rest.extend(cmd[i:])
            break
        rest.append(a)
    extra = [f"--exclude={','.join(excluded)}"] if excluded else []
    return [
        cmd[0],
        f"--nodes={len(nodes)}",
        f"--ntasks={per_node * len(nodes)}",
        f"--ntasks-per-node={per_node}",
        *extra,
        *rest,
    ]


# ---- mpiexec lines -------------------------------------------------------------------------
def _options(cmd: Sequence[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """An mpiexec line's options as (name, values) before its program, and the program
    with its arguments (``--`` ends the options and is kept with the program)."""
    opts: list[tuple[str, list[str]]] = []
    i = 1
    while i < len(cmd):
        word = cmd[i]
        if word == "--" or not word.startswith("-"):
            return opts, list(cmd[i:])
        name = word.split("=", 1)[0]
        if "=" in word and name in _VALUE_OPTS:
            opts.append((name, [word.split("=", 1)[1]]))
            i += 1
            continue
        take = 2 if name in _TWO_VALUE_OPTS else 1 if name in _VALUE_OPTS else 0
        opts.append((name, list(cmd[i + 1 : i + 1 + take])))
        i += 1 + take
    return opts, []


def mpiexec_layout(cmd: Sequence[str]) -> tuple[int | None, int | None, str | None]:
    """(ranks, ranks per node, host file) as the line gives them; None where it does not."""
    ranks = per = None
    hostfile = None
    for name, values in _options(cmd)[0]:
        if not values:
            continue
        if name in ("-n", "-np", "--np", "--n") and values[0].isdigit():
            ranks = int(values[0])
        elif name in ("-ppn", "--ppn") and values[0].isdigit():
            per = int(values[0])
        elif name in ("-f", "-hostfile", "--hostfile", "-machinefile"):
            hostfile = values[0]
    return ranks, per, hostfile


def mpiexec_command(cmd: Sequence[str], hostfile: Path, n_nodes: int, per_node: int) -> list[str]:
    """``cmd`` on the nodes of ``hostfile`` only: ``-n`` (``per_node`` each: the world
    shrinks with the nodes), the ranks per node in the line's own spelling (``--ppn``
    for PALS, ``-ppn`` for hydra; both take either) and ``--hostfile`` go first; the
    line's own counts and host options are dropped, everything else is kept in order."""
    opts, program = _options(cmd)
    ppn = next((n for n, _ in opts if n in ("-ppn", "--ppn")), "--ppn")
    kept = [w for n, vals in opts if n not in _REPLACED for w in (n, *vals)]
    return [
        cmd[0],
        "-n",
        str(per_node * n_nodes),
        ppn,
        str(per_node),
        "--hostfile",
        str(hostfile),
        *kept,
        *program,
    ]


def probe_prefix(kind: str, cmd: Sequence[str], node: str, concurrent: Sequence[str]) -> list[str]:
    """The launcher words that start one task on ``node`` beside the running ranks:
    ``srun --overlap`` (a step sharing the allocation's CPUs), or ``mpiexec -n 1 --ppn 1
    --hosts NODE`` plus ``concurrent`` (the site's flags for a second mpiexec in one job:
    ``--no-vni`` on Aurora, "If you see an error like `start failed on x4102c5s2b0n0: No
    VNIs available in internal allocator`, pass `--no-vni` to `mpiexec`",
    https://docs.alcf.anl.gov/aurora/known-issues/)."""
    if kind == "srun":
        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}"]
    return [cmd[0], "-n", "1", "--ppn", "1", "--hosts", node, *concurrent]


def read_hostfile(path: str | os.PathLike[str]) -> list[str]:
    """The unique host names of a host file, in order (one line per node, or per rank:
    PBS repeats a host once per MPI process of its chunk). Raises ValueError with the
    reason for a file that is not a plain, bounded text file of host names."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"host file {p}: not a regular file")
    with open(p, "rb") as fh:
        data = fh.read(_HOSTFILE_LIMIT + 1)
    if len(data) > _HOSTFILE_LIMIT:
        raise ValueError(f"host file {p}: over {_HOSTFILE_LIMIT >> 20} MiB")
    hosts: list[str] = []
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0].split(":", 1)[0]  # hydra's "host:N" form
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", name):
            raise ValueError(f"host file {p}: {name[:60]!r} is not a host name")
        if name not in hosts:
            hosts.append(name)
    if not hosts:
        raise ValueError(f"host file {p}: no host names")
    return hosts


# ---- who was killed ------------------------------------------------------------------------
def killed_nodes(kind: str, lines: Sequence[str]) -> list[str]:
    """The nodes the launcher's own output names as having a rank (or its node daemon)
    killed by SIGKILL, as the launcher spells them; the cascade (SIGTERM/SIGSEGV to the
    other ranks once one died) names none."""
    found: list[str] = []
    if kind == "srun":
        found = [m.group(1) for x in lines if (m := _SRUN_KILLED.match(x))]
    elif kind == "mpiexec":
        at = None
        for x in lines:
            if m := _PALS_SHEPHERD.match(x):
                found.append(m.group(1))
            elif (m := _PALS_RANK.match(x)) and int(m.group(2)) == _SIGKILL:
                found.append(m.group(1))
            elif m := _HYDRA_AT.match(x):
                at = m.group(1)
            elif at and (m := _HYDRA_CODE.match(x)):
                if int(m.group(1)) == _SIGKILL:
                    found.append(at)
                at = None
    return sorted(set(found))


def match_hosts(named: Sequence[str], hosts: Sequence[str]) -> list[str]:
    """``named`` (as a launcher or ``gethostname`` spells them) as the ``hosts`` entries
    they are (matched whole, else by :func:`short`); names no host matches are kept."""
    out = []
    for name in named:
        hit = [h for h in hosts if h == name] or [h for h in hosts if short(h) == short(name)]
        out.append(hit[0] if hit else name)
    return sorted(set(out))


# ---- the job's nodes -----------------------------------------------------------------------
@dataclass
class Nodes:
    """The nodes a launch line runs on, and which of them a relaunch leaves out.

    ``kind`` "other" (a local torchrun, or a launcher outside an allocation) has no node
    list: its relaunch is the same line, and nothing is excluded."""

    kind: str
    every: list[str] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
    per_node: int = 1
    excluded: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cmd: Sequence[str], spares: int, environ: Mapping[str, str]) -> Nodes:
        """The nodes of ``cmd``'s launcher in this job. Raises ValueError (the reason) for
        an unreadable host file or more spares than nodes."""
        kind = launcher_kind(cmd)
        if kind == "srun" and environ.get("SLURM_JOB_NODELIST"):
            from ddp.hostlist import expand_nodelist

            every = expand_nodelist(environ["SLURM_JOB_NODELIST"])
            per = tasks_per_node(list(cmd), len(every))
        elif kind == "mpiexec" and (mpiexec_layout(cmd)[2] or environ.get("PBS_NODEFILE")):
            ranks, per_line, hostfile = mpiexec_layout(cmd)
            every = read_hostfile(hostfile or environ["PBS_NODEFILE"])
            per = per_line or (ranks // len(every) if ranks and ranks % len(every) == 0 else 1)
            if ranks is not None and ranks != per * len(every):  # a relaunch would change
                raise ValueError(  # the world of the very first attempt without a word
                    f"the launch line asks for {ranks} ranks but its host file "
                    f"({hostfile or environ['PBS_NODEFILE']}) has {len(every)} node(s) x "
                    f"{per} per node; allowed: -n equal to nodes x ranks per node"
                )
        else:
            return cls("other")
        if spares >= len(every):
            raise ValueError(f"--spares {spares}: the job has {len(every)} nodes; allowed: fewer")
        return cls(kind, every, every[: len(every) - spares], every[len(every) - spares :], per)

    def command(self, cmd: Sequence[str], hostfile: Path) -> list[str]:
        """The launch line for the next attempt, on the active nodes; for mpiexec it
        writes ``hostfile`` (atomically) with them first."""
        if self.kind == "srun":
            line = srun_command(list(cmd), self.active, self.excluded, self.per_node)
            line.insert(2, f"--nodelist={','.join(self.active)}")
            return line
        if self.kind == "mpiexec":
            write_atomic(hostfile, "".join(f"{h}\n" for h in self.active))
            return mpiexec_command(cmd, hostfile, len(self.active), self.per_node)
        return list(cmd)

    def node_of(self, beat: Mapping[str, object]) -> str:
        """The node a rank's heartbeat ran on, as this list names it: under mpiexec the
        beat's ``node_rank`` (the launcher's node index: PALS_NODEID) indexes the active
        host file, which also tells apart emulated nodes sharing one host."""
        host = str(beat.get("host"))
        if self.kind == "mpiexec":
            index = beat.get("node_rank")
            if isinstance(index, int) and 0 <= index < len(self.active):
                return self.active[index]
            return match_hosts([host], self.active)[0]
        return host

    def leave_out(self, failed: Sequence[str], spares: int) -> bool:
        """Exclude ``failed`` when it is some but not all of the active nodes (a spare
        takes each one's place while spares remain); True when something was excluded."""
        if not failed or not set(failed) < set(self.active):
            return False
        self.active = [n for n in self.active if n not in failed]
        self.excluded += [n for n in failed if n not in self.excluded]
        while self.spares and len(self.active) < len(self.every) - spares:
            self.active.append(self.spares.pop(0))
        return True
