"""A PBS Pro stand-in for tests: qsub, qstat, qdel, qsig over a spool directory.

Why: no PBS Pro server package exists for this machine (see the notes on real
schedulers), and the ``slurm-wlm-torque`` qsub wrapper neither sets PBS_* variables
nor answers ``qstat -x -f -F json``. The executables next to this file (``qsub``,
``qstat``, ``qdel``, ``qsig``) run this module; put the folder first on PATH.

What real PBS Pro does, and what is reproduced here:

- ``qsub [opts] SCRIPT``: reads ``#PBS`` directives up to the first command line,
  command-line options win over them; prints the job id ``SEQ.SERVER`` (arrays:
  ``SEQ[].SERVER``); the job waits in state Q, then the MoM runs the script with the
  user's shell in ``$HOME`` (not the submit directory: scripts ``cd $PBS_O_WORKDIR``),
  with a login environment plus PBS's variables (PBS_JOBID, PBS_NODEFILE, PBS_O_*,
  PBS_ARRAY_INDEX/PBS_ARRAY_ID, TMPDIR, ...; as ``tests.support.pals.pbs_env``
  gives them), plus ``-v`` variables (``-V``: the whole submit environment).
  Reproduced: options -N -q -A -l (select, walltime, place, filesystems, ...) -o -e
  -j -J -r -v -V -h -S -W -m -M -k -a -p -P; walltime and -J and -N checks; unknown
  queues (PBS_STANDIN_QUEUES) and resources a site hook requires (PBS_STANDIN_REQUIRE,
  e.g. Aurora's ``filesystems``); output files where ``-o``/``-e`` say (a directory:
  ``DIR/JOBID.OU`` / ``.ER``; default ``NAME.oSEQ`` in the submit directory); walltime
  enforced (SIGTERM, kill_delay, SIGKILL; Exit_status -29). Not reproduced: real
  scheduling (every job starts after PBS_STANDIN_QUEUE_DELAY seconds, default 0.2),
  holds (``-h`` stays H for ever: there is no qrls), dependencies, stage-out (files
  are written in place, not copied at the end), several hosts: PBS_NODEFILE names this
  machine once per node of ``select=N`` (MPICH hydra reads PBS_NODEFILE itself and
  would ssh to any other name), so code counting distinct hosts sees one node.
- The job's PATH is the submitter's PATH with ``tests/support/pals`` first, standing
  for the login profile that loads MPI: ``mpiexec`` is the PALS shim (see its header).
  PBS_STANDIN_* variables are passed to the job, as every node reads /etc/pbs.conf,
  so a job can qsub (requeue) into the same stand-in server.
- ``qstat``: ``-f`` full, ``-F json`` (needs -f), ``-x`` finished jobs (history),
  ``-t`` subjobs, plain table otherwise. Unknown ids: ``qstat: Unknown Job Id ID``,
  exit 153; finished ones without -x: ``... Job has finished, use -x or -H ...``,
  exit 35. JSON and text are PBS Pro 2022's format (``-f`` text wraps long values
  with a tab). PBS_STANDIN_NO_JSON=1 makes ``-F`` an invalid option, as on servers
  before PBS Pro 19 and Torque.
- ``qdel ID``: a queued job ends at once (job_state F, substate 91, no Exit_status);
  a running one gets SIGTERM on every process of the job, SIGKILL after
  PBS_STANDIN_KILL_DELAY (default 2 s; real default 10), Exit_status 256+signal.
- ``qsig -s SIG ID``: the signal to every process of the job, as the MoM does on the
  first host. A job's processes are found as a cgroup would find them, also after
  ``setsid`` (hydra's proxies do that): each carries PBS_STANDIN_JOB=<id>.
- Finished jobs keep job_state F (subjobs X), Exit_status (the script's exit code, or
  256+N when killed by signal N), substate 92 finished / 91 deleted / 93 failed.

Server state lives in $PBS_STANDIN_SPOOL (default $TMPDIR/pbs-standin-UID): one JSON
record per job, updated under a lock; PBS_STANDIN_SERVER is the server name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PALS_DIR = REPO / "tests" / "support" / "pals"
PBS_VERSION = "2022.1.1.20220926110806"
NO_VALUE = {"-V", "-h", "-z", "-I"}
WITH_VALUE = {"-A", "-N", "-q", "-l", "-o", "-e", "-j", "-J", "-r", "-v", "-S", "-W", "-m",
              "-M", "-k", "-a", "-p", "-P", "-c", "-u"}
_WALLTIME = re.compile(r"^(?:(?:(\d+):)?(\d+):)?(\d+)$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]{0,235}$")
# PBS error numbers as exit codes (value % 256): unknown job, bad state, finished, unknown queue.
RC_UNKNOWN, RC_BADSTATE, RC_FINISHED, RC_UNKQUE = 153, 168, 35, 170


def server() -> str:
    return os.environ.get("PBS_STANDIN_SERVER", "standin-pbs-0001.hostmgmt.cm.example.org")


def spool() -> Path:
    path = os.environ.get("PBS_STANDIN_SPOOL") or str(
        Path(tempfile.gettempdir()) / f"pbs-standin-{os.getuid()}"
    )
    jobs = Path(path) / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    return Path(path)


def _jobs() -> Path:
    return spool() / "jobs"


def _host() -> str:
    return socket.gethostname()


def _user() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "root"


def _die(message: str, rc: int = 2) -> int:
    sys.stderr.write(message.rstrip("\n") + "\n")
    return rc


# --- job records --------------------------------------------------------------------


def _path(job_id: str) -> Path:
    return _jobs() / f"{job_id}.json"


def load(job_id: str) -> dict[str, Any]:
    return json.loads(_path(job_id).read_text())


def _save(job_id: str, rec: dict[str, Any]) -> None:
    tmp = _path(job_id).with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, _path(job_id))


@contextlib.contextmanager
def locked(job_id: str) -> Iterator[dict[str, Any]]:
    """Read-modify-write one record under an exclusive lock (qdel and the runner race)."""
    with open(_jobs() / f"{job_id}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec = load(job_id)
        yield rec
        _save(job_id, rec)


def all_ids() -> list[str]:
    ids = [p.name[: -len(".json")] for p in _jobs().glob("*.json")]
    return sorted(ids, key=lambda i: (int(re.match(r"\d+", i).group(0)), i))  # type: ignore[union-attr]


def find(ident: str) -> str | None:
    """A job id as PBS accepts it: full, ``SEQ``, ``SEQ.short-server``, ``SEQ[]``, ``SEQ[2]``."""
    if _path(ident).is_file():
        return ident
    match = re.match(r"^(\d+(?:\[\d*\])?)(?:\.(.*))?$", ident)
    if not match:
        return None
    candidate = f"{match.group(1)}.{server()}"
    if _path(candidate).is_file() and (
        match.group(2) is None or server().startswith(match.group(2))
    ):
        return candidate
    return None


def _next_seq() -> int:
    with open(spool() / "seq.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = spool() / "seq"
        seq = int(path.read_text()) + 1 if path.is_file() else 1000 + int.from_bytes(os.urandom(3), "big") % 900000
        path.write_text(str(seq))
        return seq


# --- qsub ---------------------------------------------------------------------------


def parse_walltime(text: str) -> int | None:
    match = _WALLTIME.match(text.strip())
    if not match:
        return None
    h, m, s = (int(g) if g else 0 for g in match.groups())
    return h * 3600 + m * 60 + s


def fmt_walltime(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _options(words: list[str], where: str) -> tuple[list[tuple[str, str]], list[str]]:
    """getopt-style: ``-Nname`` and ``-N name``; returns (options, rest)."""
    opts: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--" or not word.startswith("-") or word == "-":
            return opts, words[i:]
        flag = word[:2]
        if flag in NO_VALUE:
            opts.append((flag, ""))
        elif flag in WITH_VALUE:
            if len(word) > 2:
                opts.append((flag, word[2:]))
            elif i + 1 < len(words):
                i += 1
                opts.append((flag, words[i]))
            else:
                raise ValueError(f"{where}: option requires an argument -- '{flag[1]}'")
        else:
            raise ValueError(f"{where}: invalid option -- '{word[1:2]}'")
        i += 1
    return opts, []


def directives(text: str) -> list[str]:
    """``#PBS`` words up to the first command (PBS stops reading directives there)."""
    words: list[str] = []
    for n, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if n == 0 and stripped.startswith("#!"):
            continue
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#PBS")):
            continue
        if not stripped.startswith("#PBS"):
            break
        words += shlex.split(stripped[4:], comments=False)
    return words


