"""One live run per checkpoint directory: the directory lock (``.ddp-lock``).

The owner is host + boot id + pid namespace + pid + process start time, decided before
any mtime; an owner on another host is alive while its heartbeat counter moves (watched
on this host's monotonic clock, never compared with its wall clock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from ddp.checkpoint.files import SMALL_FILE, _atomic_write, _open_regular
from hpc_ddp.procs import process_start

log = logging.getLogger("ddp")

# ---- one live run per directory ----------------------------------------------------------
LOCK = ".ddp-lock"
"""Not ``.lock``: that is ``hpc``'s flock file in a run directory, and a checkpoint.dir
may be the run directory itself (``checkpoint.dir: .`` under ``hpc submit``). Sharing it
would find hpc's empty file where a lock belongs, and each heartbeat (a new file) would
give hpc's flock holders different files."""
LOCK_REFRESH_S = 60.0
"""How often an owner beats (rewrites its lock with the next heartbeat count)."""
LOCK_STALE_BEATS = 3
"""Heartbeats an owner on another machine may miss before its lock is taken over."""
_PID_MAX = 1 << 31


def _read_small(path: str) -> str | None:
    """A kernel file of this machine (``/proc``), None where there is none."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(4096).strip()
    except OSError:
        return None


class DirLock:
    """``<dir>/.ddp-lock``: which process owns ``dir``, in terms no clock can fake.

    Two runs on one checkpoint directory (two ``sbatch`` of the same script) would resume
    each other's checkpoints and overwrite each other's files; the second one stops with
    one line naming the owner instead. The lock records host, boot id
    (``/proc/sys/kernel/random/boot_id``), pid namespace, pid and the process's start time,
    plus a heartbeat counter that the owner bumps every :data:`LOCK_REFRESH_S` from a
    daemon thread. Whether the owner lives is decided, in this order:

    - same host, boot and pid namespace: by its pid being alive with the same start time
      (exact: a dead owner frees the lock at once, a reused pid does not hold it, and a
      live owner keeps it whatever its mtime says);
    - a requeue of the same SLURM job (same job id, another restart count) takes it back;
      the same host after a reboot (another boot id) finds it free;
    - another machine: by its heartbeat counter moving while this run watches on its own
      monotonic clock, for at most :data:`LOCK_STALE_BEATS` of the owner's intervals. An
      mtime is never compared with this host's clock (two hosts' clocks may disagree by
      hours): a lock whose mtime is as fresh as a file made now in the same directory
      (stamped by the same file system) is live at once; any other is watched.

    A lock file that is empty or unreadable is a run writing it this moment, or damaged:
    never free; it, and a lock path that is not a regular file, stop the run with one
    line. The file is written whole before it appears (a temp file, then ``link``), so a
    sound run never shows an empty one.
    """

    REFRESH_S = LOCK_REFRESH_S

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="ddp-lock", daemon=True)
        self._thread.start()

    # ---- who I am -------------------------------------------------------------------------
    @classmethod
    def owner(cls) -> dict[str, Any]:
        """This process's identity as its lock records it (heartbeat 0)."""
        import socket
        import time

        pidns = None
        with contextlib.suppress(OSError):
            pidns = os.readlink("/proc/self/ns/pid")
        return {
            "host": socket.gethostname(),
            "boot": _read_small("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns,
            "pid": os.getpid(),
            "start": process_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID"),
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),  # bumped by each requeue
            "started": time.time(),  # for people reading the file; no decision uses it
            "interval": float(cls.REFRESH_S),
            "beat": 0,
        }

    @staticmethod
    def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(a.get(k) == b.get(k) for k in ("host", "boot", "pidns", "pid", "start"))

    # ---- taking it ------------------------------------------------------------------------
    @classmethod
    def acquire(cls, directory: str | Path) -> DirLock:
        """Take the lock or raise ConfigError naming the live owner or what is wrong."""
        from ddp.errors import ConfigError

        directory = Path(directory)
        path = directory / LOCK
        where = f"checkpoint.dir {str(directory)!r}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(
                f"{where} is not a directory; allowed: a directory, or a path where one can be made"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"{where}: cannot write there ({exc.strerror or exc}); "
                "allowed: a writable directory"
            ) from None
        me = cls.owner()
        for _ in range(5):
            try:
                _write_new(path, me)
                return cls(path, me)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ConfigError(
                    f"{where}: cannot write there ({exc.strerror or exc}); "
                    "allowed: a writable directory"
                ) from None
            try:
                seen = cls._look(path)
            except ValueError as exc:
                raise ConfigError(
                    f"{where}: its lock {str(path)!r} {exc}; delete it if no run uses "
                    "this directory"
                ) from None
            if seen is None:
                continue  # gone between the two steps: try again
            other, key = seen
            why = cls._stale(other, key, me, path)
            if why is None:
                raise ConfigError(
                    f"{where} is in use by another run (host {other.get('host')}, pid "
                    f"{other.get('pid')}, job {other.get('job') or '-'}); give this run its "
                    f"own checkpoint.dir, or delete {str(path)!r} if that run is gone"
                )
            log.warning("taking over %s: %s", path, why)
            try:
                _remove_if_unchanged(path, key)
            except OSError as exc:
                raise ConfigError(
                    f"{where}: cannot take over its stale lock {str(path)!r} "
                    f"({exc.strerror or exc}); allowed: a writable "
                    "directory"
                ) from None
        raise ConfigError(
            f"{where}: the lock {LOCK} keeps changing (runs starting at once); "
            "allowed: one run per checkpoint.dir"
        )

    @staticmethod
    def _look(path: Path) -> tuple[dict[str, Any], tuple[Any, ...]] | None:
        """(the owner it names, what changes with each heartbeat), None if it is gone.

        ValueError for a lock that is no lock: not a regular file, empty after a short
        wait for its writer, or not what a run writes."""
        import time

        for attempt in range(6):
            try:
                data, info = _open_regular(path, SMALL_FILE)
            except ValueError:
                if not os.path.lexists(path):
                    return None
                raise
            if data.strip() or attempt == 5:
                break
            time.sleep(0.05)  # a writer of an older version, between create and write
        if not data.strip():
            raise ValueError("is empty: a run is writing it this moment, or it is damaged")
        owner = _parse_lock(data)
        return owner, (info.st_ino, info.st_mtime_ns, info.st_size, owner.get("beat"))

    @classmethod
    def _stale(
        cls, other: dict[str, Any], key: tuple[Any, ...], me: dict[str, Any], path: Path
    ) -> str | None:
        """Why the lock belongs to no live run, or None when it may."""
        pid = other["pid"]
        here = other["host"] == me["host"]
        if (
            here
            and me["boot"]
            and other.get("boot") == me["boot"]
            and (other.get("pidns") == me["pidns"])
        ):
            start = process_start(pid)
            if start is None:
                return f"pid {pid} is gone"
            if other.get("start") is not None and other["start"] != start:
                return f"pid {pid} is another process now (it started at another time)"
            return None
        if other.get("job") and other.get("job") == me["job"]:
            if other.get("restart") != me["restart"]:
                return f"the same job {me['job']} restarted (requeue)"
        if here and me["boot"] and other.get("boot") and other["boot"] != me["boot"]:
            return "this host rebooted since"
        if here and other.get("boot") is None:  # written by an older version: its pid only
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"pid {pid} is gone"
            except PermissionError:
                pass
        return cls._watch(other, key, path)

    @staticmethod
    def _watch(other: dict[str, Any], key: tuple[Any, ...], path: Path) -> str | None:
        """An owner on another machine: live if its lock changes (a heartbeat) within
        LOCK_STALE_BEATS of its intervals, measured on this host's monotonic clock."""
        import time

        interval = other.get("interval") or LOCK_REFRESH_S
        interval = min(max(float(interval), 0.001), LOCK_REFRESH_S)
        window = LOCK_STALE_BEATS * interval
        made = _fresh_mtime(path.parent)
        if made is not None and abs(made - key[1]) <= window * 1e9:
            return None  # beat as recently as the file system's own clock can tell
        log.warning(
            "%s: owner pid %s on host %s; waiting up to %.0f s for its heartbeat",
            path,
            other["pid"],
            other["host"],
            window,
        )
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, interval / 4, 1.0))
            try:
                now = DirLock._look(path)
            except ValueError:
                return None  # changed into something else: not ours to judge now
            if now is None or now[1] != key:
                return None  # it beat (or went): live, or someone else's now
        return f"no heartbeat from host {other['host']} for {window:.0f} s"

    # ---- holding and releasing ------------------------------------------------------------
    def _refresh(self) -> None:
        while not self._stop.wait(float(self.info["interval"])):
            if not self._beat():
                return

    def _beat(self) -> bool:
        """Bump the heartbeat if the lock is still this run's; False once it is not."""
        try:
            seen = self._look(self.path)
        except ValueError as exc:
            if os.path.lexists(self.path):
                log.error(
                    "%s %s: this run no longer holds its checkpoint directory", self.path, exc
                )
                return False
            seen = None
        if seen is not None and not self._same_process(seen[0], self.info):
            log.error(
                "%s now names another run (host %s, pid %s): this run no longer "
                "holds its checkpoint directory",
                self.path,
                seen[0].get("host"),
                seen[0].get("pid"),
            )
            return False
        self.info = {**self.info, "beat": int(self.info["beat"]) + 1}
        try:
            if seen is None:  # deleted by hand while this run lives: taken again
                _write_new(self.path, self.info)
            else:
                _write_replace(self.path, self.info)
        except FileExistsError:
            return self._beat()
        except OSError as exc:  # a full disk: the next beat tries again
            log.warning("cannot refresh %s (%s)", self.path, exc.strerror or exc)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(30)
        try:
            seen = self._look(self.path)
        except ValueError:
            return
        if seen is not None and self._same_process(seen[0], self.info):
            with contextlib.suppress(OSError):
                self.path.unlink()


