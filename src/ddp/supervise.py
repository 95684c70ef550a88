"""``python -m ddp.supervise [options] -- LAUNCH...``: keep a job going inside its allocation.

Why: when one rank dies or hangs, the other ranks wait out the collective timeout (30 min
by default) and the job dies with its remaining hours (issue 30). The supervisor runs the
launcher command (``torchrun ...``, ``srun ...``, ``mpiexec ...``) once per attempt and
watches two things the ranks publish without any device work (:mod:`ddp.heartbeat`):

* the launcher's exit code, and the ranks' output (teed to ``RUN/supervise-attempt-N.log``);
* each rank's heartbeat file; a rank whose last beat is older than ``--hang-timeout-s`` is
  hung (the timeout must exceed the longest step, evaluation or checkpoint save).

On a hang it first collects every rank's Python stack into ``RUN/failures/N/rank-R.txt``
(faulthandler on ``$DDP_STACK_SIGNAL``; a SIGSTOPped rank is continued so it can dump;
``py-spy dump`` too where installed; a dump is copied once whole, and a rank continued
for it stopped again then), then kills the ranks and the launcher and relaunches.
The trainer resumes from the latest checkpoint (its exact, any-world-size resume).

Failures that are not a node's fault end the job at once, without burning restarts: a
config error (``ddp: error:`` / exit 2), a full disk (ENOSPC), the same Python exception
reported by every rank, and a preempted run (exit 75: the scheduler's requeue owns that).

Every failure and restart is one record in ``RUN/run.json`` under ``"supervisor"``
(appended to the record ``hpc submit`` wrote, or a new file), and the log says it.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp.relaunch import Nodes, killed_nodes, match_hosts, probe_prefix

# Re-exported: the run record and one attempt, used below (``from ddp.supervise import
# record`` is how tests and bench scripts write a supervisor event).
from ddp.supervise_attempt import (  # noqa: F401
    _CONFIG_ERROR,
    _NO_SPACE,
    _RANK_FAILED,
    _RUN_JSON_LIMIT,
    PREEMPTED,
    Attempt,
    _clear,
    _fail,
    _record,
    _say,
    _world,
    record,
)

# Re-exported: used below, and tests import them from ``ddp.supervise``.
from ddp.supervise_evidence import (  # noqa: F401
    FR_STEM,
    PROBE_TIMEOUT_S,
    _exited,
    _kill_ranks,
    _node,
    _probe_here,
    _proc_state,
    _rank_state,
    _stop_launcher,
    collect_stacks,
    flight_recorder_env,
    probe_nodes,
    read_beats,
)
from hpc_ddp.run_layout import FAILURES, HEARTBEATS


def _leave_out_unstaged(nodes: Nodes, marks: Path, args: argparse.Namespace, run_dir: Path) -> bool:
    """Leave out the nodes whose unpack of the staged environment left no mark in
    ``marks`` (hpc.stage: one empty file per node that unpacked, named as the scheduler
    names it); False when too few are left to start (a ``stopped`` record says why)."""
    try:
        marked = [p.name for p in marks.iterdir()] if marks.is_dir() else []
    except OSError:
        marked = []
    failed = [n for n in nodes.every if n not in match_hosts(marked, nodes.every)]
    if not failed:
        return True
    nodes.spares = [n for n in nodes.spares if n not in failed]
    left = nodes.leave_out([n for n in failed if n in nodes.active], args.spares)
    if left or not set(failed) & set(nodes.active):
        record(
            run_dir,
            {
                "event": "exclude",
                "attempt": 0,
                "nodes": failed,
                "why": "python.stage: no unpacked environment on these nodes",
                "excluded": nodes.excluded,
                "remaining": nodes.active,
            },
        )
        _say(f"excluding node(s) {','.join(failed)}: their python.stage unpack failed")
    if set(failed) >= set(nodes.active) or len(nodes.active) < args.min_nodes:
        why = (
            f"python.stage: the unpack failed on {','.join(failed)}; "
            f"{len(set(nodes.active) - set(failed))} node(s) left, --min-nodes {args.min_nodes}"
        )
        record(run_dir, {"event": "stopped", "attempt": 0, "why": why})
        _say(f"not starting: {why}")
        return False
    return True


def supervise(args: argparse.Namespace) -> int:
    """The loop: launch, watch, collect the evidence of a failure, decide, relaunch.

    Each attempt: :func:`_watch`, then :func:`_after_hang` or :func:`_after_exit` for the
    evidence, then :func:`_stop_or_relaunch`; the launcher-specific parts are
    :mod:`ddp.relaunch`."""
    run_dir = Path(args.run_dir or os.environ.get("HPC_RUN_DIR") or ".").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    hb_dir = run_dir / HEARTBEATS
    env = _ranks_env(run_dir, hb_dir, args.hang_timeout_s)
    sig = getattr(signal, env["DDP_STACK_SIGNAL"], signal.SIGUSR2)
    try:
        nodes = Nodes.of(args.launch, args.spares, os.environ)
    except ValueError as exc:
        _fail(str(exc))
    concurrent = shlex.split(args.concurrent_args or "")
    prefix = functools.partial(probe_prefix, nodes.kind, args.launch, concurrent=concurrent)
    if nodes.active:
        _say(f"nodes {nodes.active}" + (f", spares {nodes.spares}" if nodes.spares else ""))
    if (
        args.staged
        and nodes.active
        and not _leave_out_unstaged(nodes, Path(args.staged), args, run_dir)
    ):
        return 1
    failures = 0
    for attempt in range(1, args.max_restarts + 2):
        _clear(hb_dir)
        cmd = nodes.command(args.launch, run_dir / f"hostfile-{attempt}")
        _say(f"attempt {attempt}: {' '.join(cmd)}")
        att = Attempt(cmd, env, run_dir / f"supervise-attempt-{attempt}.log")
        hung, seen = _watch(att, hb_dir, args)
        if not hung and att.proc.returncode == 0:
            record(run_dir, {"event": "completed", "attempt": attempt})
            _say(f"attempt {attempt} completed")
            return 0
        failures += 1
        fdir = run_dir / FAILURES / str(failures)
        if hung:
            failure = _after_hang(att, hung, hb_dir, fdir, int(sig), nodes, run_dir, prefix, args)
            if failure is None:  # the ranks went on while their stacks were taken
                note = "a hang was seen, then every rank finished"
                record(run_dir, {"event": "completed", "attempt": attempt, "note": note})
                _say(f"attempt {attempt} completed (after a hang was seen; stacks in {fdir})")
                return 0
        else:
            failure = _after_exit(att, hb_dir, fdir, nodes, run_dir, attempt)
        event = {
            "event": "failure",
            "attempt": attempt,
            "kind": "hang" if hung else "exit",
            "exit_code": failure.rc,
            "why": failure.why,
            "ranks": failure.ranks,
            "nodes": failure.nodes,
            "failures_dir": str(fdir),
        }
        if hung:
            event["seen_t"] = round(seen, 3)
        record(run_dir, event)
        _say(f"attempt {attempt} failed: {failure.why}; nodes {failure.nodes}; evidence in {fdir}")
        code = _stop_or_relaunch(failure, attempt, nodes, run_dir, args)
        if code is not None:
            return code
    return 1


def _ranks_env(run_dir: Path, hb_dir: Path, hang_timeout_s: float) -> dict[str, str]:
    """The launcher's environment: where the ranks beat and checkpoint, NCCL's flight
    recorder and the stack signal (the user's own values win but for the beat folder)."""
    env = dict(os.environ)
    env.setdefault("HPC_RUN_DIR", str(run_dir))  # checkpoints resume from the same folder
    env["DDP_HEARTBEAT_DIR"] = str(hb_dir)
    for key, value in flight_recorder_env(hb_dir).items():  # NCCL's recorder, on demand
        env.setdefault(key, value)
    # beats several times per hang timeout, never more often than every 0.1 s
    env.setdefault("DDP_HEARTBEAT_EVERY_S", f"{max(0.1, min(2.0, hang_timeout_s / 4)):g}")
    env.setdefault("DDP_STACK_SIGNAL", "SIGUSR2")
    return env


@dataclass
class _Failure:
    """What one failed attempt left: the launcher's exit code, the kind of failure
    (``fatal`` ends the job; :meth:`Attempt.classify`), why, and the ranks and nodes
    blamed (the nodes are the ones a relaunch leaves out)."""

    rc: int
    kind: str
    why: str
    ranks: list[int]
    nodes: list[str]


def _watch(att: Attempt, hb_dir: Path, args: argparse.Namespace) -> tuple[list[int], float]:
    """Wait for the launcher's exit or a hung rank: (the hung ranks, when the hang was
    seen: the event's ``seen_t``, before the stacks and the kills), or ([], 0) at exit."""
    while att.proc.poll() is None:
        now, beats = time.time(), read_beats(hb_dir)
        hung = [
            r
            for r, b in beats.items()
            if now - float(b.get("time", now)) > args.hang_timeout_s and not _exited(b)
        ]  # a rank that ended is the launcher's exit to judge
        if hung:
            return hung, time.time()
        try:  # wakes at the launcher's exit, not at the next tick (a crash is seen at once)
            att.proc.wait(timeout=args.poll_s)
        except subprocess.TimeoutExpired:
            pass
    return [], 0.0


def _after_hang(
    att: Attempt,
    hung: list[int],
    hb_dir: Path,
    fdir: Path,
    sig: int,
    nodes: Nodes,
    run_dir: Path,
    prefix: Callable[[str], list[str]],
    args: argparse.Namespace,
) -> _Failure | None:
    """A hang: every rank's stack (the other nodes' through a probe on each), then the
    ranks and the launcher killed; the ranks stopped, gone or unreachable are blamed
    (the hung ones when none is). None when every rank finished meanwhile."""
    beats = read_beats(hb_dir)
    states = collect_stacks(hb_dir, fdir, beats, sig)
    others = (
        sorted({nodes.node_of(beats[r]) for r, s in states.items() if s == "remote"})
        if nodes.active
        else []
    )
    if others:  # the other nodes' ranks: a probe on each (stacks, states, health)
        for node, got in probe_nodes(others, run_dir, fdir, "stacks", prefix).items():
            for r, b in beats.items():
                if nodes.node_of(b) == node:
                    states[r] = (got or {}).get(r, "unreachable" if got is None else "gone")
    if att.proc.poll() == 0:
        return None
    _kill_ranks(beats)
    if others:  # kill before the launcher's SIGTERM: a continued rank would take
        # the trainer's preemption path (a vote with dead peers, then its watchdog)
        alive = [
            n
            for n in others
            if any(
                states.get(r) not in ("unreachable", "gone")
                for r, b in beats.items()
                if nodes.node_of(b) == n
            )
        ]
        probe_nodes(alive, run_dir, fdir, "kill", prefix, timeout_s=30.0)
    rc = _stop_launcher(att.proc)
    att.reader.join(timeout=30)
    culprits = (
        sorted(r for r, s in states.items() if s in ("stopped", "gone", "unreachable")) or hung
    )
    named = sorted({nodes.node_of(beats[r]) for r in culprits if r in beats})
    why = (
        f"hang: no progress for {args.hang_timeout_s:g} s on ranks {hung}; "
        f"stopped/gone ranks {culprits}; states {states}"
    )
    return _Failure(rc, "node", why, culprits, named)


def _after_exit(
    att: Attempt, hb_dir: Path, fdir: Path, nodes: Nodes, run_dir: Path, attempt: int
) -> _Failure:
    """The launcher exited non-zero: its output classifies the failure; the ranks blamed
    are this node's whose process is gone, and the nodes are those the launcher names
    (a signal ended their ranks) where it names any."""
    rc = att.proc.returncode
    kind, why = att.classify(_world(hb_dir))
    fdir.mkdir(parents=True, exist_ok=True)
    beats = read_beats(hb_dir)
    dead = sorted(
        r for r, b in beats.items() if b.get("host") == _node() and _rank_state(b) in (None, "Z")
    )
    named = sorted({nodes.node_of(beats[r]) for r in dead})
    if nodes.active:
        named = match_hosts(killed_nodes(nodes.kind, att.lines), nodes.active)
    shutil.copy(run_dir / f"supervise-attempt-{attempt}.log", fdir / "output.log")
    return _Failure(rc, kind, why, dead, named)


def _stop_or_relaunch(
    failure: _Failure, attempt: int, nodes: Nodes, run_dir: Path, args: argparse.Namespace
) -> int | None:
    """The job's exit code when it stops here (a fatal failure, the restarts used, too
    few nodes left), or None to relaunch without the nodes blamed (while spares or
    ``--min-nodes`` allow); each decision is a record in ``run.json``."""
    code = 128 - failure.rc if failure.rc < 0 else (failure.rc or 1)  # a signal N: 128+N
    why = failure.why
    if failure.kind == "fatal":
        record(run_dir, {"event": "stopped", "attempt": attempt, "why": why})
        _say(f"not restarting: {why}")
        return code
    if attempt > args.max_restarts:
        used = f"max_restarts={args.max_restarts} used"
        record(run_dir, {"event": "stopped", "attempt": attempt, "why": used})
        _say(f"not restarting: {used}")
        return code
    named = failure.nodes
    if nodes.leave_out(named, args.spares):
        record(
            run_dir,
            {
                "event": "exclude",
                "attempt": attempt,
                "nodes": named,
                "excluded": nodes.excluded,
                "remaining": nodes.active,
            },
        )
        _say(f"excluding node(s) {','.join(named)}; relaunching on {','.join(nodes.active)}")
    if nodes.active and len(nodes.active) < args.min_nodes:
        left = f"{len(nodes.active)} node(s) left, below --min-nodes {args.min_nodes}"
        record(run_dir, {"event": "stopped", "attempt": attempt, "why": left})
        _say(f"not restarting: {left}")
        return code
    record(run_dir, {"event": "restart", "attempt": attempt + 1, "after": why})
    _say(
        f"restarting (restart {attempt} of {args.max_restarts}); the trainer resumes "
        "from the latest checkpoint"
    )
    return None


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp.supervise", description=__doc__.split("\n")[0])
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=600.0,
        help="seconds without a heartbeat after which a rank is hung (default 600)",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches at most (default 3)")
    p.add_argument(
        "--min-nodes",
        type=int,
        default=1,
        help="fewest nodes to relaunch on (multi-node launchers; default 1)",
    )
    p.add_argument("--spares", type=int, default=0, help="spare nodes held back (default 0)")
    p.add_argument("--run-dir", help="the run directory (default $HPC_RUN_DIR, else .)")
    p.add_argument(
        "--staged",
        help="a folder of marks, one per node whose unpack of the "
        "staged environment worked (hpc.stage): the others are left out",
    )
    p.add_argument(
        "--concurrent-args",
        default="",
        help="launcher flags for an mpiexec started while the ranks run (the "
        "per-node probe), e.g. --concurrent-args=--no-vni on Aurora",
    )
    p.add_argument("--poll-s", type=float, default=0.5, help=argparse.SUPPRESS)
    p.add_argument("--probe", choices=("stacks", "kill"), help=argparse.SUPPRESS)
    p.add_argument("--failures-dir", help=argparse.SUPPRESS)
    p.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the launcher command")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        raise SystemExit(0 if exc.code == 0 else 2) from None
    if args.launch and args.launch[0] == "--":
        args.launch = args.launch[1:]
    if args.probe:  # the per-node probe (probe_nodes), started by the supervisor
        if not (args.run_dir and args.failures_dir):
            _fail("--probe needs --run-dir and --failures-dir")
        return args
    if not args.launch:
        _fail("no launcher command: put it after --, e.g. -- torchrun --nproc-per-node 2 train.py")
    if not 0 < args.hang_timeout_s <= 86400:
        _fail(f"--hang-timeout-s {args.hang_timeout_s:g}: allowed: seconds in (0, 86400]")
    if not 0 <= args.max_restarts <= 1000:
        _fail(f"--max-restarts {args.max_restarts}: allowed: 0 to 1000")
    if args.min_nodes < 1 or args.spares < 0:
        _fail("--min-nodes must be >= 1 and --spares >= 0")
    if not 0 < args.poll_s <= 60:
        _fail("--poll-s: allowed: seconds in (0, 60]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.probe:
        sig = getattr(signal, os.environ.get("DDP_STACK_SIGNAL", "SIGUSR2"), signal.SIGUSR2)
        return _probe_here(Path(args.run_dir), Path(args.failures_dir), args.probe, int(sig))
    return supervise(args)


if __name__ == "__main__":
    raise SystemExit(main())