def _select(value: str) -> tuple[int, int]:
    """(nodes, ncpus) of ``N:res=v:...[+N:...]``."""
    nodes = ncpus = 0
    for chunk in value.split("+"):
        parts = chunk.split(":")
        count = int(parts[0]) if parts[0].isdigit() else None
        if count is None or count < 1:
            raise ValueError("qsub: Illegal attribute or resource value Resource_List.select")
        res = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        nodes += count
        ncpus += count * int(res.get("ncpus", res.get("mpiprocs", "1")))
    return nodes, ncpus


def _array(value: str) -> list[int]:
    match = re.match(r"^(\d+)-(\d+)(?::(\d+))?(?:%\d+)?$", value)
    if not match or int(match.group(1)) >= int(match.group(2)):
        raise ValueError("qsub: illegal -J value")
    step = int(match.group(3) or 1)
    return list(range(int(match.group(1)), int(match.group(2)) + 1, step))


def _out_path(value: str | None, default: Path, job_id: str, suffix: str, cwd: Path) -> Path:
    if value is None:
        return default
    path = value.split(":", 1)[1] if re.match(r"^[A-Za-z0-9_.-]+:", value) else value
    p = Path(path) if Path(path).is_absolute() else cwd / path
    if path.endswith("/") or p.is_dir():
        return p / f"{job_id}.{suffix}"
    return p


