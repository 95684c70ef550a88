"""Atomic checkpoints, resume lookup and export for single-device inference.

A checkpoint is ``<dir>/step_<N>.pt`` plus ``step_<N>.pt.sha256``, the digest of its
bytes; ``<dir>/latest`` names the newest complete one. Both are written through :func:`atomic_save` / :func:`atomic_write_text`
(temp file in the same directory, fsync, ``os.replace``, fsync of the directory),
and ``latest`` only moves after its checkpoint is durable, so a ``kill -9`` at any
instant leaves ``latest`` pointing at a complete file. Loading falls back to the
newest readable ``step_*.pt`` when the pointer is missing or its target is damaged.

A checkpoint is untrusted input (a shared directory, a file from elsewhere): it is
loaded with ``torch.load(weights_only=True)``, which builds tensors and plain
containers and refuses any pickled object that would run code, so the trainer stores
only such values (RNG states included, see :func:`rng_state`). The digest catches a
flipped byte, which torch's zip reader would load silently; ``latest`` may only name a
``step_*.pt`` file in the same directory, never a path elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import random
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp.dist import unwrap

log = logging.getLogger("ddp")

LATEST = "latest"
DIGEST_SUFFIX = ".sha256"
_STEP_RE = re.compile(r"^step_(\d+)\.pt\Z")
FORMAT_VERSION = 2  # 2: sha256 sidecar, RNG states as plain values (weights_only loads)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems refuse to open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Any], None], durable: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | Path, durable: bool = True) -> None:
    """``torch.save`` that never leaves a partial file at ``path``.

    Written to a temp file in the same directory (same filesystem, so
    ``os.replace`` is atomic), fsynced, renamed, then the directory is fsynced so
    the rename itself survives a crash.
    """
    _atomic_write(Path(path), lambda fh: torch.save(obj, fh), durable)


def atomic_write_text(text: str, path: str | Path, durable: bool = True) -> None:
    _atomic_write(Path(path), lambda fh: fh.write(text.encode()), durable)


# ---- RNG state -------------------------------------------------------------------------
def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, the accelerator)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain values, not an ndarray: a weights_only load needs no numpy globals.
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    except ImportError:  # pragma: no cover
        pass
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is not None and device.type == "xpu":
        state["xpu"] = torch.xpu.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, gauss = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        except ImportError:  # pragma: no cover
            pass
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device is not None and device.type == "xpu" and "xpu" in state:
        torch.xpu.set_rng_state(state["xpu"], device)


# ---- model state -----------------------------------------------------------------------
def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict of the unwrapped model: keys without ``module.``, loadable without DDP."""
    return unwrap(model).state_dict()


# ---- directory of checkpoints ----------------------------------------------------------
def step_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:09d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``step_*.pt`` files, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in d.iterdir()
        if (m := _STEP_RE.match(p.name)) and not p.is_symlink()
    ]
    return [p for _, p in sorted(found)]


