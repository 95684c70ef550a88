"""The hot loop makes no host-device synchronisation between log points (issue 12).

Two real Gloo ranks with the Trainer's defaults (preemption signals installed, the vote
every step), checkpoints off and log points far apart; every host read of a tensor's
value during 10 steady-state steps is counted (see ``_sync_worker``). On a GPU each
such read would make the host wait for the device. The preemption vote's buffers are
read (that is the vote), but they are CPU tensors by construction.
"""

from __future__ import annotations

import json

from tests.ddp import _launch

WORKER = "tests/ddp/_sync_worker.py"


def _spec(out, log_every: int) -> dict:
    """20 steps, checkpoints off; host reads counted from step 3 to step 13."""
    return {
        "out": str(out),
        "n": 512,
        "start": 3,
        "stop": 13,
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "max_steps": 20},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": None},
            "logging": {"every_n_steps": log_every, "progress": "off"},
        },
    }


def _run_both(tmp_path, spec: dict) -> list[dict]:
    """Run the 2-rank worker; each rank's counts (every rank must exit 0)."""
    results = _launch.run([WORKER, json.dumps(spec)], world=2, timeout=120)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {out[-2000:]}\n{err[-3000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_no_host_reads_between_log_points(tmp_path):
    for rec in _run_both(tmp_path, _spec(tmp_path, 1000)):
        assert rec["reads"] == 0, rec["where"]
        assert rec["vote_on_cpu"]
        assert rec["vote_reads"] >= 9, "the preemption vote did not run every step"


def test_time_checkpoints_ride_the_vote_with_no_host_reads(tmp_path):
    """``checkpoint.every_s`` (issue 30.3) with no preemption signals: the vote runs for it
    alone, every step, and the loop still reads nothing from a tensor between log points
    (rank 0's clock is read on the host; the decision travels in the vote's CPU buffer)."""
    spec = _spec(tmp_path, 1000)
    spec["config"]["checkpoint"] = {"dir": str(tmp_path / "ck"), "every_s": 1e6}
    spec["config"]["preemption"] = {"signals": [], "check_interval_s": 0}
    for rec in _run_both(tmp_path, spec):
        assert rec["reads"] == 0, rec["where"]
        assert rec["vote_reads"] >= 9, "checkpoint.every_s did not run the vote"


def test_the_counter_sees_a_read(tmp_path):
    """The same harness counts a step function that reads its loss (so it can fail)."""
    spec = _spec(tmp_path, 5)  # two log points inside the counted steps
    results = _launch.run([WORKER, json.dumps(spec)], world=2, timeout=120)
    assert all(rc == 0 for rc, _, _ in results), results
    rec = json.loads((tmp_path / "rank0.json").read_text())
    assert rec["reads"] >= 2  # each log point reads the window's sums once


def test_votes_are_paced_by_step_time_and_a_signal_still_acts():
    """One process: after a log point measures fast steps, votes are spaced ~interval apart;
    a flag raised between paced votes is still acted on at the epoch's end (final)."""
    from ddp.preemption import Vote

    vote = Vote(1, world_size=1, interval_s=0.25)
    assert vote.every == 1
    vote.pace(0.001)  # 1 ms steps
    assert vote.every == 250
    assert not vote.step(10, flagged=True)  # not a vote step: nothing is read
    assert vote.final(flagged=True)  # the epoch's end decides
    vote.pace(1.0)  # slow steps: never fewer than check_every_n_steps
    assert vote.every == 1
    off = Vote(1, world_size=1, interval_s=0.0)
    off.pace(0.001)
    assert off.every == 1
    assert not Vote(0, world_size=1).final(flagged=True)  # no signals installed: no vote
