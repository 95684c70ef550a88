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
_STEP_RE = re.compile(r"^step_(\d+)(\.pt)?\Z")  # a file, or a sharded checkpoint's directory
META = "meta.pt"  # in a sharded checkpoint: everything but the shards (ddp.checkpointer)
FORMAT_VERSION = 2  # 2: sha256 sidecar, RNG states as plain values (weights_only loads)


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in ``path`` durable (best effort where unsupported)."""
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


class _Staged:
    """A file written under a temp name in its final directory, made visible by commit().

    Same directory, so ``os.replace`` is atomic; ``commit`` fsyncs the file, renames it
    and fsyncs the directory so the rename itself survives a crash. Every atomic write
    here (checkpoints, their digests, ``latest``, the export) goes through this class.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        self.fh = os.fdopen(fd, "wb")

    def commit(self, durable: bool = True) -> None:
        try:
            try:
                self.fh.flush()
                if durable:
                    os.fsync(self.fh.fileno())
            finally:
                self.fh.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        if durable:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def _atomic_write(path: Path, write: Callable[[Any], None], durable: bool = True) -> None:
    staged = _Staged(path)
    try:
        write(staged.fh)
    except BaseException:
        staged.discard()
        raise
    staged.commit(durable)


def atomic_save(obj: Any, path: str | Path, durable: bool = True) -> None:
    """``torch.save`` that never leaves a partial file at ``path``.

    Written to a temp file in the same directory (same filesystem, so
    ``os.replace`` is atomic), fsynced, renamed, then the directory is fsynced so
    the rename itself survives a crash.
    """
    _atomic_write(Path(path), lambda fh: torch.save(obj, fh), durable)