def _parse_lock(data: bytes) -> dict[str, Any]:
    """The owner a lock names, checked field by field (it is untrusted input)."""
    import json

    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("is damaged (not the JSON a run writes)") from None
    if not isinstance(info, dict):
        raise ValueError("is damaged (not the JSON object a run writes)")

    def bad(field: str, allowed: str) -> ValueError:
        return ValueError(f"is damaged ({field} {info.get(field)!r}; allowed: {allowed})")

    if not isinstance(info.get("host"), str):
        raise bad("host", "a host name")
    pid = info.get("pid")
    if type(pid) is not int or not 0 < pid < _PID_MAX:
        raise bad("pid", "a process id")
    for field in ("boot", "pidns", "job"):
        if info.get(field) is not None and not isinstance(info[field], str):
            raise bad(field, "a string or null")
    for field in ("start", "beat"):
        v = info.get(field)
        if v is not None and (type(v) is not int or v < 0):
            raise bad(field, "an integer >= 0 or null")
    v = info.get("interval")
    if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
        raise bad("interval", "seconds > 0")
    return info


def _write_new(path: Path, info: dict[str, Any]) -> None:
    """Make ``path`` hold ``info``, whole from the moment it exists; FileExistsError if
    it exists. A temp file is written, then hard-linked to ``path`` (atomic, fails on an
    existing name); where links are not supported, ``O_EXCL`` create and write."""
    import errno
    import json

    text = (json.dumps(info) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f"{LOCK}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
        try:
            os.link(tmp, path)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _write_replace(path: Path, info: dict[str, Any]) -> None:
    """Replace ``path`` with ``info`` atomically (a heartbeat)."""
    import json

    _atomic_write(path, lambda fh: fh.write((json.dumps(info) + "\n").encode()), durable=False)


def _remove_if_unchanged(path: Path, key: tuple[Any, ...]) -> None:
    """Delete the stale lock judged as ``key``, and only it.

    Two runs may judge the same stale lock at once; the first replaces it with its own.
    A plain unlink by the second would delete that live lock. So the lock is renamed
    away first (atomic), and put back if what was renamed is not the one judged. (A third
    run creating its lock in the instant between the two could still win against the
    first; the first's heartbeat then finds another owner and says so.)"""
    import uuid

    trash = path.with_name(f"{LOCK}.{uuid.uuid4().hex}.stale")
    try:
        info = os.stat(path, follow_symlinks=False)
        if (info.st_ino, info.st_mtime_ns, info.st_size) != key[:3]:
            return  # replaced already: judged again on the next round
        os.rename(path, trash)
    except FileNotFoundError:
        return
    try:
        info = os.stat(trash)
        if (info.st_ino, info.st_mtime_ns, info.st_size) != key[:3]:
            with contextlib.suppress(FileExistsError):
                os.link(trash, path)  # someone's live lock: back where it was
    finally:
        with contextlib.suppress(OSError):
            os.unlink(trash)


def _fresh_mtime(directory: Path) -> int | None:
    """The mtime (ns) a file made now in ``directory`` gets: the file system's clock,
    the one that stamped the lock's mtime; None where no file can be made."""
    try:
        with tempfile.NamedTemporaryFile(prefix=f"{LOCK}.", suffix=".probe", dir=directory) as fh:
            return os.fstat(fh.fileno()).st_mtime_ns
    except OSError:
        return None
