"""Preemption: signals, the ranks' agreement to stop, the exit and the requeue.

The pieces, in the order a preemption meets them (modelled on Lightning's
SignalConnector; the checkpoint itself is the Checkpointer's):

- :class:`Preemption`: one run's preemption, the object the trainer asks; it owns the
  flags below and the pieces that follow;
- :class:`~ddp.signal_watch.SignalWatch`: a handler that only sets a flag, and a watchdog
  for a rank that cannot act (:mod:`ddp.signal_watch`);
- :class:`Vote`: every rank learns, at the same step, whether any rank got a signal,
  over a CPU side channel (a tree, :mod:`ddp.agree`) so the hot loop never waits for
  the device;
- :func:`~ddp.requeue.requeue`: SLURM's ``scontrol requeue`` of this job or array task
  after the preemption checkpoint, or, when SLURM refuses, the next segment submitted
  with ``sbatch --dependency=afterany`` (:mod:`ddp.requeue`, re-exported here);
- :class:`Preempted`: the exit (75, ``EX_TEMPFAIL``) once the checkpoint is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ddp.requeue import requeue, slurm_job_id, submit_next_segment
from ddp.signal_watch import STUCK_S, SignalWatch

if TYPE_CHECKING:
    from ddp.agree import Agreement, GroupAgreement, Round, WorkRound
    from ddp.config_sections import PreemptionConfig

__all__ = [
    "GO",
    "PREEMPTED_EXIT_CODE",
    "SAVE",
    "STOP",
    "STUCK_S",
    "Preempted",
    "Preemption",
    "SignalWatch",
    "Vote",
    "requeue",
    "slurm_job_id",
    "submit_next_segment",
]

log = logging.getLogger("ddp")

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run that stopped on a preemption signal after saving a checkpoint."""


class Preempted(SystemExit):
    """Raised by ``Trainer.fit`` after the preemption checkpoint is saved."""

    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


GO, SAVE, STOP = 0, 1, 2
"""A vote's verdicts, the levels its round agrees on (:data:`ddp.agree.LEVELS`): the
largest level any rank voted wins, so a stop (which saves anyway) outranks a save."""


