"""``hpc logs RUN_DIR|JOB_ID [-f]``: find a run's job log and print it, following it as it grows.

Each scheduler names the log itself, from the directives that ``hpc submit`` renders
into the run directory; the names are kept as data in :data:`LOG_PATTERNS` so that a new
template (a job array's ``%A_%a``) is one line here:

- SLURM: ``--output=RUN_DIR/%x-%j.out`` -> ``NAME-JOBID.out``; an array's task logs are
  ``NAME-ARRAYID_TASK.out`` (``%x-%A_%a.out``: ``%j`` of a task is an unrelated id);
- PBS: ``-o RUN_DIR/`` (a folder) -> ``JOBID.OU`` (``123.server.OU``; array subjobs
  ``123[4].server.OU``); without ``-o`` PBS writes ``NAME.oJOBNUM`` in the submit folder;
- local: ``output.log``, then ``output-2.log`` ... for each ``--resume`` (no id in the
  name: matched to the run record's submissions in order).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from hpc.errors import UserError


class LogPattern(NamedTuple):
    """How one scheduler names a job's log file in the run directory."""

    scheduler: str
    regex: str
    """Matches the whole file name; group ``job`` is the job id as it appears there."""
    template: str
    """The name a job's log will get (``{name}``: the job name, ``{job}``: its id), so a
    pending job's log can be waited for before the scheduler creates it."""


LOG_PATTERNS: tuple[LogPattern, ...] = (
    LogPattern("slurm", r"(?P<name>.+)-(?P<job>\d+(?:_\d+)?)\.out", "{name}-{job}.out"),
    LogPattern("pbs", r"(?P<job>\d+(?:\[\d*\])?(?:\.[A-Za-z0-9_.-]+?)?)\.OU", "{job}.OU"),
    LogPattern("pbs", r"(?P<name>.+)\.o(?P<job>\d+(?:\.\d+)?)", "{name}.o{job}"),
    LogPattern("local", r"output(?:-(?P<seq>\d+))?\.log", "output{seq}.log"),
)

# A job id as a key: (job number, array task or None). SLURM 12345 / 12345_3, PBS
# 123.server / 123[3].server / 123[].server (the array itself) / 123[3].
_JOB_ID = r"(\d+)(?:_(\d+)|\[(\d*)\])?(?:\.[A-Za-z0-9_.-]+)?\Z"


class _Log(NamedTuple):
    path: Path
    scheduler: str
    key: tuple[str, str | None] | None  # None for local logs (no id in the name)
    seq: int  # local: 1 for output.log, N for output-N.log


def job_key(job: str) -> tuple[str, str | None] | None:
    """``(number, task)`` for a SLURM or PBS job id; None for anything else."""
    match = re.match(_JOB_ID, job.strip())
    if not match:
        return None
    task = match.group(2) if match.group(2) is not None else match.group(3)
    return match.group(1), (task or None)


def _scan(run_dir: Path) -> list[_Log]:
    found = []
    try:
        entries = sorted(run_dir.iterdir())
    except OSError as exc:
        raise UserError(f"logs: cannot list {str(run_dir)!r}: {exc.strerror}") from None
    for path in entries:
        for pat in LOG_PATTERNS:
            match = re.fullmatch(pat.regex, path.name)
            if match is None or not path.is_file():
                continue
            if pat.scheduler == "local":
                found.append(_Log(path, "local", None, int(match.group("seq") or 1)))
            else:
                found.append(_Log(path, pat.scheduler, job_key(match.group("job")), 0))
            break
    return found


def _submissions(run_dir: Path) -> list[dict[str, Any]]:
    """The run's submissions, oldest first ([] when there is no record)."""
    from hpc import runs

    if not (run_dir / runs.RECORD).is_file():
        return []
    record = runs.read_record(run_dir)
    earlier = record.get("submissions", [])
    subs = [s for s in earlier if isinstance(s, dict)] if isinstance(earlier, list) else []
    return [*subs, record]


def _latest(logs: list[_Log]) -> Path:
    """The most recently written; ties (same mtime) go to the higher array task."""

    def order(log: _Log) -> tuple[float, int]:
        try:
            mtime = log.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        task = log.key[1] if log.key else None
        return mtime, int(task) if task else log.seq

    return max(logs, key=order).path


