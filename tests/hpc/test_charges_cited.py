"""The built-in profiles' charge factors against the sites' own pages (issue 31 item 4).

Every expected number here is a literal taken from the cited page, never computed from the
profile YAML, so a profile with a wrong (or guessed) factor fails:

- OLCF Frontier, https://docs.olcf.ornl.gov/systems/frontier_user_guide.html#node-hour-calculation
  (olcf/olcf-user-docs @2745903): "node-hours = nodes requested * ( batch job endtime - batch
  job starttime )"; its examples "6 nodes * 1 hour = *6 node-hours*" and "an 8-hour, 2,000
  node reservation on Frontier would be equivalent to using 16,000 Frontier node-hours".
- ALCF Aurora/Polaris and NERSC Perlmutter: no page read states a per-queue factor (see the
  profiles' charge comments), so the line must say "charge factor unverified" and print no
  total in node-hours as if it were a fact.
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


@pytest.mark.parametrize(("queue", "nodes", "walltime", "expected"), [
    ("batch", "6", "01:00:00", "6"),          # [FC] "6 nodes * 1 hour = *6 node-hours*"
    ("batch", "2000", "08:00:00", "16000"),   # [FC] "8-hour, 2,000 node ... 16,000 node-hours"
    ("extended", "6", "01:00:00", "6"),       # [FC] the formula has no partition factor
    ("debug", "6", "01:00:00", "6"),          # [FC] ... and no QOS factor
])
def test_frontier_max_charge_is_the_pages_node_hours(
    queue: str, nodes: str, walltime: str, expected: str, capsys: pytest.CaptureFixture[str],
) -> None:
    line = _charge_line(capsys, "--cluster", "frontier", "--queue", queue, "--nodes", nodes,
                        "--walltime", walltime)
    assert line.startswith(f"hpc: maximum charge: {expected} node-hours (")
    assert f"queue {queue} factor 1;" in line and FRONTIER_PAGE in line
    assert "unverified" not in line


@pytest.mark.parametrize(("cluster", "queue", "source"), [
    ("aurora", "debug-scaling",
     "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation"),
    ("aurora", "prod", "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation"),
    ("polaris", "debug", "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation"),
    ("polaris", "prod", "https://www.alcf.anl.gov/managing-your-award/managing-your-allocation"),
    ("perlmutter", "regular", "https://docs.nersc.gov/policies/charging-policy/"),
    ("perlmutter", "premium", "https://docs.nersc.gov/policies/charging-policy/"),
    ("perlmutter", "debug", "https://docs.nersc.gov/policies/charging-policy/"),
])
def test_unread_factors_stay_unverified(
    cluster: str, queue: str, source: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """No factor could be read for these queues: node-hours only, and the page to read."""
    nodes = "256" if queue == "prod" and cluster == "aurora" else (
        "10" if queue == "prod" else "2")
    line = _charge_line(capsys, "--cluster", cluster, "--queue", queue, "--nodes", nodes,
                        "--walltime", "00:30:00")
    hours = int(nodes) * 0.5
    assert f"{nodes} nodes x 0.5 h = {hours:g} node-hours; charge factor unverified" in line
    assert f"(queue {queue}; see {source})" in line
    # no number is printed as the charge itself
    assert not re.search(r"maximum charge: [0-9.]+ node-hours \(", line)