class Vote:
    """Whether any rank got a preemption signal, known on every rank at the same step.

    Every ``every`` steps each rank starts a round of ``agreement``
    (:class:`ddp.agree.Agreement`: a tree of small Gloo groups, O(log W) hops, run by a
    background thread, never queued behind DDP's gradient buckets). The round started at
    step s is read at step s + ``every``, the same step on every rank, so all ranks stop
    together. By then the round finished long ago: :meth:`~ddp.agree.Round.done` is tried
    first and waiting covers only a late one (counted in ``late``). The loop hands the
    thread a Python bool and gets one back: it touches no tensor, so it never makes the
    host wait for the GPU.

    Time-based checkpoints (``checkpoint.every_s``, the sites' "checkpoint every 15
    minutes") ride in the same round: rank 0 (``decides``) votes :data:`SAVE` when
    ``save_every_s`` seconds of its ``clock`` have passed since the last checkpoint, the
    other ranks vote :data:`GO` (or :data:`STOP`), and the round's max reaches every rank
    at the same step, which then saves (:meth:`take_save`). Ranks' clocks never have to
    agree, and no message is added: the level travels in the vote's own float.
    """

    def __init__(
        self,
        every: int,
        world_size: int,
        agreement: Agreement | GroupAgreement | None = None,
        interval_s: float = 0.0,
        save_every_s: float = 0.0,
        decides: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import torch

        self.save_every_s = save_every_s
        self.decides = decides  # rank 0: its clock decides the time-based saves
        self.clock = clock
        self._last_save = clock()
        self._save_due = False
        self._stale = False  # a checkpoint was taken since the round in flight was decided
        self.every = every
        self.base = every
        self.interval_s = interval_s
        if agreement is None and world_size > 1:  # a process group made without ddp.init
            from ddp.agree import GroupAgreement

            agreement = GroupAgreement()
        self.distributed = world_size > 1
        self.agreement = agreement
        self._local = (torch.zeros(1),)  # world size 1: the tests' view of "the buffers"
        self._round: Round | WorkRound | None = None
        self.late = 0

    def pace(self, step_time_s: float) -> None:
        """Space votes about ``interval_s`` apart, given a step time every rank agrees on
        (the mean from a log point's collective: all ranks change pace at the same step).

        On a small machine each vote's thread competes with the ranks' compute; one
        vote every ``interval_s`` seconds keeps that cost negligible at any step time.
        """
        if self.base and self.interval_s and step_time_s > 0:
            self.every = max(self.base, min(10_000, int(self.interval_s / step_time_s)))

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The CPU tensors the vote travels in (tests check they never sit on a device)."""
        return self.agreement.buffers if self.agreement is not None else self._local

    def saved(self) -> None:
        """A checkpoint was taken (any kind, at the same step on every rank): the next
        time-based one is due ``save_every_s`` seconds from now, and a save verdict of the
        round in flight (decided before this checkpoint) is dropped on every rank."""
        self._last_save = self.clock()
        self._stale = True

    def take_save(self) -> bool:
        """True once after a step whose verdict was :data:`SAVE` (the same step on every
        rank): the caller saves a checkpoint now."""
        due, self._save_due = self._save_due, False
        return due

    def _level(self, flagged: bool) -> int:
        if flagged:
            return STOP
        due = self.save_every_s > 0 and self.clock() - self._last_save >= self.save_every_s
        return SAVE if self.decides and due else GO

    def step(self, step: int, flagged: bool) -> bool:
        """At an optimizer step boundary: True when the ranks agreed to stop now (and
        :meth:`take_save` is True when they agreed to save now)."""
        if not self.every or step % self.every:
            return False
        if self.settle():
            return True
        self._stale = False  # the round below is decided after every checkpoint so far
        if not self.distributed:
            level = self._level(flagged)
            self._save_due = level == SAVE
            return level == STOP
        assert self.agreement is not None
        self._round = self.agreement.start(self._level(flagged))
        return False

    def final(self, flagged: bool) -> bool:
        """The vote in flight, then a blocking one on the current flags: True = stop.

        For the points every rank reaches at the same step anyway (an epoch's end,
        max_steps), so that a signal between paced votes is acted on there."""
        if not self.every:
            return False
        if self.settle():
            return True
        if not self.distributed:
            return flagged
        assert self.agreement is not None
        return self.agreement.agree(STOP if flagged else GO) == STOP

    def settle(self) -> bool:
        """Finish the vote in flight (before a save, or leaving the epoch): True = stop;
        a :data:`SAVE` verdict is kept for :meth:`take_save`."""
        if self._round is None:
            return False
        if not self._round.done():
            self.late += 1
        job, self._round = self._round, None
        verdict = job.result()
        self._save_due = verdict == SAVE and not self._stale
        return verdict == STOP


class Preemption:
    """One run's preemption, owning its flags: the signal handlers (installed for the
    length of the run), the signal that arrived, the ranks' vote (which also carries
    ``checkpoint.every_s``), whether an evaluation was cut short, and the exit with its
    requeue.

    Why one object: the trainer's loop only asks it questions at step boundaries
    (:meth:`step`, :meth:`settle`, :meth:`take_save`) and tells it of checkpoints
    (:meth:`saved`); no flag is read or written across the trainer's methods, so the
    order "handler sets a flag, the vote agrees, the checkpoint, the requeue, exit 75"
    is written in one place.
    """

    def __init__(
        self,
        config: PreemptionConfig,
        rank: int,
        world_size: int,
        every_s: float = 0.0,
        agreement: Agreement | GroupAgreement | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.rank = rank
        self.every_s = every_s  # checkpoint.every_s (0: off): rides on the vote
        self.signal: int | None = None  # set by the handler; acted on at step boundaries
        self.in_eval = False  # an evaluation stopped early on a signal (resume redoes it)
        self.signals = SignalWatch(config.signals, self._on_signal, rank, config.grace_s)
        # Until install() the vote never votes (every 0); install() sets its pace.
        self.vote = Vote(
            0,
            world_size,
            agreement,
            config.check_interval_s,
            save_every_s=every_s,
            decides=rank == 0,
            clock=clock,
        )

    @property
    def requested(self) -> bool:
        """True once a configured signal arrived on this rank."""
        return self.signal is not None

    def install(self) -> None:
        """The handlers for the run; the vote runs when they are installed or when
        ``checkpoint.every_s`` needs it (it rides on the vote without signals too)."""
        self.signals.install()
        every = self.config.check_every_n_steps if self.signals.installed or self.every_s else 0
        self.vote.every = self.vote.base = every

    def restore(self) -> None:
        """The run ended: the previous handlers back, the watchdog stood down."""
        self.signals.restore()

    def _on_signal(self, signum: int) -> None:
        self.signal = signum  # only a flag: the loop acts at the step boundary

    def step(self, step: int) -> bool:
        """At an optimizer step boundary: True when the ranks agreed to stop now."""
        return self.vote.step(step, self.requested)

    def settle(self) -> bool:
        """At max_steps or the epoch's end (the same step on every rank): finish the vote
        in flight and take one more, so a signal is never left for a later epoch; True =
        stop. A pending time-based save is dropped: the caller saves here anyway."""
        stop = self.vote.final(self.requested)
        self.vote.take_save()
        return stop

    def take_save(self) -> bool:
        """True once after a step the ranks agreed to save at (``checkpoint.every_s``)."""
        return self.vote.take_save()

    def saved(self) -> None:
        """A checkpoint was taken: ``checkpoint.every_s`` counts from it."""
        self.vote.saved()

    def pace(self, step_time_s: float) -> None:
        """The agreed mean step time from a log point (see :meth:`Vote.pace`)."""
        self.vote.pace(step_time_s)

    def exit(self, wait: Callable[[], None], step: int) -> NoReturn:
        """After the preemption checkpoint: wait for it (``wait``: the checkpointer's),
        requeue (SLURM, rank 0), exit 75."""
        import ddp

        if self.in_eval:
            log.warning(
                "preemption signal during evaluation: saved at step %d, exiting %d",
                step,
                PREEMPTED_EXIT_CODE,
            )
        wait()
        ddp.barrier()  # the checkpoint is durable everywhere before anyone exits
        if self.rank == 0:
            requeue(self.config.requeue)
        ddp.shutdown()
        raise Preempted()
