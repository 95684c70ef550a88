"""The built-in profiles' charge factors against the sites' own pages (issue 31 item 4).

Every expected number here is a literal taken from the cited page, never computed from the
profile YAML, so a profile with a wrong (or guessed) factor fails:

- OLCF Frontier, https://docs.olcf.ornl.gov/systems/frontier_user_guide.html#node-hour-calculation
  (olcf/olcf-user-docs @2745903): "node-hours = nodes requested * ( batch job endtime - batch
  job starttime )"; its examples "6 nodes * 1 hour = *6 node-hours*" and "an 8-hour, 2,000
  node reservation on Frontier would be equivalent to using 16,000 Frontier node-hours".
- ALCF Aurora/Polaris and NERSC Perlmutter: no page read states a per-queue factor (see the
  profiles' charge comments and docs/sites.md "Charges": searched three times, the last on
  2026-11-27), so the line must say "charge factor unverified" and print no total in
  node-hours as if it were a fact; and NERSC cites no balance command, so none is run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc.cli import main

FRONTIER_PAGE = "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html#node-hour-calculation"


def _charge_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["submit", "--dry-run", "--account", "p", "--name", "t", *argv, "--", "true"])
    got = capsys.readouterr()
    assert code == 0, got.err
    (line,) = [ln for ln in got.err.splitlines() if "maximum charge" in ln]
    return line


@pytest.fixture(autouse=True)
def _no_user_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the built-in profiles: no ./.hpc or ~/.config profile may extend them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.mark.parametrize(
    ("queue", "nodes", "walltime", "expected"),
    [
        ("batch", "6", "01:00:00", "6"),  # [FC] "6 nodes * 1 hour = *6 node-hours*"
        ("batch", "2000", "08:00:00", "16000"),  # [FC] "8-hour, 2,000 node ... 16,000 node-hours"
        ("extended", "6", "01:00:00", "6"),  # [FC] the formula has no partition factor
        ("debug", "6", "01:00:00", "6"),  # [FC] ... and no QOS factor
    ],
)
def test_frontier_max_charge_is_the_pages_node_hours(
    queue: str,
    nodes: str,
    walltime: str,
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _charge_line(
        capsys, "--cluster", "frontier", "--queue", queue, "--nodes", nodes, "--walltime", walltime
    )
    assert line.startswith(f"hpc: maximum charge: {expected} node-hours (")
    assert f"queue {queue} factor 1;" in line and FRONTIER_PAGE in line
    assert "unverified" not in line


@pytest.mark.parametrize(
    ("cluster", "queue", "source"),
    [
        (
            "aurora",
            "debug-scaling",
            "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation",
        ),
        ("aurora", "prod", "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation"),
        (
            "polaris",
            "debug",
            "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation",
        ),
        (
            "polaris",
            "prod",
            "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation",
        ),
        ("perlmutter", "regular", "https://docs.nersc.gov/policies/charging-policy/"),
        ("perlmutter", "premium", "https://docs.nersc.gov/policies/charging-policy/"),
        ("perlmutter", "debug", "https://docs.nersc.gov/policies/charging-policy/"),
    ],
)
def test_unread_factors_stay_unverified(
    cluster: str,
    queue: str,
    source: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No factor could be read for these queues: node-hours only, and the page to read."""
    nodes = "256" if queue == "prod" and cluster == "aurora" else ("10" if queue == "prod" else "2")
    line = _charge_line(
        capsys, "--cluster", cluster, "--queue", queue, "--nodes", nodes, "--walltime", "00:30:00"
    )
    hours = int(nodes) * 0.5
    assert f"{nodes} nodes x 0.5 h = {hours:g} node-hours; charge factor unverified" in line
    assert f"(queue {queue}; see {source})" in line
    # no number is printed as the charge itself
    assert not re.search(r"maximum charge: [0-9.]+ node-hours \(", line)


#: A fake ``showusage`` printing the table of OLCF's "Viewing Usage" section
#: (https://docs.olcf.ornl.gov/systems/frontier_user_guide.html#viewing-usage, olcf-user-docs
#: @2745903), its example row kept (abc123: 20000 allocated, 19873.7 remaining) and a second
#: project added so that the row is picked by project, not by position.
FAKE_SHOWUSAGE = r"""
cat <<'OUT'
  Usage:
                           Project Totals
  Project             Allocation      Usage      Remaining     Usage
  _________________|______________|___________|____________|______________
  xyz999           |  500         |   499.0   |  1.0       |   0.00
  abc123           |  20000       |   126.3   |  19873.7   |   1560.80
OUT
"""


@pytest.mark.parametrize(
    ("nodes", "walltime", "warned"),
    [
        ("2000", "12:00:00", True),  # 24,000 node-hours > 19,873.7 remaining
        ("2000", "08:00:00", False),  # 16,000 fits
    ],
)
def test_frontier_submit_warns_past_showusage_remaining(
    nodes: str,
    walltime: str,
    warned: bool,
    fake_bin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_bin("showusage", FAKE_SHOWUSAGE)
    code = main(
        [
            "submit",
            "--dry-run",
            "--account",
            "ABC123",
            "--name",
            "t",
            "--cluster",
            "frontier",
            "--nodes",
            nodes,
            "--walltime",
            walltime,
            "--",
            "true",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert fake_bin.log.read_text().startswith("showusage")
    warning = [ln for ln in err.splitlines() if "remaining" in ln]
    if warned:
        assert warning == [
            "hpc: warning: this request may charge up to 24000 node-hours, more "
            "than project ABC123's remaining 19873.7 on frontier (showusage)"
        ]
    else:
        assert warning == []


def test_frontier_without_showusage_or_its_project_says_nothing(
    fake_bin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_bin("showusage", FAKE_SHOWUSAGE)
    code = main(
        [
            "submit",
            "--dry-run",
            "--account",
            "other1",
            "--name",
            "t",
            "--cluster",
            "frontier",
            "--nodes",
            "2000",
            "--walltime",
            "12:00:00",
            "--",
            "true",
        ]
    )
    assert code == 0 and "remaining" not in capsys.readouterr().err


def test_unknown_balance_command_is_one_line_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d = tmp_path / ".hpc" / "clusters"
    d.mkdir(parents=True)
    (d / "site.yaml").write_text("extends: frontier\ncharge: {balance: iris}\n")
    code = main(["submit", "--dry-run", "--account", "p", "--cluster", "site", "--", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "charge.balance: 'iris' is not allowed; allowed: sbank, showusage" in err


def test_perlmutter_runs_no_balance_command(
    fake_bin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """NERSC cites no balance command ("Usage reports are available through Iris for
    allocated resources", https://docs.nersc.gov/policies/resource-usage/: a web portal),
    so none is run, whatever is on PATH: not ``iris`` or ``sshare`` (named in the issue,
    cited by no NERSC page found), nor another site's ``sbank-list-allocations`` or
    ``showusage``, each faked here with an empty balance that would warn if asked."""
    for name in ("iris", "sshare", "sbank-list-allocations", "showusage"):
        fake_bin(name, 'echo "Available Balance: 0.0 node hours"')
    line = _charge_line(
        capsys,
        "--cluster",
        "perlmutter",
        "--queue",
        "regular",
        "--nodes",
        "64",
        "--walltime",
        "12:00:00",
    )
    assert line == (
        "hpc: maximum charge: 64 nodes x 12 h = 768 node-hours; charge factor unverified "
        "(queue regular; see https://docs.nersc.gov/policies/charging-policy/)"
    )
    assert not fake_bin.log.exists() or fake_bin.log.read_text() == ""
