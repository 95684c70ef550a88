"""Atomic checkpoints, resume lookup and export for single-device inference.

A checkpoint is ``<dir>/step_<N>.pt``; ``<dir>/latest`` names the newest
complete one. Both are written through :func:`atomic_save` / :func:`atomic_write_text`
(temp file in the same directory, fsync, ``os.replace``, fsync of the directory),
and ``latest`` only moves after its checkpoint is durable, so a ``kill -9`` at any
instant leaves ``latest`` pointing at a complete file. Loading falls back to the
newest readable ``step_*.pt`` when the pointer is missing or its target is damaged.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
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
_STEP_RE = re.compile(r"^step_(\d+)\.pt$")
FORMAT_VERSION = 1


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

        state["numpy"] = np.random.get_state()
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

            np.random.set_state(state["numpy"])
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
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


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
    try:
        torch.save({"format": FORMAT_VERSION, **state}, fh)
        fh.flush()
    except BaseException:
        fh.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

    def finalize() -> None:
        try:
            try:
                os.fsync(fh.fileno())
            finally:
                fh.close()
            os.replace(tmp, path)
            _fsync_dir(directory)
            atomic_write_text(path.name + "\n", directory / LATEST)
            for old in list_checkpoints(directory)[:-keep_last]:
                if old != path:
                    with contextlib.suppress(FileNotFoundError):
                        old.unlink()
            for stale in directory.glob(".step_*.tmp"):  # left by a writer killed mid-save
                if str(stale) != tmp:
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
        except BaseException as exc:  # reported by wait_pending()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            _pending_error.append(exc)

    if background:
        global _pending
        _pending = threading.Thread(target=finalize, name="ddp-checkpoint", daemon=False)
        _pending.start()
    else:
        finalize()
        wait_pending()
    return path


def _readable(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # damaged or foreign file: skip it, never crash resume
        log.warning("checkpoint %s unreadable (%s); trying an older one", path, exc)
        return None
    return obj if isinstance(obj, dict) and "format" in obj else None


def find_latest(directory: str | Path) -> Path | None:
    """Path that ``latest`` names, if that file exists, else the newest ``step_*.pt``."""
    directory = Path(directory)
    pointer = directory / LATEST
    try:
        name = pointer.read_text().strip()
    except OSError:
        name = ""
    if name and (directory / name).is_file():
        return directory / name
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
    obj = _readable(Path(path))
    if obj is None:
        from ddp.errors import ConfigError

        raise ConfigError(f"checkpoint.resume: {str(path)!r} is not a readable checkpoint")
    return obj


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
