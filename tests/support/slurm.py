"""A real SLURM 22.05 cluster (munge + slurmctld + two slurmd) started on this one machine.

Why: the launcher code must be tested against the real sbatch/srun/scancel behaviour, not a
mock. Settings follow /work/shared/notes/real-schedulers.md (no cgroups, no slurmdbd):
two emulated nodes n1/n2 share this host (``slurmd -N n1`` / ``-N n2`` on their own ports).

Everything is private to one run, so it never clashes with a cluster another engineer
started: its own munge key and socket (``AuthInfo=socket=...``), free TCP ports for
slurmctld and both slurmd, and state/logs under ``$TMPDIR/hpc-ddp-slurm-<uid>/run-<pid>-*``.
A run dir whose owning pytest process is dead is stale: its daemons are killed (by pid
file, and by any process whose command line names that dir) and the dir removed at the
next start. The dir of the current run is kept after teardown, for its logs.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.procs import process_state
from tests.support.polling import wait_state
from tests.support.ports import free_ports

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
#: States a job does not leave by itself (a wait for another state ends there).
ENDED_STATES = (*FINAL_STATES, "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
NODES = ("n1", "n2")
PARTITION = "debug"
URGENT = "urgent"
"""A partition whose jobs preempt (cancel) the debug partition's jobs."""
REQUIRED_EXES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
_DAEMONS = ("slurmd-n1", "slurmd-n2", "slurmctld", "munged")  # stop order


def base_dir() -> Path:
    """Fixed parent of every run dir, so a later run can find stale ones."""
    return Path(tempfile.gettempdir()) / f"hpc-ddp-slurm-{os.getuid()}"


def missing_exes() -> list[str]:
    """Names of the SLURM/munge programs not found (sbin included, as root has it)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in REQUIRED_EXES if shutil.which(name, path=path) is None]


def _exe(name: str) -> str:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which(name, path=path)
    if found is None:
        raise FileNotFoundError(name)
    return found


def _alive(pid: int) -> bool:
    """True for a live process; a zombie (killed, not yet reaped by init) counts as dead."""
    return process_state(pid, None) not in (None, "Z")


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _kill_pids(pids: Sequence[int], timeout: float = 5.0) -> None:
    """SIGTERM, poll until gone or deadline, then SIGKILL the rest."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _cluster_pids(run_dir: Path) -> list[int]:
    """Live processes of the cluster in ``run_dir``: daemons by pid file (checked against the
    command line, for pid reuse), any process whose command line names the dir (a daemon
    that lost its pid file, a job script), and any whose environment has this SLURM_CONF
    (slurmstepd, which slurmd started with it, and the job's tasks)."""
    pids: set[int] = set()
    for name in _DAEMONS:
        with contextlib.suppress(OSError, ValueError):
            pid = int((run_dir / f"{name}.pid").read_text().split()[0])
            if str(run_dir) in _cmdline(pid):
                pids.add(pid)
    conf_entry = f"SLURM_CONF={run_dir / 'slurm.conf'}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        pid = int(proc.name)
        if str(run_dir) in _cmdline(pid) or _environ_has(pid, conf_entry):
            pids.add(pid)
    return sorted(p for p in pids if _alive(p))


#: Clusters this process runs now: a second cluster started beside the session's (a test
#: module's own, with other settings) must not take the first for a stale one, whose
#: owner (this process) is alive but which an earlier crashed session would have left.
_ACTIVE: set[Path] = set()


