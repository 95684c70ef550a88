"""Issue 24, checkpoints under hostile input: the directory lock against skewed clocks,
empty, damaged or odd lock files and races; full disks during sharded saves; resumes
of another model shape with FSDP; crafted meta fields; config numbers that overflow."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddp import checkpoint as ckpt
from ddp.checkpoint.loop import TrainState
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
            env=_launch.base_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
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
    [
        (b"", "empty"),
        (b"\x00\xff garbage", "damaged"),
        (b"[1, 2]", "damaged"),
        (b'{"host": "h", "pid": "12"}', "damaged"),
        (b'{"host": "h", "pid": 1e400}', "damaged"),
        (b'{"host": "h", "pid": 123456789012345678901234567890}', "damaged"),
        (b'{"host": ["h"], "pid": 12}', "damaged"),
    ],
)
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
        except BaseException as exc:
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
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


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
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    _crafted(d, pid=int(dead))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTENDER, str(d)],
            env=_launch.base_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
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


def test_a_checkpoint_dir_that_is_an_hpc_run_directory_keeps_hpcs_lock_file(
    tmp_path: Path,
) -> None:
    """``checkpoint.dir: .`` under ``hpc submit``: the run directory holds hpc's own
    (empty) ``.lock``, a flock file. The checkpoint lock is a file of its own."""
    hpc_lock = tmp_path / ".lock"
    hpc_lock.write_bytes(b"")
    lock = ckpt.DirLock.acquire(tmp_path)
    try:
        assert hpc_lock.read_bytes() == b"" and _lock_info(tmp_path)["pid"] == os.getpid()
    finally:
        lock.release()
    assert hpc_lock.exists() and not (tmp_path / ckpt.LOCK).exists()


def test_release_leaves_a_lock_that_another_run_took(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    lock = ckpt.DirLock.acquire(d)
    _crafted(d, host="elsewhere", pid=99)
    lock.release()
    assert _lock_info(d)["host"] == "elsewhere"


# ---- one rank's checkpoints, written by the Checkpointer itself ---------------------------
def _checkpointer(ck: Path, strategy: str = "ddp", width: int = 16, background: bool = True):
    """A Checkpointer on one rank (no process group), its loop state and model."""
    from torch import nn

    from ddp.checkpoint.manager import Checkpointer
    from ddp.config import TrainConfig
    from ddp.dist import Context

    cfg = TrainConfig.from_dict({"ddp": {"strategy": strategy}, "checkpoint": {"dir": str(ck)}})
    ctx = Context(0, 0, 1, 1, 0, torch.device("cpu"), "gloo", "none", "127.0.0.1", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loop = _loop(opt, sched)
    return Checkpointer(cfg, ctx, background), loop, model


def _loop(opt: torch.optim.Optimizer, sched: object):
    from ddp.checkpoint.manager import LoopState

    return LoopState(0, 0, 3, 10, 0, opt, sched, None)


def _resume(cp, model) -> dict:
    """What a resumed run does with ``cp``'s checkpoint: find, check and restore it all."""
    state = cp.load()
    assert state is not None
    cp.restore_model(state, model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cp.restore_loop(state, _loop(opt, sched), 0.01, model)
    return state


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resume_with_another_model_shape_is_one_line(tmp_path: Path, strategy: str) -> None:
    """FSDP names the first mismatched key and both shapes, as DDP does (no DCP traceback)."""
    cp, loop, model = _checkpointer(tmp_path, strategy, background=False)
    cp.save(loop, model, TrainState(3))
    other, _, wider = _checkpointer(tmp_path, strategy, width=32)
    with pytest.raises(ConfigError, match="different model") as exc:
        _resume(other, wider)
    line = _one_line(exc)
    assert "'0.weight' is (16, 8) in the checkpoint and (32, 8) in this model" in line, line


def _rewrite(path: Path, change) -> None:
    """Load a checkpoint file, ``change`` its dict, write it back with a matching digest
    (a crafted file, or one damaged before its digest was taken)."""
    import hashlib

    obj = torch.load(path, weights_only=True)
    change(obj)
    torch.save(obj, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(digest + "\n")


def old_layout(checkpoint: Path) -> None:
    """Turn a checkpoint into the layout written before rank files (format 2): every
    rank's RNG states in one list (``rng``) of its file (or meta.pt), every shard's
    digest in meta.pt; its rank files gone."""
    import shutil

    ranks = ckpt.rank_dir(checkpoint)
    states = [
        ckpt.read_rank_state(checkpoint, r, _saved(checkpoint))
        for r in range(_saved(checkpoint)["world_size"])
    ]

    def change(obj: dict) -> None:
        obj["format"] = 2
        obj["rng"] = [s["rank_rng"] for s in states]
        del obj["rank_files"]
        for s in states:
            obj.get("shards", {}).update(s.get("rank_shards") or {})

    _rewrite(checkpoint / ckpt.META if checkpoint.is_dir() else checkpoint, change)
    if checkpoint.is_dir():
        for f in ranks.glob("rank_*.pt"):
            f.unlink()
    else:
        shutil.rmtree(ranks)


def _saved(checkpoint: Path) -> dict:
    return torch.load(
        checkpoint / ckpt.META if checkpoint.is_dir() else checkpoint, weights_only=True
    )


def _set(key: str, value: object):
    """A change that sets ``a/b/0/c`` (a digit indexes a list, or a dict with int keys)."""

    def index(node: object, part: str) -> object:
        return (
            int(part)
            if part.isdigit() and (isinstance(node, list) or int(part) in node or part not in node)
            else part
        )

    def change(obj: dict) -> None:
        *path, last = key.split("/")
        node: object = obj
        for part in path:
            node = node[index(node, part)]  # type: ignore[index]
        node[index(node, last)] = value  # type: ignore[index]

    return change


_BAD_FIELDS = [
    ("global_step", "5"),
    ("global_step", -1),
    ("global_step", float("nan")),
    ("global_step", [3]),
    ("global_step", True),
    ("global_step", 2**70),
    ("epoch", 1.5),
    ("phase", "0"),
    ("batches_in_epoch", -2),
    ("samples_in_epoch", "12"),
    ("world_size", 0),
    ("format", "2"),
    ("format", 99),
    ("phase_start_step", 10**6),
    ("rng", "x"),
    ("rng/0", [1, 2]),
    ("rng/0/python", (3, (1, 2), None)),
    ("rng/0/torch", torch.zeros(3, dtype=torch.uint8)),
    ("rng/0/numpy", ("MT19937", [1], 0, 0, 0.0)),
    ("rng/0/python", "seed"),
    ("config", "x"),
    ("config/optim/lr", torch.ones(2)),
    ("scheduler", [1]),
    ("scaler", 3),
]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("key, value", _BAD_FIELDS, ids=[f"{k}={v!r:.20}" for k, v in _BAD_FIELDS])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(
    tmp_path: Path, strategy: str, key: str, value: object
) -> None:
    """In a plain checkpoint and in a sharded one's meta.pt: checkpoint.resume=PATH stops
    with one line naming the field; auto-resume skips it for the one before."""
    cp, loop, model = _checkpointer(tmp_path, strategy, background=False)
    cp.save(loop, model, TrainState(2))
    cp.save(loop, model, TrainState(3))
    newest = ckpt.find_latest(tmp_path)
    assert newest is not None
    if key.startswith("rng/"):  # every rank's states in one list: the layout before rank files
        old_layout(newest)
    _rewrite(newest / ckpt.META if newest.is_dir() else newest, _set(key, value))
    field = key.split("/")[0]
    with pytest.raises(ConfigError, match=field) as exc:
        ckpt.load_checkpoint(newest)
    assert str(newest) in _one_line(exc)
    path, state = ckpt.load_latest(tmp_path)  # type: ignore[misc]
    assert state["global_step"] == 2


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("scheduler/last_epoch", "7", "scheduler.last_epoch"),
        ("scheduler/base_lrs", [0.1, 0.2], "scheduler.base_lrs"),
        ("optimizer/param_groups/0/lr", "fast", r"optimizer.param_groups\[0\].lr"),
        ("optimizer/param_groups/0/params", [0], "params"),
        ("optimizer/state/0/exp_avg", torch.zeros(3), "exp_avg"),
        ("optimizer/state/9", {"step": torch.tensor(1.0)}, r"optimizer.state\[9\]"),
        ("config/training/batch_size", "abc", "training.batch_size"),
        ("model", {}, "different model"),
        ("scheduler", {}, None),
    ],
)
def test_the_loop_and_optimizer_state_are_checked_before_use(
    tmp_path: Path, key: str, value: object, needle: str | None
) -> None:
    """What the restore hands to torch (scheduler, optimizer, scaler) and the saved config
    fit this run's objects, or one line names the first part that does not."""
    cp, loop, model = _checkpointer(tmp_path, background=False)
    cp.save(loop, model, TrainState(3))
    _rewrite(ckpt.step_path(tmp_path, 3), _set(key, value))
    fresh, _, again = _checkpointer(tmp_path)
    if needle is None:  # nothing saved to check against: the run's own values stay
        _resume(fresh, again)
        return
    with pytest.raises(ConfigError, match=needle) as exc:
        _resume(fresh, again)
    _one_line(exc)


