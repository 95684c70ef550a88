"""Issue 24, checkpoints under hostile input: the directory lock against skewed clocks,
empty, damaged or odd lock files and races; full disks during sharded saves; resumes
of another model shape with FSDP; crafted meta fields; config numbers that overflow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddp import checkpoint as ckpt
from ddp.errors import ConfigError
from tests.ddp import _launch

HOUR = 3600.0

# A run holding a checkpoint directory: takes the lock, says "ready", keeps it (and its
# heartbeat) until its stdin closes. argv: dir, heartbeat interval, clock skew in seconds
# (a host whose clock runs behind: every heartbeat lands with an mtime that far back).
_OWNER = """
import os, sys, time
from pathlib import Path
from ddp import checkpoint as ckpt
directory, interval, skew = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ckpt.DirLock.REFRESH_S = interval
if skew and hasattr(ckpt.DirLock, "_beat"):
    beat = ckpt.DirLock._beat
    def skewed(self):
        beat(self)
        os.utime(self.path, (time.time() - skew, time.time() - skew))
    ckpt.DirLock._beat = skewed
lock = ckpt.DirLock.acquire(directory)
if skew:
    os.utime(lock.path, (time.time() - skew, time.time() - skew))
print("ready", flush=True)
sys.stdin.read()
lock.release()
"""


class _Owner:
    """A live owner of ``directory``'s lock in another process, for a ``with`` block."""

    def __init__(self, directory: Path, interval: float = 60.0, skew: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(directory), str(interval), str(skew)],
            env=_launch.base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "ready", line + self.proc.stderr.read()  # type: ignore[union-attr]

    def __enter__(self) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        _, err = self.proc.communicate("", timeout=60)
        assert self.proc.returncode == 0, err


def _lock_info(directory: Path) -> dict:
    return json.loads((directory / ckpt.LOCK).read_text())


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ---- the lock: an owner identity that clocks cannot fake -------------------------------
def test_live_owner_on_this_host_keeps_its_lock_whatever_its_mtime(tmp_path: Path) -> None:
    """Same host and boot: the owner's pid and start time decide, never the mtime."""
    d = tmp_path / "ck"
    with _Owner(d) as owner:
        old = time.time() - HOUR
        os.utime(d / ckpt.LOCK, (old, old))
        with pytest.raises(ConfigError, match="in use by another run") as exc:
            ckpt.DirLock.acquire(d)
        assert f"pid {owner.proc.pid}" in _one_line(exc)
        assert _lock_info(d)["pid"] == owner.proc.pid  # still the owner's lock


def test_live_owner_on_a_host_whose_clock_runs_behind_keeps_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host (this process pretends to be one): every heartbeat of the owner lands
    an hour in the past, as from a clock an hour behind; its heartbeat counter still
    moves, so the lock is live."""
    d = tmp_path / "ck"
    with _Owner(d, interval=2.0, skew=HOUR) as owner:
        monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
        with pytest.raises(ConfigError, match="in use by another run") as exc:
            ckpt.DirLock.acquire(d)
        assert f"pid {owner.proc.pid}" in _one_line(exc)
        assert _lock_info(d)["pid"] == owner.proc.pid


def _crafted(directory: Path, **fields: object) -> Path:
    """A lock file as another run would have left it: this process's identity, changed."""
    directory.mkdir(parents=True, exist_ok=True)
    info = {**ckpt.DirLock.owner(), **fields}
    path = directory / ckpt.LOCK
    path.write_text(json.dumps(info) + "\n")
    return path