def find_log(run_dir: Path, job: str | None = None) -> Path:
    """The log of ``job`` (a job id of this run, an array task's ``12345_3`` or
    ``123[3].server``, or a local ``local-PID-START``), else of the run's latest job.

    For an array without a task the most recently written task log is returned. A
    job that has not started yet has no log: the path its scheduler will write is
    returned (from :data:`LOG_PATTERNS` and the run record) so that :func:`follow` can
    wait for it. Anything not found is one line naming what the run has.
    """
    if not run_dir.is_dir():
        raise UserError(f"logs: {str(run_dir)!r} is not a directory; allowed: a run directory")
    logs = _scan(run_dir)
    subs = _submissions(run_dir)
    if job is not None and not job.strip():
        raise UserError("logs: empty job id; allowed: a job id of this run, or none for the latest")
    wanted = job.strip() if job else None
    if wanted is None and subs and subs[-1].get("job_id"):
        wanted = str(subs[-1]["job_id"])
    if wanted is None:  # no record (a folder of logs): the newest log there
        if not logs:
            raise UserError(f"logs: no log file in {str(run_dir)!r} and no run record naming a job")
        return _latest(logs)

    if wanted.startswith("local-"):
        local = [s for s in subs if s.get("scheduler") == "local"]
        seq = next((i for i, s in enumerate(local, 1) if s.get("job_id") == wanted), None)
        if seq is None:
            raise UserError(f"logs: {wanted!r} is not a job of {str(run_dir)!r}; "
                            f"its jobs: {_ids(subs)}")  # fmt: skip
        return run_dir / ("output.log" if seq == 1 else f"output-{seq}.log")

    key = job_key(wanted)
    if key is None:
        raise UserError(f"logs: {wanted!r} is not a job id; allowed: e.g. 12345, 12345_3, "
                        "123.server, 123[3].server")  # fmt: skip
    matches = [g for g in logs if g.key and g.key[0] == key[0] and key[1] in (None, g.key[1])]
    if matches:
        return _latest(matches)
    sub = next((s for s in reversed(subs) if (job_key(str(s.get("job_id") or "")) or ("",))[0]
                == key[0]), None)  # fmt: skip
    if sub is None:
        if subs:
            raise UserError(f"logs: job {wanted!r} is not a job of {str(run_dir)!r}; "
                            f"its jobs: {_ids(subs)}")  # fmt: skip
        raise UserError(f"logs: no log of job {wanted!r} in {str(run_dir)!r}")
    return run_dir / _expected_name(sub, key, is_array=(run_dir / "sweep.json").is_file())


def _expected_name(sub: dict[str, Any], key: tuple[str, str | None], is_array: bool) -> str:
    """The log name a submitted job's scheduler will write (it has not started yet)."""
    scheduler = str(sub.get("scheduler"))
    job_id = str(sub.get("job_id"))
    task = key[1] if key[1] is not None else ("0" if is_array or "[]" in job_id else None)
    if scheduler == "slurm":
        job = key[0] if task is None else f"{key[0]}_{task}"
        return _template("slurm").format(name=sub.get("name") or "job", job=job)
    if scheduler == "pbs":  # 123[].server -> 123[4].server: keep the server suffix
        server = job_id.split(".", 1)[1] if "." in job_id else ""
        job = key[0] + (f"[{task}]" if task is not None else "") + (f".{server}" if server else "")
        return _template("pbs").format(job=job)
    raise UserError(f"logs: job {job_id!r} ran on {scheduler!r}, whose logs hpc cannot name; "
                    "allowed: slurm, pbs and local runs")  # fmt: skip


def _template(scheduler: str) -> str:
    return next(p.template for p in LOG_PATTERNS if p.scheduler == scheduler)


def _ids(subs: list[dict[str, Any]]) -> str:
    return ", ".join(str(s.get("job_id")) for s in subs if s.get("job_id")) or "none"


