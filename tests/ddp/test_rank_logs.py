"""Per-rank logs (``ddp.rank_logs``) on 2 real Gloo ranks, and ``hpc logs --rank/--grep``.

The real SLURM with 2 nodes x 2 ranks: tests/test_e2e_rank_logs.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp.fingerprint import node_name
from tests.ddp import _launch
from tests.support.polling import wait_until

ROOT = _launch.ROOT

#: Python, C-level (os.write) and stderr lines, then rank 1 crashes.
PROBE = """\
import os, sys
import ddp
ctx = ddp.init()
r = ctx.rank
print(f"py-out-from-rank-{r}")
print(f"py-err-from-rank-{r}", file=sys.stderr)
os.write(1, f"fd-out-from-rank-{r}\\n".encode())
ddp.barrier()
if r == 1:
    raise RuntimeError("crash-on-rank-1")
ddp.shutdown()
"""


def _hpc(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")
    return subprocess.run(
        [sys.executable, "-m", "hpc", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, list[tuple[int, str, str]]]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.environ.update(DDP_RANK_LOGS="1", HPC_RUN_DIR=str(run_dir))
    try:
        procs = _launch.start([str(probe)], world=2)
    finally:
        del os.environ["DDP_RANK_LOGS"], os.environ["HPC_RUN_DIR"]
    results = _launch.finish(procs, timeout=120)
    assert results[0][0] == 0 and results[1][0] != 0, results
    # tee drains its pipe after the rank has gone: wait for the crash's last line
    last = run_dir / "ranks" / "rank-00001.log"
    wait_until(
        lambda: last.is_file() and "crash-on-rank-1" in last.read_text(),
        30,
        "rank 1's traceback in its log",
    )
    return run_dir, results


def test_each_rank_file_holds_only_its_own_lines(run: tuple[Path, list]) -> None:
    run_dir, results = run
    files = sorted((run_dir / "ranks").iterdir())
    assert [f.name for f in files] == ["rank-00000.log", "rank-00001.log"]
    for rank, path in enumerate(files):
        text = path.read_text()
        assert text.startswith(f"# rank {rank} of 2 on {node_name()} (pid ")
        for kind in ("py-out", "py-err", "fd-out"):
            assert f"{kind}-from-rank-{rank}" in text
            assert f"{kind}-from-rank-{1 - rank}" not in text
    assert "RuntimeError: crash-on-rank-1" in files[1].read_text()
    # the job log still has rank 0's stdout and every rank's stderr (tee), not rank 1's stdout
    out0, err1 = results[0][1], results[1][2]
    assert "py-out-from-rank-0" in out0 and "fd-out-from-rank-0" in out0
    assert "py-out-from-rank-1" not in results[1][1]
    assert "py-err-from-rank-1" in err1 and "crash-on-rank-1" in err1


def test_hpc_logs_rank_and_grep(run: tuple[Path, list]) -> None:
    run_dir, _ = run
    shown = _hpc("logs", str(run_dir), "--rank", "1")
    assert shown.returncode == 0 and "crash-on-rank-1" in shown.stdout
    assert "from-rank-0" not in shown.stdout
    found = _hpc("logs", str(run_dir), "--grep", "crash-on-rank")
    assert found.returncode == 0
    assert f"rank 1 ({node_name()}): [rank1]: RuntimeError: crash-on-rank-1" in found.stdout
    assert f"found in rank 1 ({node_name()})" in found.stderr
    assert _hpc("logs", str(run_dir), "--grep", "no such text").returncode == 1
    for args, says in [
        (["--rank", "7"], "allowed: ranks 0-1"),
        (["--rank", "-1"], "a rank >= 0"),
        (["--grep", ""], "empty --grep"),
    ]:
        bad = _hpc("logs", str(run_dir), *args)
        assert bad.returncode == 2 and says in bad.stderr and bad.stderr.count("\n") == 1, bad


def test_no_per_rank_logs_is_one_line(tmp_path: Path) -> None:
    bad = _hpc("logs", str(tmp_path), "--rank", "0")
    assert bad.returncode == 2 and "no per-rank logs" in bad.stderr


#: A rank that prints its last lines and dies (by an uncaught exception, or by ddp's own
#: ``parts.die``, which ends in ``os._exit``); with "child", a child the rank started
#: keeps the pipes open. It writes the time to GATE just before it dies.
LAST_WORDS = """\
import os, subprocess, sys, time
from pathlib import Path
from ddp import rank_logs
from ddp.parts import die
rank_logs.DRAIN_S = 60.0
rank_logs.redirect(0, 1)
how, gate = sys.argv[1], Path(sys.argv[2])
if how == "child":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("last-out-line")
if how == "closed":  # a program that shuts its own stdout (a daemon, a closed pager)
    sys.stdout.flush()
    os.close(1)