def qsub(argv: list[str]) -> int:
    cwd = Path.cwd()
    try:
        cli_opts, rest = _options(argv, "qsub")
    except ValueError as exc:
        return _die(f"{exc}\nusage: qsub [-A account] [-J range] [-l resource_list] [-N name] "
                    "[-o path] [-q queue] ... [script]")
    if rest and rest[0] == "--":
        return _die("qsub: the stand-in does not run executables (qsub -- CMD); give a script")
    if len(rest) > 1:
        return _die("qsub: too many arguments")
    if rest:
        script_path = Path(rest[0])
        try:
            text = script_path.read_text()
        except OSError as exc:
            return _die(f"qsub: script file:: {exc.strerror}")
    else:
        text = sys.stdin.read()
    try:
        dir_opts, _ = _options(directives(text), "qsub: directive")
    except ValueError as exc:
        return _die(str(exc))
    opts: dict[str, Any] = {"-l": {}, "-v": []}
    for flag, value in [*dir_opts, *cli_opts]:  # the command line wins
        if flag == "-l":
            for item in value.split(","):
                key, sep, val = item.partition("=")
                if not sep:
                    return _die(f"qsub: illegal -l value {item}")
                opts["-l"][key] = val
        elif flag == "-v":
            opts["-v"] += [v for v in value.split(",") if v]
        else:
            opts[flag] = value
    if "-I" in opts:
        return _die("qsub: interactive jobs are not reproduced by the stand-in")
    res: dict[str, Any] = dict(opts["-l"])
    try:
        nodes, ncpus = _select(res.get("select", "1"))
        array = _array(opts["-J"]) if "-J" in opts else None
    except ValueError as exc:
        return _die(str(exc))
    walltime = None
    if "walltime" in res:
        walltime = parse_walltime(res["walltime"])
        if walltime is None:
            return _die("qsub: Illegal attribute or resource value Resource_List.walltime")
        res["walltime"] = fmt_walltime(walltime)
    queue = opts.get("-q") or os.environ.get("PBS_STANDIN_DEFAULT_QUEUE", "workq")
    known = [q for q in os.environ.get("PBS_STANDIN_QUEUES", "").split(",") if q]
    if known and queue not in known:
        return _die("qsub: Unknown queue", RC_UNKQUE)
    for required in [r for r in os.environ.get("PBS_STANDIN_REQUIRE", "").split(",") if r]:
        if required not in res and not (required == "account" and "-A" in opts):
            return _die(f"qsub: Resource: {required} is required to be set.")
    name = opts.get("-N") or (script_path.name if rest else "STDIN")
    if "-N" in opts and not _NAME.match(name):
        return _die("qsub: illegal -N value")
    name = name[:236]
    if "-j" in opts and opts["-j"] not in ("oe", "eo", "n"):
        return _die("qsub: illegal -j value")

    seq = _next_seq()
    job_id = f"{seq}[].{server()}" if array else f"{seq}.{server()}"
    sc = _jobs() / f"{job_id}.SC"
    sc.write_text(text)
    now = time.time()
    host = _host()
    res["select"] = res.get("select", "1")
    res.update(nodect=nodes, ncpus=ncpus)
    env_vars = {
        "PBS_O_HOME": os.environ.get("HOME", ""), "PBS_O_LANG": os.environ.get("LANG", "C"),
        "PBS_O_LOGNAME": _user(), "PBS_O_PATH": os.environ.get("PATH", ""),
        "PBS_O_MAIL": f"/var/spool/mail/{_user()}",
        "PBS_O_SHELL": os.environ.get("SHELL", "/bin/bash"), "PBS_O_WORKDIR": str(cwd),
        "PBS_O_SYSTEM": os.uname().sysname, "PBS_O_QUEUE": queue, "PBS_O_HOST": host,
    }
    passed = dict(os.environ) if "-V" in opts else {}
    for item in opts["-v"]:
        key, sep, val = item.partition("=")
        if sep:
            passed[key] = val
        elif key in os.environ:
            passed[key] = os.environ[key]
    rec: dict[str, Any] = {
        "Job_Name": name, "Job_Owner": f"{_user()}@{host}", "job_state": "H" if "-h" in opts else "Q",
        "queue": queue, "server": server(), "Checkpoint": "u", "ctime": time.ctime(now),
        "Hold_Types": "u" if "-h" in opts else "n", "Join_Path": opts.get("-j", "n"),
        "Keep_Files": opts.get("-k", "n"), "Mail_Points": opts.get("-m", "a"),
        "mtime": time.ctime(now), "Priority": int(opts.get("-p", 0)), "qtime": time.ctime(now),
        "Rerunable": "False" if opts.get("-r") == "n" else "True", "Resource_List": res,
        "substate": 20 if "-h" in opts else 10,
        "Variable_List": {**env_vars, **{k: v for k, v in passed.items() if not k.startswith("PBS_")}},
        "etime": time.ctime(now), "eligible_time": "00:00:00",
        "Submit_arguments": " ".join(shlex.quote(a) for a in argv),
        "project": opts.get("-P", "_pbs_project_default"), "Submit_Host": host,
        "_standin": {
            "script": str(sc), "workdir": str(cwd), "walltime": walltime, "nodes": nodes,
            "shell": opts.get("-S"), "env": passed, "out": opts.get("-o"), "err": opts.get("-e"),
        },
    }
    if "-A" in opts:
        rec["Account_Name"] = opts["-A"]
    if array is None:
        _set_paths(rec, job_id, seq, None, cwd)
        _save(job_id, rec)
        ids = [job_id]
    else:
        rec.update(array="True", array_indices_submitted=opts["-J"])
        subjobs = []
        for index in array:
            sub_id = f"{seq}[{index}].{server()}"
            sub = json.loads(json.dumps(rec))
            for key in ("array", "array_indices_submitted"):
                sub.pop(key)
            sub.update(array_id=job_id, array_index=index)
            _set_paths(sub, sub_id, seq, index, cwd)
            _save(sub_id, sub)
            subjobs.append(sub_id)
        rec["_standin"]["subjobs"] = subjobs
        _set_paths(rec, job_id, seq, None, cwd)
        _save(job_id, rec)
        ids = subjobs
    if "-z" not in opts:
        print(job_id, flush=True)
    for run_id in ids:
        if rec["job_state"] == "Q":
            with open(_jobs() / f"{run_id}.mom.log", "ab") as log:  # the runner's own errors
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "_run", run_id],
                    env={k: v for k, v in os.environ.items() if k != MARK},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True, close_fds=True,
                )
    return 0