def follow(
    path: Path,
    is_running: Callable[[], bool],
    out: TextIO,
    poll_s: float = 0.5,
    settle_s: float = 0.0,
) -> None:
    """Print ``path`` and then what is appended to it until the job ends.

    ``is_running`` is asked *before* each read, so once it says False one more read
    prints everything the job wrote before it ended. A file that does not exist yet is
    waited for; one truncated in place is read again from the start; one replaced
    (rotation: a new inode at the path) is read to its end, then the new one from the
    start. Bytes are decoded incrementally, so a UTF-8 character split across two
    reads prints whole, and undecodable bytes print as U+FFFD instead of failing.

    ``settle_s``: after the job ends, keep reading until the file has not grown for this
    long. A scheduler may append its own last lines (SLURM's ``CANCELLED`` notice) after
    the job's state changed, and a login node on NFS may see the last writes late.
    """
    fh = None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while True:
            running = is_running()
            fh = _reopen_if_replaced(path, fh, decoder, out)
            if fh is not None:
                _drain(fh, decoder, out)
            if not running:
                fh = _settle(path, fh, decoder, out, poll_s, settle_s)
                out.write(decoder.decode(b"", final=True))
                out.flush()
                return
            time.sleep(poll_s)
    finally:
        if fh is not None:
            fh.close()


def _settle(path: Path, fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO,
            poll_s: float, settle_s: float) -> Any:  # fmt: skip
    """Read on until ``path`` has not grown for ``settle_s`` seconds; the handle read last."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle_s:
        time.sleep(min(poll_s, settle_s) or 0.01)
        before = fh.tell() if fh is not None else -1
        fh = _reopen_if_replaced(path, fh, decoder, out)
        if fh is not None:
            _drain(fh, decoder, out)
            if fh.tell() != before:
                quiet_since = time.monotonic()
    return fh


def _reopen_if_replaced(
    path: Path, fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO
) -> Any:
    """The handle to read next: opened once the file exists, reopened after rotation."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return fh  # not there yet, or moved away mid-rotation: keep what we have
    except OSError as exc:
        raise UserError(f"logs: cannot read {str(path)!r}: {exc.strerror}") from None
    if fh is not None:
        cur = os.fstat(fh.fileno())
        if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
            if cur.st_size < fh.tell():  # truncated in place (copytruncate): start over
                fh.seek(0)
            return fh
        _drain(fh, decoder, out)  # the rest of the rotated file first
        fh.close()
    try:
        return open(path, "rb")  # noqa: SIM115 - closed by follow
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"logs: cannot read {str(path)!r}: {exc.strerror}") from None


def _drain(fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO) -> None:
    wrote = False
    while chunk := fh.read(65536):
        out.write(decoder.decode(chunk))
        wrote = True
    if wrote:
        out.flush()


def print_log(path: Path, out: TextIO) -> None:
    """Print a finished job's log (``hpc logs`` without ``-f``)."""
    if not path.is_file():
        raise UserError(f"logs: {str(path)!r} does not exist yet (the job has not started?); "
                        "allowed: hpc logs -f to wait for it")  # fmt: skip
    follow(path, lambda: False, out)


def locate(ident: str, runs_dir: Path) -> tuple[Path, str | None]:
    """``(run directory, job)`` for ``hpc logs IDENT``: a run directory or its name (job
    None: the latest), or a job id, an array task's included (``12345_3``, ``123[3].server``)."""
    from hpc import runs

    found = runs.find(ident, runs_dir)
    if found is not None:
        run_dir, record = found
        is_job = ident.strip() not in (str(run_dir), run_dir.name) and not Path(ident).is_dir()
        return run_dir, (ident.strip() if is_job and record.get("job_id") else None)
    key = job_key(ident)
    if key is not None and key[1] is not None:  # a task: find the array's run by its number
        with contextlib.suppress(UserError):
            for candidate in (key[0], _pbs_array_id(ident)):
                found = runs.find(candidate, runs_dir) if candidate else None
                if found is not None:
                    return found[0], ident.strip()
    raise UserError(f"logs: {ident!r} is neither a run directory nor a job id of a run under "
                    f"{str(runs_dir)!r}")  # fmt: skip


def _pbs_array_id(ident: str) -> str | None:
    """``123[3].server`` -> ``123[].server``, as qsub -J records the array."""
    match = re.match(r"(\d+)\[\d+\](.*)\Z", ident.strip())
    return f"{match.group(1)}[]{match.group(2)}" if match else None