gate.write_text(repr(time.time()))
if how == "die":
    die(0, RuntimeError("last-err-line"))
raise RuntimeError("last-err-line")
"""


#: A tee that, like a real one descheduled on a busy node, holds what it read for a while
#: before writing it: longer than ddp.rank_logs.GRACE_S, so only a drain that knows
#: whether the tee is back in read(2) keeps the last lines.
SLOW_TEE = """\
import os, sys, time
fds = [1] + [os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) for p in sys.argv[1:] if p != "-a"]
while chunk := os.read(0, 65536):
    time.sleep(1.0)
    for fd in fds:
        os.write(fd, chunk)
"""


def _late_tee(tmp_path: Path, gate: Path, slow: bool = False) -> dict[str, str]:
    """An environment whose ``tee`` starts copying only once the rank has begun to die
    (GATE exists), as a tee stalled by a busy file system would; ``slow``: and holds
    each chunk it read for a second before writing it."""
    real = shutil.which("tee")
    assert real is not None
    shim = tmp_path / "bin" / "tee"
    shim.parent.mkdir()
    q = shlex.quote
    copier = q(real)
    if slow:
        (tmp_path / "bin" / "slow_tee.py").write_text(SLOW_TEE)
        copier = f"{q(sys.executable)} {q(str(tmp_path / 'bin' / 'slow_tee.py'))}"
    shim.write_text(
        f'#!/bin/sh\nwhile [ ! -e {q(str(gate))} ]; do sleep 0.2; done\nexec {copier} "$@"\n'
    )
    shim.chmod(0o755)
    return dict(
        _launch.base_env(),
        PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        HPC_RUN_DIR=str(tmp_path / "run"),
    )


@pytest.mark.parametrize(
    ("how", "tee"),
    [("raise", "late"), ("die", "late"), ("child", "late"), ("closed", "late")]
    + [("raise", "slow"), ("child", "slow")],
)
def test_a_dying_rank_exits_after_its_last_lines_are_in_both_places(
    tmp_path: Path, how: str, tee: str
) -> None:
    """Read the moment the rank has exited, as a launcher that then ends the step would.
    A child holding the pipes (a DataLoader worker, a resource tracker) does not make
    the exit wait DRAIN_S (60 s here). A rank that closed its own stdout still drains
    its stderr. A tee slower than the grace between its read and its write (a busy
    node) still has every line written before the rank exits."""
    script, gate = tmp_path / "last_words.py", tmp_path / "last-words-at"
    script.write_text(LAST_WORDS)
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            [sys.executable, str(script), how, str(gate)],
            env=_late_tee(tmp_path, gate, slow=tee == "slow"),
            stdout=fo,
            stderr=fe,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=120)
            exited = time.time()
        finally:
            if how == "child":  # the sleeping child is in the rank's session
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 1
    text = (tmp_path / "run" / "ranks" / "rank-00000.log").read_text()
    assert "last-out-line" in text and "RuntimeError: last-err-line" in text, text
    assert "last-out-line" in out.read_text()
    assert "RuntimeError: last-err-line" in err.read_text()
    assert "Exception ignored" not in text + err.read_text()
    assert exited - float(gate.read_text()) < 30  # DRAIN_S is 60
