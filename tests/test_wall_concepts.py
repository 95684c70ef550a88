"""Concepts both sides of the wall need are written once, in ``hpc_ddp``, and both use it.

The login side (``hpc``) and the compute side (``ddp``) each carried their own strict YAML
loader (disagreeing 10x on the alias limit), port rule, torchrun variable set, atomic write
and ``flock`` lock, and they had drifted. The grep tests fail when a second copy appears;
the behaviour tests each fail on the code before the shared package.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "src" / "hpc_ddp"

#: Files that may rename with ``os.replace`` themselves, each with the reason it is not
#: one small file written whole (which is what ``hpc_ddp.files.write_atomic`` is for).
REPLACE_ALLOWED = {
    "hpc/stage.py": "streams a virtual environment into a tar archive (tarfile), then renames",
    "src/ddp/data/store.py": "streams two token files side by side, then renames both",
    "src/ddp/data/store_write.py": "swaps a whole store folder (the old kept until the new is)",
    "src/ddp/data/download.py": "a resumable download's .part file, kept between tries",
    "src/ddp/checkpoint/manager_save.py": "renames a sharded checkpoint's staging folder",
    "src/ddp/checkpoint/format_write.py": "renames a checkpoint's per-rank folder",
    "src/ddp/checkpoint/format.py": "moves a checkpoint folder aside before deleting it",
    "src/ddp/recipes/distill.py": "swaps a sentence-transformers export folder",
}

#: Each concept: a pattern that marks a copy of it, and the files outside ``hpc_ddp`` that
#: may hold it (with the reason).
ONE_HOME: dict[str, tuple[str, dict[str, str]]] = {
    "file locks": (
        r"\bfcntl\.flock\b|^\s*import fcntl\b",
        {"src/ddp/rank_logs.py": "fcntl.ioctl(FIONREAD) on a pipe, not a lock"},
    ),
    # hpc_ddp.files.open_regular: the regular-file check on an open descriptor
    "untrusted read": (
        r"S_ISFIFO\(|[\"']a named pipe",
        {
            "src/ddp/supervise_evidence.py": "writes to the flight recorder's pipe, which must be one"
        },
    ),
    "strict YAML loader": (
        r"SafeLoader|construct_mapping|\byaml\.load\(|\byaml\.safe_load\(|add_constructor",
        {},
    ),
    "atomic write": (r"\bos\.replace\(", REPLACE_ALLOWED),
    # hpc_ddp.procs: a process's state and start time (/proc/PID/stat fields 3 and 22),
    # which tell a pid reused by another process from the one recorded
    "process identity": (
        r"\.split\(\)\[19\]|fields\[19\]|(rsplit|rpartition)\([\"']\)[\"']",
        {},
    ),
    "port rule": (r"\b29500\b|%\s*PORT_SPAN|PORT_BASE\s*=", {}),
    "torchrun variable set": (r"[\"']MASTER_PORT[\"']\s*:\s*str\(|ROLE_WORLD_SIZE\s*=", {}),
    # hpc_ddp.run_layout: the files the compute side writes and the login side reads back
    "run directory layout": (
        r"[\"'](metrics\.jsonl|run\.json)[\"']|/ [\"'](heartbeats|failures|ranks|checkpoints)[\"']",
        {"src/ddp/recipes/backbones.py": "torch hub's own cache folder, not a run directory"},
    ),
}


def _sources() -> list[Path]:
    files = [*(ROOT / "hpc").rglob("*.py"), *(ROOT / "src" / "ddp").rglob("*.py")]
    return [f for f in files if "__pycache__" not in f.parts]


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines that are code: comments and docstring-only lines name a concept, not copy it."""
    out = []
    in_doc = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""') + stripped.count("'''")
        if in_doc or stripped.startswith(('"""', "'''", "#")):
            if quotes % 2 == 1:
                in_doc = not in_doc
            continue
        out.append((number, line.split("  #")[0]))
    return out


@pytest.mark.parametrize("concept", sorted(ONE_HOME))
def test_each_concept_is_written_only_in_the_shared_package(concept: str) -> None:
    pattern, allowed = ONE_HOME[concept]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _sources()
        if str(path.relative_to(ROOT)) not in allowed
        for number, line in _code_lines(path)
        if re.search(pattern, line)
    ]
    assert not found, f"{concept}: a copy outside src/hpc_ddp (use hpc_ddp):\n" + "\n".join(found)
    home = "\n".join(line for f in SHARED.glob("*.py") for _, line in _code_lines(f))
    assert re.search(pattern, home, re.M), f"{concept}: not found in src/hpc_ddp either"
    for name in allowed:  # an exception that no longer holds the pattern is stale
        assert re.search(pattern, (ROOT / name).read_text(encoding="utf-8"), re.M), name


def test_the_alias_limit_is_one_number_on_both_sides() -> None:
    from ddp import yaml_io
    from hpc import _util
    from hpc_ddp import strict_yaml

    assert _util.MAX_YAML_NODES == yaml_io.MAX_NODES == strict_yaml.MAX_NODES == 100_000