def atomic_save_digested(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically, with its ``.sha256`` file landing first."""
    path = Path(path)
    staged = _Staged(path)
    out = _Digesting(staged.fh)
    try:
        torch.save(obj, out)
        atomic_write_text(out.sha.hexdigest() + "\n", _digest_path(path))
    except BaseException:
        staged.discard()
        raise
    staged.commit()


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


def sharded_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:09d}"


def staging_path(path: Path) -> Path:
    """Where a sharded checkpoint's shards are written before it is complete: a dot name
    that the resume lookup (:data:`_STEP_RE`) never takes for a checkpoint."""
    return path.with_name(f".{path.name}.tmp")


def remove_stale_staging(directory: Path) -> None:
    """Delete staging directories left by a run killed mid-save, and checkpoint
    directories left half-deleted (:func:`remove_checkpoint`).

    Only while no save of this run is in flight (the directory lock keeps other runs out).
    """
    for pattern in (".step_*.tmp", ".step_*.old"):
        for stale in directory.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                remove_checkpoint(stale)


def _is_checkpoint(p: Path) -> bool:
    """A ``step_N.pt`` file, or a ``step_N`` directory holding its meta file."""
    if p.is_symlink():
        return False
    return p.is_file() if p.suffix == ".pt" else (p / META).is_file()


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``step_*.pt`` files and sharded ``step_*`` directories, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in d.iterdir()
        if (m := _STEP_RE.match(p.name)) and _is_checkpoint(p)
    ]
    return [p for _, p in sorted(found)]


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file with its digest, or a sharded checkpoint's directory.

    A ``step_N`` directory is first renamed to a hidden ``.step_N.old``: a kill during
    the deletion would otherwise leave a ``step_N`` with some shards (or none) that
    pruning never removes once its meta file is gone; the hidden one is removed by
    :func:`remove_stale_staging`.
    """
    if path.is_dir() and not path.is_symlink():
        import shutil

        if _STEP_RE.match(path.name):
            trash = path.with_name(f".{path.name}.old")
            shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(path, trash)
                path = trash
            except OSError:
                pass  # delete it in place
        shutil.rmtree(path, ignore_errors=True)
        return
    for gone in (path, _digest_path(path)):
        with contextlib.suppress(FileNotFoundError):
            gone.unlink()


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


class PendingSave:
    """A checkpoint whose save may still be running: the caller goes on training.

    ``finalize`` runs in a thread when ``background=True``: for a plain checkpoint the
    fsync, the rename into place, the ``latest`` update and pruning (its bytes are
    already written); for a sharded one also the wait for every rank's shards
    (``ddp.checkpointer``). :meth:`wait` joins it and raises what it failed with (one
    ConfigError line for a write error), once.
    """

    def __init__(self, path: Path, finalize: Callable[[], None], background: bool) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(finalize,), name="ddp-checkpoint", daemon=False
            )
            self._thread.start()
        else:
            self._run(finalize)

    def _run(self, finalize: Callable[[], None]) -> None:
        try:
            finalize()
        except BaseException as exc:  # reported by wait()
            self._error = exc

    def wait(self, timeout: float | None = None) -> bool:
        """True once finished (raising its error, if any); False if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True


def save_checkpoint(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    keep_last: int = 2,
) -> Path:
    """Write ``step_<N>.pt`` durably, move ``latest`` to it and prune old ones; its path."""
    pending = begin_save(state, directory, step, keep_last, background=False)
    pending.wait()
    return pending.path


def begin_save(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    keep_last: int = 2,
    background: bool = False,
) -> PendingSave:
    """Serialise ``state`` to ``step_<N>.pt`` (digest computed as it is written), then
    finalize: digest file, fsync, rename, ``latest``, pruning. Call on one rank only.

    Only the serialisation (what a bare ``torch.save`` also pays) blocks the caller;
    with ``background=True`` the finalize runs in a thread (:class:`PendingSave`).
    ``latest`` moves only after the checkpoint file is durable.
    """
    directory = Path(directory)
    path = step_path(directory, step)
    staged = _Staged(path)
    out = _Digesting(staged.fh)
    try:
        torch.save({"format": FORMAT_VERSION, **state}, out)
        staged.fh.flush()  # a full disk shows here, in the caller, not in the thread
    except BaseException as exc:
        staged.discard()
        err = out.error or (exc if isinstance(exc, OSError) else None)
        if err is not None:
            raise _write_error(directory, path.name, err) from None
        raise

    def finalize() -> None:
        try:
            # The digest lands first: a checkpoint is never visible without one.
            atomic_write_text(out.sha.hexdigest() + "\n", _digest_path(path))
            staged.commit()
            atomic_write_text(path.name + "\n", directory / LATEST)
        except OSError as exc:
            staged.discard()
            raise _write_error(directory, path.name, exc) from None
        except BaseException:
            staged.discard()
            raise
        prune(directory, keep_last, path)
        for stale in directory.glob(".step_*.tmp"):  # left by a writer killed mid-save
            if str(stale) != staged.tmp:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()

    return PendingSave(path, finalize, background)


def prune(directory: Path, keep_last: int, newest: Path) -> None:
    """Keep the ``keep_last`` newest checkpoints (never ``newest``)."""
    for old in list_checkpoints(directory)[:-keep_last]:
        if old != newest:
            remove_checkpoint(old)


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
    """Load one checkpoint, checked; raises ValueError naming what is wrong with it.

    For a sharded checkpoint (a directory) this is its meta file, after every shard's
    digest was checked; ``"sharded"`` then names the directory the shards are read from.
    """
    if path.is_dir() and not path.is_symlink():
        obj = read_checkpoint(path / META)
        for name, digest in (obj.get("shards") or {}).items():
            shard = path / name
            if not _SHARD_RE.match(name) or shard.is_symlink() or not shard.is_file():
                raise ValueError(f"misses its shard {name}")
            if sha256_file(shard) != digest:
                raise ValueError(f"has a damaged shard {name} (digest mismatch)")
        if not obj.get("shards"):
            raise ValueError("lists no shards")
        obj["sharded"] = str(path)
        return obj
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


#: What a sharded checkpoint's shard files may be called: torch.distributed.checkpoint's
#: per-rank data files and its metadata file (nothing with a path in it).
_SHARD_RE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)\Z")


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


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
    if _STEP_RE.match(name) and _is_checkpoint(directory / name):
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


def load_checkpoint(path: str | Path, verify_shards: bool = True) -> dict[str, Any]:
    """Load the checkpoint a user named; any problem is one ConfigError line.

    ``verify_shards=False`` reads a sharded checkpoint's meta file only (the other ranks,
    once rank 0 has checked every shard)."""
    try:
        p = Path(path)
        if not verify_shards and p.is_dir() and not p.is_symlink():
            obj = read_checkpoint(p / META)
            obj["sharded"] = str(p)
            return obj
        return read_checkpoint(p)
    except ValueError as exc:
        from ddp.errors import ConfigError

        raise ConfigError(f"checkpoint.resume: {str(path)!r} {exc}") from None


def export_final(
    model: torch.nn.Module,
    directory: str | Path,
    config_yaml: str,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``<dir>/final/model.pt`` (plain CPU state_dict) and ``final/config.yaml``.

    The state dict has no ``module.`` prefix and only tensors, so
    ``torch.load(path, weights_only=True)`` loads it into the bare model class. A
    sharded model's full ``state`` is gathered by the caller (a collective).
    """
    final = Path(directory) / "final"
    source = model_state(model) if state is None else state
    state = {k: v.detach().to("cpu").clone() for k, v in source.items()}
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