class _Digesting:
    """A write-only file wrapper that hashes what passes through (torch.save needs write)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()

    error: OSError | None = None  # what the file system said, under torch's own wrapping

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


_pending: threading.Thread | None = None
_pending_error: list[BaseException] = []


def wait_pending(timeout: float | None = None) -> None:
    """Block until a background checkpoint finalize is done (at most ``timeout`` seconds);
    re-raise its error."""
    global _pending
    if _pending is not None:
        _pending.join(timeout)
        if _pending.is_alive():
            return
        _pending = None
    if _pending_error:
        raise _pending_error.pop()


def save_checkpoint(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    keep_last: int = 2,
    background: bool = False,
) -> Path:
    """Write ``step_<N>.pt``, then move ``latest`` to it, then prune old ones.

    Call on one rank only (the trainer uses rank 0). With ``background=True`` only
    the serialisation (the part a bare ``torch.save`` also pays) blocks; fsync, rename,
    the ``latest`` update and pruning run in a thread, so the disk flush overlaps
    training. ``latest`` still moves only after the file is durable; call
    :func:`wait_pending` before exiting (the next save waits for it too).
    """
    wait_pending()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = step_path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    fh = os.fdopen(fd, "wb")
    out = _Digesting(fh)
    try:
        torch.save({"format": FORMAT_VERSION, **state}, out)
        fh.flush()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            fh.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        err = out.error or (exc if isinstance(exc, OSError) else None)
        if err is not None:
            raise _write_error(directory, path.name, err) from None
        raise

    def finalize() -> None:
        try:
            try:
                os.fsync(fh.fileno())
            finally:
                fh.close()
            # The digest lands first: a checkpoint is never visible without one.
            atomic_write_text(out.sha.hexdigest() + "\n", _digest_path(path))
            os.replace(tmp, path)
            _fsync_dir(directory)
            atomic_write_text(path.name + "\n", directory / LATEST)
            for old in list_checkpoints(directory)[:-keep_last]:
                if old != path:
                    for gone in (old, _digest_path(old)):
                        with contextlib.suppress(FileNotFoundError):
                            gone.unlink()
            for stale in directory.glob(".step_*.tmp"):  # left by a writer killed mid-save
                if str(stale) != tmp:
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
        except BaseException as exc:  # reported by wait_pending()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            _pending_error.append(
                _write_error(directory, path.name, exc) if isinstance(exc, OSError) else exc
            )

    if background:
        global _pending
        _pending = threading.Thread(target=finalize, name="ddp-checkpoint", daemon=False)
        _pending.start()
    else:
        finalize()
        wait_pending()
    return path


def _write_error(directory: Path, name: str, exc: OSError) -> Exception:
    """A failed write (full disk, quota, read-only) as one line; older checkpoints stay."""
    from ddp.errors import ConfigError

    return ConfigError(
        f"checkpoint.dir {str(directory)!r}: writing {name} failed: "
        f"{exc.strerror or exc}; the earlier checkpoints are kept"
    )


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint, checked; raises ValueError naming what is wrong with it."""
    if path.is_symlink():
        raise ValueError("is a symbolic link; checkpoints are plain files")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror})") from None
    try:
        expected = _digest_path(path).read_text().strip()
    except OSError:
        expected = None
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"does not match its digest {_digest_path(path).name} (damaged)")
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # what weights_only refuses to build
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"holds objects that a safe load refuses ({first[:200]})") from None
    except Exception as exc:  # a damaged or foreign file
        raise ValueError(f"is not a loadable checkpoint ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or "format" not in obj or "global_step" not in obj:
        raise ValueError("is not a checkpoint written by ddp")
    if obj["format"] >= 2 and expected is None:
        raise ValueError(f"has no digest file {_digest_path(path).name}")
    return obj


def _readable(path: Path) -> dict[str, Any] | None:
    try:
        return read_checkpoint(path)
    except ValueError as exc:  # damaged, foreign or crafted: skip it, never crash resume
        log.warning("checkpoint %s %s; trying an older one", path, exc)
        return None


def find_latest(directory: str | Path) -> Path | None:
    """Path that ``latest`` names, if that file exists, else the newest ``step_*.pt``."""
    directory = Path(directory)
    pointer = directory / LATEST
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    # Only a checkpoint name in this directory: never an absolute path, '..' or a link.
    if _STEP_RE.match(name) and (directory / name).is_file():
        if not (directory / name).is_symlink():
            return directory / name
    elif name:
        log.warning("%s names %r, not a checkpoint of this directory; ignored", pointer, name)
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load_latest(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest valid checkpoint in ``directory``; None when there is none."""
    directory = Path(directory)
    first = find_latest(directory)
    candidates = [first] if first else []
    candidates += [p for p in reversed(list_checkpoints(directory)) if p != first]
    for path in candidates:
        obj = _readable(path)
        if obj is not None:
            return path, obj
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load the checkpoint a user named; any problem is one ConfigError line."""
    try:
        return read_checkpoint(Path(path))
    except ValueError as exc:
        from ddp.errors import ConfigError

        raise ConfigError(f"checkpoint.resume: {str(path)!r} {exc}") from None


def export_final(model: torch.nn.Module, directory: str | Path, config_yaml: str) -> Path:
    """Write ``<dir>/final/model.pt`` (plain CPU state_dict) and ``final/config.yaml``.

    The state dict has no ``module.`` prefix and only tensors, so
    ``torch.load(path, weights_only=True)`` loads it into the bare model class.
    """
    final = Path(directory) / "final"
    state = {k: v.detach().to("cpu").clone() for k, v in model_state(model).items()}
    path = final / "model.pt"
    atomic_save(state, path)
    atomic_write_text(config_yaml, final / "config.yaml")
    return path


# ---- one live run per directory ----------------------------------------------------------
LOCK = ".lock"
LOCK_STALE_S = 180.0
"""A lock whose owner has not refreshed it for this long belongs to a dead run."""


class DirLock:
    """``<dir>/.lock``: host, pid, job id and start time of the run that owns ``dir``.

    Two runs on one checkpoint directory (two ``sbatch`` of the same script) would resume
    each other's checkpoints and overwrite each other's files; the second one stops with
    one line naming the owner instead. The owner refreshes the file's mtime every minute
    from a daemon thread, so a lock left by a run that died (node failure, ``kill -9``)
    goes stale after :data:`LOCK_STALE_S` (three missed refreshes); on the same host a dead pid frees it at once,
    and a requeued job (same SLURM/PBS job id) takes its own lock back.
    """

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="ddp-lock", daemon=True)
        self._thread.start()

    @staticmethod
    def owner() -> dict[str, Any]:
        import socket
        import time

        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")  # bumped by each requeue
        return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
                "restart": restart, "started": time.time()}  # fmt: skip

    @classmethod
    def acquire(cls, directory: str | Path) -> DirLock:
        """Take the lock or raise ConfigError naming the live owner or the write error."""
        import json

        from ddp.errors import ConfigError

        directory = Path(directory)
        path = directory / LOCK
        me = cls.owner()
        for _ in range(3):
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                other = cls._read(path)
                why = cls._stale(other, me, path)
                if why is None:
                    raise ConfigError(
                        f"checkpoint.dir {str(directory)!r} is in use by another run "
                        f"(host {other.get('host')}, pid {other.get('pid')}, job "
                        f"{other.get('job') or '-'}); give this run its own checkpoint.dir, "
                        f"or delete {str(path)!r} if that run is gone"
                    ) from None
                log.warning("taking over %s: %s", path, why)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            except OSError as exc:
                raise ConfigError(
                    f"checkpoint.dir {str(directory)!r}: cannot write there ({exc.strerror}); "
                    "allowed: a writable directory"
                ) from None
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me) + "\n")
            return cls(path, me)
        raise ConfigError(f"checkpoint.dir {str(directory)!r}: the lock {LOCK} keeps changing")

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        import json

        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _stale(other: dict[str, Any], me: dict[str, Any], path: Path) -> str | None:
        """Why the existing lock belongs to no live run, or None when it may."""
        import time

        if not other:
            return "unreadable lock"
        if other.get("job") and other.get("job") == me["job"]:
            if other.get("restart") != me["restart"]:
                return f"the same job {me['job']} restarted (requeue)"
        if other.get("host") == me["host"] and isinstance(other.get("pid"), int):
            try:
                os.kill(other["pid"], 0)
            except ProcessLookupError:
                return f"pid {other['pid']} is gone"
            except PermissionError:
                pass
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            return "lock vanished"
        if age > LOCK_STALE_S:
            return f"not refreshed for {age:.0f} s"
        return None

    def _refresh(self) -> None:
        while not self._stop.wait(60.0):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._read(self.path).get("pid") == self.info["pid"]:
            with contextlib.suppress(OSError):
                self.path.unlink()
