"""The request's maximum charge (issue 31 item 4): printed on stderr by submit --dry-run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc.cli import main

SOURCES = {
    "aurora": "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation",
    "polaris": "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation",
    "perlmutter": "https://docs.nersc.gov/policies/charging-policy/",
}  # frontier's factor is cited now: tests/hpc/test_charges_cited.py


def _dry(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["submit", "--dry-run", "--account", "p", "--name", "t", *argv, "--", "true"])
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("cluster", sorted(SOURCES))
def test_builtin_profiles_print_node_hours_and_say_the_factor_is_unverified(
    cluster: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No site factor could be read from these sites' pages, so none is printed as a fact."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _dry(
        capsys, "--cluster", cluster, "--nodes", "2", "--walltime", "00:15:00", "--queue", "debug"
    )
    assert code == 0
    (line,) = [ln for ln in err.splitlines() if "maximum charge" in ln]
    assert "2 nodes x 0.25 h = 0.5 node-hours" in line
    assert "charge factor unverified" in line and SOURCES[cluster] in line
    assert "maximum charge" not in out


def test_generic_profile_says_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _dry(capsys, "--cluster", "slurm", "--nodes", "2")
    assert code == 0 and "charge" not in err


def _profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qfactor: str, mfactor: str) -> None:
    d = tmp_path / ".hpc" / "clusters"
    d.mkdir(parents=True)
    (d / "site.yaml").write_text(
        "extends: perlmutter\n"
        f"charge: {{unit: node-hours, source: https://example.org/c, factor: {mfactor}}}\n"
        f"queues:\n  premium: {{charge_factor: {qfactor}, charge_source: https://example.org/q}}\n"
    )
    monkeypatch.chdir(tmp_path)


def test_cited_factors_multiply_nodes_and_walltime(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _profile(tmp_path, monkeypatch, "2", "0.5")
    code, _, err = _dry(
        capsys, "--cluster", "site", "--nodes", "4", "--walltime", "03:00:00", "--queue", "premium"
    )
    assert code == 0
    m = re.search(r"maximum charge: ([0-9.]+) node-hours", err)
    assert m and float(m.group(1)) == 4 * 3 * 2 * 0.5
    assert "factor 2 x machine factor 0.5" in err and "https://example.org/q" in err


@pytest.mark.parametrize("bad", ["-1", ".nan", "lots", "true"])
def test_bad_factor_is_one_line_exit_2(
    bad: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _profile(tmp_path, monkeypatch, bad, "1")
    code, _, err = _dry(capsys, "--cluster", "site", "--nodes", "1", "--queue", "premium")
    assert code == 2
    assert "charge_factor" in err and "finite number >= 0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _run(tmp_path: Path, scheduler: str) -> Path:
    import json

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "name": "r",
                "scheduler": scheduler,
                "job_id": "12",
                "submissions": [{"job_id": "11", "scheduler": scheduler}],
            }
        )
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in (1, 500))
    )
    return run_dir


def test_used_node_hours_sum_submissions_from_sacct(fake_bin, tmp_path: Path) -> None:
    """Two submissions: 2 nodes x 30 min and 2 nodes x 1 h = 3 node-hours; 500 steps."""
    from hpc.charges import used_lines

    fake_bin(
        "sacct",
        'case "$*" in *"-j 11"*) echo "2026-11-26T10:00:00|2026-11-26T10:30:00|2";;'
        ' *) echo "2026-11-26T11:00:00|2026-11-26T12:00:00|2";; esac',
    )
    lines = used_lines(_run(tmp_path, "slurm"))
    assert "job 11: 2 nodes x 1800 s = 1 node-hours used" in lines
    assert "total: 3 node-hours used over 2 submission(s)" in lines
    assert "per 1,000 completed steps: 6 node-hours (500 steps)" in lines


def test_used_node_hours_without_sacct_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpc.charges import used_lines

    monkeypatch.setenv("PATH", str(tmp_path))
    assert used_lines(_run(tmp_path, "slurm")) == [
        "node-hours: sacct is not on PATH, so the used node-hours cannot be asked"
    ]


#: A fake ``sbank-list-allocations`` printing the table of ALCF's "sbank Example Commands"
#: page (argonne-lcf/user-guides; `sbank-list-allocations -p ProjectX -r all`): columns
#: Id Start End Resource Project Jobs Charged "Available Balance", thousands with commas,
#: then a "Totals:" block. The resource here is aurora with 1,500.5 node hours left.
FAKE_SBANK = r"""
cat <<'OUT'
 Id         Start       End         Resource   Project          Jobs        Charged          Available Balance
 ---------  ----------  ----------  ---------  ---------------  ----------  ---------------  -----------------
 2106       2026-01-04  2027-01-01  aurora     p                     1,139          6,032.8            1,500.5

Totals:
  Rows: 1
  Aurora:
    Available Balance: 1,500.5 node hours
    Charged          : 6,032.8 node hours
    Jobs             : 1,139
OUT
"""


@pytest.mark.parametrize(("nodes", "warned"), [("256", True), ("128", False)])
def test_submit_warns_when_the_request_exceeds_the_sbank_balance(
    nodes: str,
    warned: bool,
    fake_bin,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 nodes x 12 h = 3,072 node-hours > 1,500.5 left; 128 x 1 h = 128 fits."""
    fake_bin("sbank-list-allocations", FAKE_SBANK)
    monkeypatch.chdir(tmp_path)
    wall = "12:00:00" if warned else "01:00:00"
    queue = "prod" if warned else "debug-scaling"
    code, _, err = _dry(
        capsys, "--cluster", "aurora", "--nodes", nodes, "--walltime", wall, "--queue", queue
    )
    assert code == 0, err
    assert "sbank-list-allocations -p p -r aurora" in fake_bin.log.read_text()
    warning = [ln for ln in err.splitlines() if "remaining" in ln]
    if warned:
        assert warning == [
            "hpc: warning: this request may charge up to 3072 node-hours, more "
            "than project p's remaining 1500.5 on aurora (sbank-list-allocations)"
        ]
    else:
        assert warning == []


def test_no_sbank_on_path_says_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _dry(
        capsys, "--cluster", "aurora", "--nodes", "256", "--walltime", "12:00:00", "--queue", "prod"
    )
    assert code == 0 and "remaining" not in err and "sbank" not in err


def test_used_node_hours_from_pbs_qstat_xf(fake_bin, tmp_path: Path) -> None:
    """qstat -xf's `key = value` lines; the time format as OpenPBS prints it (see
    tests/hpc/data/openpbs/deleted-running-exit0.json: "obittime": "Tue Nov 24 21:36:37 2026")."""
    from hpc.charges import used_lines

    fake_bin(
        "qstat",
        'case "$*" in *11*) s="Tue Nov 24 10:00:00 2026"; e="Tue Nov 24 11:00:00 2026";;'
        ' *) s="Tue Nov 24 12:00:00 2026"; e="Tue Nov 24 12:15:00 2026";; esac\n'
        'printf "Job Id: X\\n    Resource_List.nodect = 4\\n    stime = %s\\n'
        '    obittime = %s\\n" "$s" "$e"',
    )
    lines = used_lines(_run(tmp_path, "pbs"))
    assert "job 11: 4 nodes x 3600 s = 4 node-hours used" in lines
    assert "total: 5 node-hours used over 2 submission(s)" in lines
    assert "per 1,000 completed steps: 10 node-hours (500 steps)" in lines