def test_lock_of_another_host_without_a_heartbeat_is_taken_over(tmp_path: Path) -> None:
    """No heartbeat within three of its own intervals (0.01 s here): the owner is gone,
    whatever the mtime says (here: fresh, as from a clock ahead of this one)."""
    d = tmp_path / "ck"
    path = _crafted(d, host="elsewhere", boot="other-boot", pid=4242, interval=0.01)
    future = time.time() + HOUR
    os.utime(path, (future, future))
    lock = ckpt.DirLock.acquire(d)
    try:
        assert _lock_info(d)["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_reused_pid_does_not_keep_a_lock(tmp_path: Path) -> None:
    """Same host and boot, the pid alive but started at another time: another process."""
    d = tmp_path / "ck"
    me = ckpt.DirLock.owner()
    _crafted(d, pid=os.getppid(), start=int(me["start"]) + 12345)
    lock = ckpt.DirLock.acquire(d)
    lock.release()


def test_a_lock_from_before_this_hosts_reboot_is_taken_over(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    _crafted(d, pid=os.getppid(), boot="a-boot-before-this-one")
    lock = ckpt.DirLock.acquire(d)
    lock.release()


@pytest.mark.parametrize(
    "content, what",
    [(b"", "empty"), (b"\x00\xff garbage", "damaged"), (b"[1, 2]", "damaged"),
     (b'{"host": "h", "pid": "12"}', "damaged"), (b'{"host": "h", "pid": 1e400}', "damaged"),
     (b'{"host": "h", "pid": 123456789012345678901234567890}', "damaged"),
     (b'{"host": ["h"], "pid": 12}', "damaged")],
)  # fmt: skip
def test_an_empty_or_damaged_lock_is_never_free(tmp_path: Path, content: bytes, what: str) -> None:
    """Someone mid-write, or a damaged file: one line, and the lock stays where it is."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / ckpt.LOCK).write_bytes(content)
    with pytest.raises(ConfigError, match=what) as exc:
        ckpt.DirLock.acquire(d)
    assert str(d / ckpt.LOCK) in _one_line(exc)
    assert (d / ckpt.LOCK).read_bytes() == content


@pytest.mark.parametrize("kind", ["directory", "named pipe", "symbolic link"])
def test_a_lock_path_that_is_not_a_file_is_one_line(tmp_path: Path, kind: str) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    lock = d / ckpt.LOCK
    if kind == "directory":
        lock.mkdir()
    elif kind == "named pipe":
        os.mkfifo(lock)
    else:
        lock.symlink_to(tmp_path / "elsewhere.json")
    box: list[BaseException | None] = []

    def attempt() -> None:
        try:
            ckpt.DirLock.acquire(d)
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box.append(exc)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)  # against a true hang only (a pipe opened for reading waits for a writer)
    if t.is_alive():
        os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))  # let the old reader go
        pytest.fail("acquire hung on a named pipe")
    [err] = box
    assert isinstance(err, ConfigError), repr(err)
    assert kind in str(err) and "\n" not in str(err), str(err)
    assert os.path.lexists(lock)


def test_a_checkpoint_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "ck"
    f.write_text("not a directory")
    with pytest.raises(ConfigError, match="not a directory") as exc:
        ckpt.DirLock.acquire(f)
    _one_line(exc)
    assert f.read_text() == "not a directory"


def _mount_tmpfs(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)  # fmt: skip


def _fill(mount: Path, leave: int = 0) -> None:
    """Fill the file system at ``mount`` up to ``leave`` free bytes."""
    st = os.statvfs(mount)
    with open(mount / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def test_a_full_disk_when_taking_the_lock_is_one_line_and_leaves_no_lock(tmp_path: Path) -> None:
    full = tmp_path / "full"
    _mount_tmpfs(full, "64k")
    try:
        (full / "ck").mkdir()
        _fill(full)
        with pytest.raises(ConfigError, match="No space left on device") as exc:
            ckpt.DirLock.acquire(full / "ck")
        _one_line(exc)
        assert sorted(p.name for p in (full / "ck").iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], check=False)


_CONTENDER = """
import sys
from pathlib import Path
from ddp import checkpoint as ckpt
from ddp.errors import ConfigError
try:
    lock = ckpt.DirLock.acquire(Path(sys.argv[1]))
except ConfigError:
    print("refused", flush=True)
    sys.exit(0)
print("got", flush=True)
sys.stdin.read()
lock.release()
"""


def test_runs_racing_for_a_stale_lock_get_it_once(tmp_path: Path) -> None:
    """Four runs start at once on a directory whose owner died: exactly one gets it."""
    d = tmp_path / "ck"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    _crafted(d, pid=int(dead))
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONTENDER, str(d)], env=_launch.base_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]  # fmt: skip
    said = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.communicate("", timeout=60)
    assert sorted(said) == ["got", "refused", "refused", "refused"], said


def test_the_owner_heartbeat_moves_its_counter(tmp_path: Path) -> None:
    """What another host watches: the counter in the file, not the file's mtime."""
    d = tmp_path / "ck"
    with _Owner(d, interval=0.05):
        first = _lock_info(d)["beat"]
        deadline = time.monotonic() + 30  # against a true hang only
        while _lock_info(d)["beat"] == first:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)


def test_release_leaves_a_lock_that_another_run_took(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    lock = ckpt.DirLock.acquire(d)
    _crafted(d, host="elsewhere", pid=99)
    lock.release()
    assert _lock_info(d)["host"] == "elsewhere"