def test_a_sharded_checkpoint_whose_shards_are_not_a_mapping_is_one_line(tmp_path: Path) -> None:
    cp, loop, model = _checkpointer(tmp_path, "fsdp", background=False)
    cp.save(loop, model, TrainState(3))
    _rewrite(ckpt.sharded_path(tmp_path, 3) / ckpt.META, _set("shards", ["__0_0.distcp"]))
    with pytest.raises(ConfigError, match="shards") as exc:
        ckpt.load_checkpoint(ckpt.sharded_path(tmp_path, 3))
    _one_line(exc)


def _bounded(fn):
    """Run ``fn`` in a thread; (finished, its result or exception). A pipe opened for
    reading waits for a writer: the bound is against that hang only."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    return (not t.is_alive()), (box[0] if box else None)


@pytest.mark.parametrize("which", ["latest", "digest", "checkpoint"])
def test_a_named_pipe_in_a_checkpoint_directory_never_hangs(tmp_path: Path, which: str) -> None:
    ckpt.save_checkpoint({"global_step": 1}, tmp_path, 1)
    ckpt.save_checkpoint({"global_step": 2}, tmp_path, 2)
    newest = ckpt.step_path(tmp_path, 2)
    victim = {
        "latest": tmp_path / "latest",
        "digest": newest.with_name(newest.name + ".sha256"),
        "checkpoint": newest,
    }[which]
    victim.unlink()
    os.mkfifo(victim)
    try:
        done, found = _bounded(lambda: ckpt.load_latest(tmp_path))
        assert done, "load_latest hung on a named pipe"
        assert not isinstance(found, BaseException), repr(found)
        assert found[1]["global_step"] == (2 if which == "latest" else 1)
        if which != "latest":
            done, err = _bounded(lambda: ckpt.load_checkpoint(newest))
            assert done, "load_checkpoint hung on a named pipe"
            assert isinstance(err, ConfigError) and "named pipe" in str(err), repr(err)
    finally:
        with contextlib.suppress(OSError):  # release a reader left hanging (old code)
            os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))


# ---- a full disk during a save: one line, the previous checkpoint intact and latest ------
def _full_disk_save(tmp_path: Path, strategy: str, fill) -> tuple[Path, object]:
    """Save step 2 on a small tmpfs, ``fill`` it, save step 4 in the background: the
    checkpoint directory and what the second save raised (from save() or wait())."""
    full = tmp_path / "full"
    _mount_tmpfs(full, "2m")
    ck = full / "ck"
    cp, loop, model = _checkpointer(ck, strategy, width=1024)  # 32 KiB tensors
    cp.save(loop, model, TrainState(2))
    cp.wait()
    fill(full)
    try:
        cp.save(loop, model, TrainState(4))
        cp.wait()
    except Exception as exc:
        return ck, exc
    return ck, None


def _assert_kept(ck: Path, err: object, strategy: str) -> None:
    assert isinstance(err, ConfigError), repr(err)
    line = str(err)
    assert "\n" not in line and "No space left on device" in line, line
    assert f"checkpoint.dir {str(ck)!r}" in line and "earlier checkpoints are kept" in line, line
    first = ckpt.sharded_path(ck, 2) if strategy == "fsdp" else ckpt.step_path(ck, 2)
    assert (ck / "latest").read_text().strip() == first.name
    assert ckpt.load_checkpoint(first)["global_step"] == 2  # intact: digests match
    left = sorted(p.name for p in ck.iterdir())
    assert left == sorted(
        [first.name, "latest", ".lock"]
        if (ck / ".lock").exists()
        else [first.name, "latest"]
        + ([first.name + ".sha256", ckpt.rank_dir(first).name] if strategy == "ddp" else [])
    ), left


@pytest.mark.parametrize("leave", [0, 16 << 10, 40 << 10])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_full_disk_during_a_background_save_is_one_line(
    tmp_path: Path, strategy: str, leave: int
) -> None:
    """The disk fills up while the shards (or the file) are written: torch's own writer
    says "unexpected pos"; the line says what the file system said, and where."""
    try:
        ck, err = _full_disk_save(tmp_path, strategy, lambda m: _fill(m, leave))
        _assert_kept(ck, err, strategy)
    finally:
        subprocess.run(["umount", str(tmp_path / "full")], check=False)


@pytest.mark.parametrize("leave", [0, 4 << 10])  # meta.pt: one page, its digest another
def test_a_full_disk_while_the_meta_file_is_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leave: int
) -> None:
    """Every shard is written; the disk fills just before rank 0 writes meta.pt."""
    real = ckpt.atomic_save_digested
    mount = tmp_path / "full"

    def fill_then_save(obj: object, path: Path) -> None:
        if obj.get("global_step") == 4:  # type: ignore[attr-defined]
            _fill(mount, leave)
        real(obj, path)

    monkeypatch.setattr(ckpt, "atomic_save_digested", fill_then_save)
    try:
        ck, err = _full_disk_save(tmp_path, "fsdp", lambda m: None)
        _assert_kept(ck, err, "fsdp")
        assert str(ck / ".step_000000004.tmp" / "meta.pt") in str(err) or "meta.pt" in str(err)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_full_disk_during_the_final_export_is_one_line(tmp_path: Path, strategy: str) -> None:
    full = tmp_path / "full"
    _mount_tmpfs(full, "2m")
    try:
        cp, _, model = _checkpointer(full / "ck", strategy, width=1024)
        _fill(full, 16 << 10)
        with pytest.raises(ConfigError, match="No space left on device") as exc:
            cp.export(model, 7)
        assert "final" in _one_line(exc)
        assert not (full / "ck" / "final" / "model.pt").exists()
        assert not [p for p in (full / "ck" / "final").iterdir() if p.name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(full)], check=False)


# ---- the same through python -m ddp: exit 2, one line -------------------------------------
def _python_m_ddp(cwd: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [
        a
        for s in ("training.max_steps=2", "ddp.strategy=fsdp", "checkpoint.dir=ck", *sets)
        for a in ("--set", s)
    ]
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "uniref50-tiny.yaml")
    return subprocess.run(
        [sys.executable, "-m", "ddp", "uniref50", "--config", tiny, *args],
        env=_launch.base_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_python_m_ddp_fsdp_resumes_of_another_shape_or_a_crafted_meta_are_one_line(
    tmp_path: Path,
) -> None:
    first = _python_m_ddp(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    proc = _python_m_ddp(tmp_path, "model.d_model=32", "training.max_steps=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different model" in lines[0], proc.stderr
    assert "in the checkpoint and" in lines[0] and "in this model" in lines[0], lines
    newest = ckpt.find_latest(tmp_path / "ck")
    assert newest is not None and newest.is_dir()
    _rewrite(newest / ckpt.META, _set("global_step", "2"))
    proc = _python_m_ddp(tmp_path, "training.max_steps=4", f"checkpoint.resume={newest}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "global_step: '2'" in lines[0], proc.stderr


def test_a_plain_checkpoint_cannot_point_the_loader_at_unchecked_shards(tmp_path: Path) -> None:
    """``sharded`` is set by the loader once it checked a directory's digests; a file that
    brings its own would send the restore to any directory, its shards unchecked."""
    cp, loop, model = _checkpointer(tmp_path, background=False)
    cp.save(loop, model, TrainState(3))
    _rewrite(ckpt.step_path(tmp_path, 3), _set("sharded", str(tmp_path / "elsewhere")))
    with pytest.raises(ConfigError, match="sharded") as exc:
        ckpt.load_checkpoint(ckpt.step_path(tmp_path, 3))
    _one_line(exc)
    assert ckpt.load_latest(tmp_path) is None


def test_crafted_shard_metadata_with_matching_digests_is_one_line(tmp_path: Path) -> None:
    import hashlib
    import pickle

    cp, loop, model = _checkpointer(tmp_path, "fsdp", background=False)
    cp.save(loop, model, TrainState(3))
    step = ckpt.sharded_path(tmp_path, 3)
    (step / ".metadata").write_bytes(pickle.dumps({"not": "DCP metadata"}))
    digest = hashlib.sha256((step / ".metadata").read_bytes()).hexdigest()
    _rewrite(step / ckpt.META, _set("shards/.metadata", digest))
    fresh, _, again = _checkpointer(tmp_path, "fsdp")
    with pytest.raises(ConfigError, match="metadata") as exc:
        _resume(fresh, again)
    _one_line(exc)