def _wide(values: int) -> str:
    """A config whose aliases expand to about ``values`` values (between the two old
    limits, 100,000 for specs and 1,000,000 for configs)."""
    return (
        "a: &a [" + ", ".join(["1"] * 500) + "]\nb: [" + ", ".join(["*a"] * (values // 500)) + "]\n"
    )


def test_a_config_between_the_old_limits_is_refused_as_a_spec_is(tmp_path: Path) -> None:
    from ddp import yaml_io
    from ddp.errors import ConfigError
    from hpc._util import load_yaml
    from hpc.errors import UserError

    path = tmp_path / "wide.yaml"
    path.write_text(_wide(150_000))
    with pytest.raises(ConfigError, match=r"more than 100,000 values once aliases are expanded"):
        yaml_io.load_file(path)
    with pytest.raises(UserError, match=r"more than 100,000 values once aliases are expanded"):
        load_yaml(path, "spec")
    assert len(yaml_io.loads(_wide(50_000))["b"]) == 100  # under the limit: read as before


def test_an_alias_to_itself_is_the_same_one_line_on_both_sides(tmp_path: Path) -> None:
    from ddp import yaml_io
    from ddp.errors import ConfigError
    from hpc._util import load_yaml
    from hpc.errors import UserError

    path = tmp_path / "self.yaml"
    path.write_text("x: 1\na: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"line 2: an alias refers to itself$"):
        yaml_io.load_file(path)
    with pytest.raises(UserError, match=r"line 2: an alias refers to itself$"):
        load_yaml(path, "spec")


def test_the_login_side_derives_the_port_as_the_compute_side_does() -> None:
    """A PBS id such as ``12345.pbs01``: the login side used to take every digit
    (1234501), the compute side the leading number (12345)."""
    from ddp.env import detect
    from hpc.executors.ranks import rank_env

    job = SimpleNamespace(
        job_id="12345.pbs01",
        hostnames=["n0", "n1"],
        num_nodes=2,
        num_tasks=4,
        global_rank=3,
        local_rank=1,
        node=1,
    )
    login = rank_env(job)
    compute = detect(
        {
            "PBS_JOBID": "12345.pbs01",
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "PMI_LOCAL_RANK": "1",
            "PMI_LOCAL_SIZE": "2",
            "PALS_RANKID": "3",
            "PALS_LOCAL_RANKID": "1",
            "PALS_NODEID": "1",
            "MASTER_ADDR": "n0",
        },
        [],
    )
    assert login["MASTER_PORT"] == str(compute.master_port) == str(20000 + 12345 % 9000)
    # the same variable set, from the same function
    assert login == compute.torchrun_vars()


def test_the_supervisor_never_writes_through_a_link_planted_at_a_temp_name(
    tmp_path: Path,
) -> None:
    """The supervisor wrote ``.run.json.supervise.tmp`` (a fixed name) and renamed it: a
    link planted there sent its record into the file the link names."""
    from ddp.supervise import record

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".run.json.supervise.tmp").symlink_to(victim)
    record(run, {"event": "restart"})
    assert victim.read_text() == "keep\n"
    assert '"restart"' in (run / "run.json").read_text()


def test_the_login_side_lock_is_the_lock_the_supervisor_takes(tmp_path: Path) -> None:
    from hpc.runs import LOCK, locked

    with locked(tmp_path):
        fd = os.open(tmp_path / LOCK, os.O_WRONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert LOCK == ".lock"  # ddp.supervise.record locks run_dir / ".lock"


def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    from hpc_ddp.files import NotLockable, acquire_lock

    with pytest.raises(NotLockable):
        acquire_lock("/dev/null")  # a device: opened, then refused on its fstat
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):  # ENXIO at once (no reader), never a blocked open
        acquire_lock(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        acquire_lock(tmp_path / "link")
    assert not (tmp_path / "target").exists()


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path: Path) -> None:
    from hpc_ddp.files import write_atomic

    write_atomic(tmp_path / "f", "old")
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "f", 42)  # type: ignore[arg-type]
    assert (tmp_path / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_umask_is_read_without_changing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting the umask to read it would leave other threads a window with none."""
    from hpc_ddp import files

    if not Path("/proc/self/status").is_file():
        pytest.skip("no /proc: the portable set-and-restore is all there is")
    old = os.umask(0o027)
    try:
        calls: list[int] = []
        monkeypatch.setattr(files.os, "umask", lambda m: calls.append(m) or 0)
        assert files.umask() == 0o027 and calls == []
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_a_process_is_named_by_its_pid_and_start_time() -> None:
    """hpc_ddp.procs: the pid alone is not the process; the pair is. One definition for a
    local job's id, a checkpoint lock's owner and a rank's heartbeat."""
    import subprocess
    import sys

    from hpc_ddp.procs import process_start, process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(child.pid)
        assert isinstance(start, int) and start >= (process_start(os.getpid()) or 0)
        assert process_state(child.pid, start) not in (None, "Z")
        assert process_state(child.pid, None) not in (None, "Z")
        assert process_state(child.pid, start + 1) is None  # the pid reused by another process
        assert process_state(0, None) is None and process_state(-1, None) is None  # groups
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None and process_state(child.pid, start) is None
