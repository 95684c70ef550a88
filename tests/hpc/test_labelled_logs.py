"""Rank-labelled merged job logs (issue 31): where per-rank files are off, ``hpc logs
--rank N`` and ``--grep`` read the launcher's labels (srun/PALS ``N: ``, hydra ``[N] ``).

The labels here are the launchers' own: MPICH hydra's ``-prepend-rank`` and the PALS
shim's ``--label`` run for real (tests/support/pals); srun's is on the real SLURM in
tests/test_e2e_rank_logs.py."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest

from hpc import logs
from hpc.cli import main
from hpc.errors import UserError

PRINT = 'echo "out of $PMI_RANK"; echo "err of $PMI_RANK" >&2; echo "  0: not a label"'


def _launch(argv: list[str], path: Path, env_path: str | None = None) -> None:
    env = dict(os.environ, PATH=env_path or os.environ["PATH"])
    with path.open("wb") as fh:
        subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, check=True, timeout=120)


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


@pytest.mark.parametrize("launcher", ["hydra", "pals"])
def test_rank_and_grep_read_a_labelled_merged_log(
    launcher: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = _run_dir(tmp_path)
    log = run / "job-7.out"
    if launcher == "hydra":
        hydra = next(
            (
                p
                for p in ("/usr/bin/mpiexec.hydra", "/usr/bin/mpiexec.mpich")
                if os.access(p, os.X_OK)
            ),
            None,
        )
        if hydra is None:
            pytest.skip("MPICH hydra not installed")
        _launch([hydra, "-n", "3", "-prepend-rank", "bash", "-c", PRINT], log)
    else:
        shim = request.getfixturevalue("pals_mpiexec")
        _launch(
            ["mpiexec", "-n", "3", "--ppn", "3", "--label", "--line-buffer", "bash", "-c", PRINT],
            log,
            f"{shim}{os.pathsep}{os.environ['PATH']}",
        )
        assert "1: out of 1" in log.read_text()  # PALS's format, not hydra's [1]
    with log.open("a") as fh:
        fh.write("a batch script line without a label\n")
    out = io.StringIO()
    logs.print_rank(run, 1, out)
    # rank 1's lines only, labels removed; its own "  0: ..." is text, not a label
    assert sorted(out.getvalue().splitlines()) == ["  0: not a label", "err of 1", "out of 1"]
    assert main(["logs", str(run), "--grep", "err of 2"]) == 0
    got = capsys.readouterr()
    assert got.out == "rank 2 (?): err of 2\n" and "found in rank 2 (?)" in got.err
    with pytest.raises(UserError, match="no line of rank 5 .* allowed: ranks 0-2"):
        logs.print_rank(run, 5, io.StringIO())


def test_an_unlabelled_log_is_one_line_naming_both_ways(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "job-7.out").write_text("hello\n[x] no\n")
    with pytest.raises(UserError, match="no per-rank logs and its job log has no rank labels"):
        logs.print_rank(run, 0, io.StringIO())
    with pytest.raises(UserError, match="no rank labels"):
        logs.grep(run, "hello", io.StringIO())


def test_hosts_come_from_the_trainers_ranks_file(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "job-7.out").write_bytes(b"0: a\n1: needle \xff\n")
    (run / "ranks.jsonl").write_text('{"kind": "hosts", "hosts": ["n1", "n2"]}\n')
    out = io.StringIO()
    assert logs.grep(run, "needle", out) == [(1, "n2")]
    assert out.getvalue() == "rank 1 (n2): needle \ufffd\n"