def _set_paths(rec: dict[str, Any], job_id: str, seq: int, index: int | None, cwd: Path) -> None:
    std = rec["_standin"]
    tail = f"{seq}" if index is None else f"{seq}.{index}"
    out = _out_path(std["out"], cwd / f"{rec['Job_Name']}.o{tail}", job_id, "OU", cwd)
    err = _out_path(std["err"], cwd / f"{rec['Job_Name']}.e{tail}", job_id, "ER", cwd)
    std["out_file"], std["err_file"] = str(out), str(err)
    rec["Output_Path"] = f"{_host()}:{out}"
    rec["Error_Path"] = f"{_host()}:{err}"


# --- running a job (the MoM's part) -------------------------------------------------


MARK = "PBS_STANDIN_JOB"


def job_pids(job_id: str) -> list[int]:
    """Every live process of the job, wherever it went.

    A MoM with the cgroups hook (as on Aurora) finds a job's processes by cgroup, also
    those that left the job's session (MPICH hydra's proxies call setsid). Here the
    job's processes carry ``PBS_STANDIN_JOB=<id>`` in their environment instead.
    """
    entry = f"{MARK}={job_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if entry not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(proc.name))
    return pids


def signal_job(job_id: str, sig: int) -> int:
    """Send ``sig`` to every process of the job (what the MoM does for qsig/qdel/walltime)."""
    count = 0
    for pid in job_pids(job_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            count += 1
    return count


def _job_env(job_id: str, rec: dict[str, Any]) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from tests.support.pals import pbs_env

    std = rec["_standin"]
    host = _host()
    nodes = [host] * int(std["nodes"])  # every "node" is this machine (see the docstring)
    aux = spool() / "aux"
    env = {k: os.environ[k] for k in ("HOME", "USER", "LOGNAME", "SHELL", "LANG", "TERM")
           if k in os.environ}
    env["PATH"] = f"{PALS_DIR}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    env.update({k: v for k, v in os.environ.items() if k.startswith("PBS_STANDIN_")})
    env[MARK] = job_id
    env.update(std["env"])
    env.update(pbs_env(aux, nodes, job_id=job_id, job_name=rec["Job_Name"], queue=rec["queue"],
                       account=rec.get("Account_Name", ""), workdir=Path(std["workdir"])))
    if "Account_Name" not in rec:
        env.pop("PBS_ACCOUNT", None)
    if "array_id" in rec:
        env.update(PBS_ARRAY_INDEX=str(rec["array_index"]), PBS_ARRAY_ID=rec["array_id"])
    return env


def run(job_id: str) -> int:
    """The MoM: wait in the queue, run the script in its own session, record the end."""
    time.sleep(float(os.environ.get("PBS_STANDIN_QUEUE_DELAY", "0.2")))
    with locked(job_id) as rec:
        if rec["job_state"] != "Q":
            return 0  # deleted (or held) meanwhile
        rec.update(job_state="R", substate=42, stime=time.ctime(), run_count=1)
    std = rec["_standin"]
    env = _job_env(job_id, rec)
    out_file = Path(std["out_file"])
    out_file.parent.mkdir(parents=True, exist_ok=True)
    join = rec["Join_Path"] == "oe"
    kill_delay = float(os.environ.get("PBS_STANDIN_KILL_DELAY", "2"))
    start = time.time()
    with open(out_file, "ab") as out, open(out_file if join else std["err_file"], "ab") as err:
        proc = subprocess.Popen(
            [std["shell"] or "/bin/bash", std["script"]], cwd=env.get("HOME", "/"), env=env,
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
        )
    vnode = f"({_host()}:ncpus={rec['Resource_List']['ncpus']})"
    with locked(job_id) as rec:
        rec.update(session_id=proc.pid, exec_host=f"{_host()}/0*{rec['Resource_List']['ncpus']}",
                   exec_vnode=vnode, jobdir=env.get("HOME", "/"), mtime=time.ctime(),
                   comment=f"Job run at {rec['stime']} on {vnode}")
    walltime = std["walltime"]
    over_walltime: float | None = None
    deleted: float | None = None
    qdel_flag = _jobs() / f"{job_id}.qdel"
    while True:
        try:
            rc = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        if deleted is None and qdel_flag.exists():
            deleted = now
        if walltime is not None and over_walltime is None and deleted is None and now - start > walltime:
            over_walltime = now
            signal_job(job_id, signal.SIGTERM)
        first = min(t for t in (over_walltime, deleted, float("inf")) if t is not None)
        if now - first > kill_delay:
            signal_job(job_id, signal.SIGKILL)
    signal_job(job_id, signal.SIGKILL)  # what the top shell left behind
    deleted = deleted or (time.time() if qdel_flag.exists() else None)
    elapsed = int(time.time() - start)
    with locked(job_id) as rec:
        code = 256 - rc if rc < 0 else rc
        if deleted:
            substate, how = 91, "and terminated"
        elif over_walltime is not None:
            code, substate, how = -29, 93, "and exceeded resource walltime"
        else:
            substate, how = 92, "and finished"
        rec.update(job_state="X" if "array_id" in rec else "F", substate=substate,
                   Exit_status=code, mtime=time.ctime(), history_timestamp=int(time.time()),
                   comment=f"Job run at {rec['stime']} on {vnode} {how}")
        rec["resources_used"] = {
            "cpupercent": 0, "cput": "00:00:00", "mem": "0kb",
            "ncpus": rec["Resource_List"]["ncpus"], "vmem": "0kb",
            "walltime": fmt_walltime(elapsed),
        }
    return 0


# --- qstat --------------------------------------------------------------------------


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "-"
    out, start, prev = [], indices[0], indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def view(job_id: str) -> dict[str, Any]:
    """The record as qstat shows it; an array's state comes from its subjobs."""
    rec = load(job_id)
    subs = rec.get("_standin", {}).get("subjobs")
    if subs:
        states = [load(s) for s in subs]
        queued = [s["array_index"] for s in states if s["job_state"] in ("Q", "H")]
        running = sum(s["job_state"] == "R" for s in states)
        done = [s for s in states if s["job_state"] in ("X", "F")]
        rec["array_state_count"] = (f"Queued:{len(queued)} Running:{running} Exiting:0 "
                                    f"Expired:{len(done)} ")
        rec["array_indices_remaining"] = _ranges(queued)
        if len(done) == len(states):
            rec["job_state"], rec["substate"] = "F", 92
            rec["Exit_status"] = 0 if all(s.get("Exit_status") == 0 for s in done) else 1
        elif running or done:
            rec["job_state"], rec["substate"] = "B", 42
    return {k: v for k, v in rec.items() if not k.startswith("_")}


def _finished(attrs: dict[str, Any]) -> bool:
    return attrs["job_state"] in ("F", "X")


def _text(job_id: str, attrs: dict[str, Any]) -> str:
    """``qstat -f`` layout: ``    key = value``, dotted sub-keys, long lines wrapped with a tab."""
    lines = [f"Job Id: {job_id}"]
    for key, value in attrs.items():
        if key == "Variable_List":
            items = [(key, ",".join(f"{k}={v}" for k, v in value.items()))]
        elif isinstance(value, dict):
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            items = [(key, value)]
        for k, v in items:
            line = f"    {k} = {v}"
            first, rest = line[:79], line[79:]
            lines.append(first)
            while rest:
                lines.append("\t" + rest[:71])
                rest = rest[71:]
    return "\n".join(lines) + "\n"


def _plain(rows: list[tuple[str, dict[str, Any]]]) -> str:
    out = ["Job id            Name             User              Time Use S Queue",
           "----------------  ---------------- ----------------  -------- - -----"]
    for job_id, a in rows:
        shown = job_id if len(job_id) <= 16 else job_id[:15] + "*"
        name = a["Job_Name"] if len(a["Job_Name"]) <= 16 else a["Job_Name"][:15] + "*"
        user = a["Job_Owner"].split("@")[0][:16]
        used = a.get("resources_used", {}).get("cput", "00:00:00")
        out.append(f"{shown:<16}  {name:<16} {user:<16}  {used:>8} {a['job_state']} {a['queue']}")
    return "\n".join(out) + "\n"


def qstat(argv: list[str]) -> int:
    flags: set[str] = set()
    fmt = None
    ids: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-F":
            if os.environ.get("PBS_STANDIN_NO_JSON"):
                return _die("qstat: invalid option -- 'F'\nusage: qstat [-f] [-x] [-t] [job_id ...]")
            if i + 1 >= len(argv):
                return _die("qstat: option requires an argument -- 'F'")
            fmt = argv[i + 1]
            i += 2
            continue
        if word.startswith("-") and len(word) > 1:
            for letter in word[1:]:
                if letter not in "fxtwJH":
                    return _die(f"qstat: invalid option -- '{letter}'\n"
                                "usage: qstat [-f] [-F json|dsv] [-x] [-t] [job_id ...]")
                flags.add(letter)
        else:
            ids.append(word)
        i += 1
    if fmt is not None and ("f" not in flags or fmt not in ("json", "dsv")):
        return _die("qstat: -F requires -f and one of json, dsv")
    rc = 0
    rows: list[tuple[str, dict[str, Any]]] = []
    wanted: list[str] = []
    if ids:
        for ident in ids:
            job_id = find(ident)
            if job_id is None:
                sys.stderr.write(f"qstat: Unknown Job Id {ident}\n")
                rc = RC_UNKNOWN
                continue
            wanted.append(job_id)
    else:
        wanted = [j for j in all_ids() if "[" not in j or "[]" in j]
    for job_id in wanted:
        attrs = view(job_id)
        if _finished(attrs) and "x" not in flags and "H" not in flags:
            if ids:
                sys.stderr.write(f"qstat: {job_id} Job has finished, use -x or -H to obtain "
                                 "historical job information\n")
                rc = RC_FINISHED
            continue
        rows.append((job_id, attrs))
        if "t" in flags:
            for sub in load(job_id).get("_standin", {}).get("subjobs", []):
                sub_attrs = view(sub)
                if not _finished(sub_attrs) or "x" in flags:
                    rows.append((sub, sub_attrs))
    if fmt == "json":
        doc = {"timestamp": int(time.time()), "pbs_version": PBS_VERSION,
               "pbs_server": server(), "Jobs": dict(rows)}
        sys.stdout.write(json.dumps(doc, indent=4, separators=(",", ":")) + "\n")
    elif fmt == "dsv":
        for job_id, attrs in rows:
            sys.stdout.write("|".join([f"Job Id={job_id}", *(f"{k}={v}" for k, v in attrs.items())]) + "\n")
    elif "f" in flags:
        sys.stdout.write("\n".join(_text(j, a) for j, a in rows))
    elif rows:
        sys.stdout.write(_plain(rows))
    return rc


# --- qdel, qsig ---------------------------------------------------------------------


def qdel(argv: list[str]) -> int:
    ids = [a for a in argv if not a.startswith("-")]
    if not ids:
        return _die("usage: qdel [-W force|suppress_email=N] [-x] job_identifier...")
    rc = 0
    for ident in ids:
        job_id = find(ident)
        if job_id is None:
            rc = _die(f"qdel: Unknown Job Id {ident}", RC_UNKNOWN)
            continue
        for target in load(job_id).get("_standin", {}).get("subjobs") or [job_id]:
            with locked(target) as rec:
                state = rec["job_state"]
                if state in ("F", "X"):
                    if target == job_id:
                        rc = _die(f"qdel: Job {job_id} has finished", RC_FINISHED)
                    continue
                if state in ("Q", "H", "W"):
                    rec.update(job_state="X" if "array_id" in rec else "F", substate=91,
                               mtime=time.ctime(), history_timestamp=int(time.time()),
                               comment="Job deleted before it ran")
                    continue
                (_jobs() / f"{target}.qdel").write_text(str(time.time()))
            signal_job(target, signal.SIGTERM)
    return rc


def qsig(argv: list[str]) -> int:
    try:
        opts, ids = _options_qsig(argv)
    except ValueError as exc:
        return _die(str(exc))
    name = opts.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    sig = getattr(signal, name, None) if not name[3:].isdigit() else int(name[3:])
    if sig is None:
        return _die(f"qsig: Unknown signal {opts}")
    rc = 0
    for ident in ids:
        job_id = find(ident)
        if job_id is None:
            rc = _die(f"qsig: Unknown Job Id {ident}", RC_UNKNOWN)
            continue
        if load(job_id)["job_state"] != "R":
            rc = _die(f"qsig: Request invalid for state of job {job_id}", RC_BADSTATE)
            continue
        signal_job(job_id, int(sig))
    return rc


def _options_qsig(argv: list[str]) -> tuple[str, list[str]]:
    sig = "SIGTERM"
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "-s" and i + 1 < len(argv):
            sig = argv[i + 1]
            i += 2
        elif argv[i].startswith("-s") and len(argv[i]) > 2:
            sig = argv[i][2:]
            i += 1
        elif argv[i].startswith("-"):
            raise ValueError(f"qsig: invalid option -- '{argv[i][1:2]}'")
        else:
            rest.append(argv[i])
            i += 1
    if not rest:
        raise ValueError("usage: qsig [-s signal] job_identifier...")
    return sig, rest


# --- for test fixtures --------------------------------------------------------------


def shutdown() -> None:
    """Kill every running job of this spool (test teardown) and mark it deleted."""
    if not _jobs().is_dir():
        return
    for job_id in all_ids():
        with contextlib.suppress(OSError, ValueError, KeyError):
            rec = load(job_id)
            if rec["job_state"] in ("Q", "H", "R"):
                (_jobs() / f"{job_id}.qdel").write_text(str(time.time()))
                signal_job(job_id, signal.SIGKILL)
                if rec["job_state"] != "R":
                    with locked(job_id) as r:
                        r.update(job_state="F", substate=91)


COMMANDS = {"qsub": qsub, "qstat": qstat, "qdel": qdel, "qsig": qsig}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "_run":
        return run(argv[1])
    if not argv or argv[0] not in COMMANDS:
        return _die(f"pbs_standin: first argument must be one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