def cleanup_stale(base: Path | None = None) -> list[Path]:
    """Kill the daemons of run dirs whose owner process is dead; remove those dirs."""
    base = base or base_dir()
    removed = []
    for run_dir in sorted(base.glob("run-*")):
        if run_dir in _ACTIVE:
            continue  # this process's own running cluster
        try:
            owner = int((run_dir / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and owner != os.getpid() and _alive(owner):
            continue  # another live session's cluster
        _kill_pids(_cluster_pids(run_dir))
        shutil.rmtree(run_dir, ignore_errors=True)
        removed.append(run_dir)
    return removed


@dataclass
class SlurmCluster:
    """Handle on a running cluster; every client call uses this cluster's SLURM_CONF."""

    root: Path
    conf: Path
    log_dir: Path
    partition: str = PARTITION
    nodes: tuple[str, ...] = NODES
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def run(
        self, *argv: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster, text output captured."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def output_path(self, job_id: str) -> Path:
        """Where ``submit`` sends the job's stdout/stderr unless told otherwise."""
        return self.log_dir / f"slurm-{job_id}.out"

    def submit(
        self, script: str | os.PathLike[str], *args: str, sbatch_args: Sequence[str] = ()
    ) -> str:
        """``sbatch --parsable`` the script; output goes to ``output_path`` unless -o is given."""
        argv = ["sbatch", "--parsable", f"--partition={self.partition}", *sbatch_args]
        if not any(a in ("-o", "--output") or a.startswith("--output=") for a in sbatch_args):
            argv.append(f"--output={self.log_dir}/slurm-%j.out")
        out = self.run(*argv, str(script), *args).stdout.strip()
        return out.split(";")[0]

    def state(self, job_id: str) -> str:
        """Job state: scontrol (kept MinJobAge=300 s after the end), else sacct -c, else UNKNOWN."""
        res = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        for tok in res.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        res = self.run(
            "sacct", "-c", "-n", "-X", "-P", "-j", str(job_id), "-o", "State", check=False
        )
        lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
        if lines:
            return lines[-1].split()[0]  # "CANCELLED by 0" -> CANCELLED
        return "UNKNOWN"

    def wait(self, job_id: str, states: Sequence[str] = FINAL_STATES, timeout: float = 120) -> str:
        """Poll (no fixed sleep) until the job is in one of ``states``; return that state.

        A job that ends in another state ends the wait at once; every failure quotes
        the job's log (:meth:`job_log`)."""
        return wait_state(
            lambda: self.state(job_id),
            states,
            ENDED_STATES,
            timeout,
            f"job {job_id} in {tuple(states)}",
            log=lambda: self.job_log(job_id),
        )

    def release(self, job_id: str) -> None:
        """Start a job held by its BeginTime (a requeue sets it ``cred_expire`` ahead) now,
        but never within the second of its requeue.

        A requeue revokes the job's credential on its nodes as of the controller's clock
        at the requeue, and slurmd refuses a launch whose credential is from that second
        or before: ``cred->ctime <= j->revoked``, whole seconds, in ``slurm_cred_revoked``
        (src/common/slurm_cred.c); a later one counts as reissued. Released within the
        requeue's second, the job ended FAILED ("Killing non-startable batch JobId=39: Job
        credential revoked", a loaded run). So the release waits for the next second of
        this clock (the controller's: the same machine), after which any requeue already
        seen is in an earlier second: under a second, set by the rule, not a guess (the
        scontrol call and a scheduler pass add their own latency on top)."""
        now = time.time()
        time.sleep(math.floor(now) + 1 - now)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)

    def job_log(self, job_id: str) -> str:
        """The job's output file (``scontrol``'s StdOut, else :meth:`output_path`)."""
        res = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        out = next(
            (tok.split("=", 1)[1] for tok in res.stdout.split() if tok.startswith("StdOut=")),
            str(self.output_path(job_id)),
        )
        path = Path(out)
        return path.read_text(errors="replace") if path.is_file() else ""

    def node_states(self) -> dict[str, str]:
        res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(ln.split()[:2] for ln in res.stdout.splitlines() if len(ln.split()) >= 2)

    def nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n in self.nodes)

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for log in sorted([*self.log_dir.glob("*.log"), *self.log_dir.glob("*.stdout")]):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def write_conf(root: Path, ctld_port: int, node_ports: Sequence[int]) -> Path:
    """slurm.conf with the settings proven in the notes file, all paths under ``root``."""
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    logs = root / "log"
    node_lines = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cpus} RealMemory=2000 State=UNKNOWN"
        for name, port in zip(NODES, node_ports, strict=True)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        f"""# generated by tests/support/slurm.py
ClusterName=hpcddptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={logs}/jobcomp.txt
MpiDefault=none
SchedulerParameters=batch_sched_delay=0
# SLURM's default written out; tests/test_e2e_sweep.py starts a cluster with a smaller one
MaxArraySize={os.environ.get("HPC_TEST_SLURM_MAX_ARRAY_SIZE", "1001")}
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{node_lines}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# Real preemption (tests/test_e2e_requeue.py): a job in {URGENT} (a higher PriorityTier)
# cancels the {PARTITION} jobs whose nodes it needs, as sites with PreemptMode=CANCEL do.
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName={URGENT} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
    )
    return conf


def _spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    """Start a daemon in the foreground as our child: teardown reaps it, and a daemon that
    dies at start is seen at once (poll) instead of as a timeout."""
    log = open(cluster.log_dir / f"{name}.stdout", "wb")
    with log:
        proc = subprocess.Popen(
            argv, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.procs.append(proc)


def _wait_for(what: str, check: Callable[[], bool], cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"exited: {dead}" if dead else f"not after {timeout}s"
            raise RuntimeError(f"SLURM fixture: {what} {why}\n{cluster.log_tail()}")
        time.sleep(0.05)


HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# hpc-ddp test cluster"


def _add_host_names(names: Sequence[str], tag: str = "") -> bool:
    """Make the emulated node names resolve (to 127.0.0.1), as node names do on a real cluster.

    Jobs see the NodeNames (n1, n2) in SLURM_JOB_NODELIST and connect to the first one
    as master; without this they would wait for a host that does not exist. Each run
    adds its own marked line (even when another run's line resolves the names now, since
    that run may end first) and removes it at teardown. Returns True when added.
    """
    try:
        with HOSTS_FILE.open("a", encoding="utf-8") as fh:
            fh.write(f"127.0.0.1 {' '.join(names)} {HOSTS_MARK} {os.getpid()}:{tag}\n")
    except OSError:
        return False  # the names must resolve some other way; jobs say so if they do not
    return True


def _remove_host_names(pid: int | None = None, tag: str = "") -> None:
    """Drop this run's hosts line (``PID:TAG``: one process may run two clusters); with
    ``pid=0`` the lines of runs that died without it."""

    def ours(line: str) -> bool:
        if HOSTS_MARK not in line:
            return False
        owner = line.rstrip().rsplit(" ", 1)[-1]
        if pid == 0:
            owner_pid = owner.split(":", 1)[0]
            return owner_pid.isdigit() and not _alive(int(owner_pid))
        return owner == f"{pid or os.getpid()}:{tag}"

    with contextlib.suppress(OSError):
        lines = HOSTS_FILE.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [ln for ln in lines if not ours(ln)]
        if kept != lines:
            HOSTS_FILE.write_text("".join(kept), encoding="utf-8")


@contextlib.contextmanager
def start_cluster(timeout: float = 30) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld, slurmd n1/n2; wait for idle nodes; tear all down on exit."""
    base = base_dir()
    base.mkdir(mode=0o755, exist_ok=True)
    cleanup_stale(base)
    root = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base))
    root.chmod(0o755)  # munged rejects a socket dir writable by others
    (root / "owner.pid").write_text(str(os.getpid()))
    for sub in ("log", "state", "spool"):
        (root / sub).mkdir()
    ports = free_ports(1 + len(NODES))
    conf = write_conf(root, ports[0], ports[1:])
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_"))]:
        if key != "SLURM_CONF":
            del env[key]  # a test run inside a SLURM job must not leak that job's settings
    cluster = SlurmCluster(root=root, conf=conf, log_dir=root / "log", env=env)
    _ACTIVE.add(root)
    _remove_host_names(pid=0)
    added_hosts = _add_host_names(NODES, root.name)
    key = root / "munge.key"  # own key: the packaged one is owned by munge, refused to root
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    try:
        sock = root / "munge.sock"
        _spawn(
            cluster,
            "munged",
            [
                _exe("munged"),
                "-F",
                f"--socket={sock}",
                f"--pid-file={root}/munged.pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={root}/munged.seed",
                f"--key-file={key}",
            ],
        )
        _wait_for("munged socket", sock.exists, cluster, timeout)
        _spawn(cluster, "slurmctld", [_exe("slurmctld"), "-D", "-f", str(conf)])
        for node in NODES:
            _spawn(cluster, f"slurmd-{node}", [_exe("slurmd"), "-D", "-f", str(conf), "-N", node])
        _wait_for("nodes idle", cluster.nodes_idle, cluster, timeout)
        yield cluster
    finally:
        stop_cluster(cluster)
        _ACTIVE.discard(root)
        if added_hosts:
            _remove_host_names(tag=root.name)


def stop_cluster(cluster: SlurmCluster) -> None:
    """Cancel jobs (so no slurmstepd outlives the daemons), then kill and reap everything."""
    if all(p.poll() is None for p in cluster.procs[:2]):  # munged and slurmctld up
        with contextlib.suppress(Exception):
            cluster.run("scancel", "--partition", cluster.partition, check=False, timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                res = cluster.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.1)
    _kill_pids(_cluster_pids(cluster.root))
    for proc in cluster.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
