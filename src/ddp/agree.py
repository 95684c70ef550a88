"""Agreement of every rank on one flag, without a group that spans every rank.

The preemption vote (:class:`ddp.preemption.Vote`) and the lockstep evaluation of FSDP
(:func:`ddp.parts.eval_batches`) ask one question of all ranks: did any rank raise
its flag? A Gloo group over all W ranks answers it, but torch's Gloo connects every
pair when the group is made (W sockets per rank, W^2 address look-ups at rank 0's
store) and its all-reduce is a ring (2(W-1) sequential hops): at 127,488 ranks that is
more sockets than any ``ulimit -n`` and seconds per vote.

Here the ranks form a tree (:class:`Layout`): ranks in blocks of ``block`` consecutive
ranks (one node's ranks when the launcher places them so: ``LOCAL_WORLD_SIZE``), the
block's first rank its leader and parent of the others, and the leaders a
:data:`FANOUT`-ary tree. Each parent and its children form one small Gloo group; a rank
belongs to at most two (its own, as parent, and its parent's) and connects only to its
parent and children (the groups' devices connect lazily where torch allows it). A round
runs up the tree (each leader gathers its children's values in one Gloo gather and
sends the max on) and down again (each leader scatters the root's answer to its
children): ``2 * depth`` hops, ``depth`` = 1 + log_FANOUT(W / block).

A background thread runs the rounds, so the loop only starts one (:meth:`Agreement.start`)
and reads its answer later (:meth:`Round.result`); no tensor the loop touches is read,
and the thread's tensors live on the CPU (:attr:`Agreement.buffers`). The thread needs
the GIL once or twice per hop (a gather gathers all children in C++, where one receive
each would wake Python once per child: measured 1.7x faster with 16 ranks whose main
threads spin in Python); a round that is late when the loop reads it is waited for with
the GIL released, so it then finishes at the idle rate.

The groups are built directly on the job's store under keys of their own
(``ddp_agree/...``), not through ``new_group``: only members build a group (no
collective over all ranks), and torch's own naming of local groups counts the groups a
process made before, which differs between a leader and its children.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ddp")

FANOUT = 8
"""Children per leader in the leaders' tree: depth log_8 of the nodes (5 at Aurora's
10,624 nodes), at most 8 + block - 1 connections at a leader."""

MAX_BLOCK = 16
"""Largest block (node-local group): a leader's children beyond FANOUT stay bounded
whatever ``LOCAL_WORLD_SIZE`` a launcher reports (CPU nodes may run 128 ranks)."""

BLOCK_KEY = "ddp_agree/block"
"""Store key under which rank 0 publishes the block size every rank builds the tree with."""


@dataclass(frozen=True)
class Layout:
    """Where ``rank`` sits in the tree of ``world`` ranks (the same arithmetic on every rank).

    Block ``n`` holds ranks ``n*block .. n*block+block-1``; its first rank is leader
    ``n``. Leader ``n``'s group: its block, then the leaders ``FANOUT*n+1 ..
    FANOUT*n+FANOUT`` (their blocks' first ranks); the group's rank 0 is the leader.
    """

    rank: int
    world: int
    block: int = 1
    fanout: int = FANOUT

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world and self.block >= 1 and self.fanout >= 2):
            raise ValueError(f"bad layout {self}")

    @property
    def leaders(self) -> int:
        """How many blocks (leaders) there are."""
        return -(-self.world // self.block)

    def members(self, n: int) -> list[int]:
        """Global ranks of leader ``n``'s group, the leader first."""
        b, k = self.block, self.fanout
        own = list(range(n * b, min(n * b + b, self.world)))
        below = [c * b for c in range(k * n + 1, k * n + k + 1) if c < self.leaders]
        return own + below

    @property
    def own(self) -> int | None:
        """The group this rank leads (its block's, with the leaders below), if any."""
        n = self.rank // self.block
        return n if self.rank % self.block == 0 and len(self.members(n)) > 1 else None

    @property
    def up(self) -> int | None:
        """The group in which this rank is a child (its parent's); None at the root."""
        n = self.rank // self.block
        if self.rank % self.block:
            return n
        return (n - 1) // self.fanout if n else None

    @property
    def groups(self) -> list[int]:
        """The groups (by leader index) this rank is in: at most two."""
        return [g for g in (self.own, self.up) if g is not None]

    @property
    def parent(self) -> int | None:
        """Global rank of this rank's parent (None at the root)."""
        n = self.rank // self.block
        if self.rank % self.block:
            return n * self.block
        return None if n == 0 else (n - 1) // self.fanout * self.block

    @property
    def children(self) -> list[int]:
        """Global ranks of this rank's children, in group-rank order (1, 2, ...)."""
        if self.rank % self.block:
            return []
        return self.members(self.rank // self.block)[1:]

    def _leader_depth(self, n: int) -> int:
        d = 0
        while n:
            n = (n - 1) // self.fanout
            d += 1
        return d

    @property
    def depth(self) -> int:
        """Edges on the tree's longest root-to-leaf path (the same on every rank).

        Leaders deeper in the heap have larger indices, and every block but the last is
        full, so the deepest path ends below the last leader or the one before it."""
        last = self.leaders - 1
        size_last = self.world - last * self.block
        best = self._leader_depth(last) + (size_last > 1)
        if last >= 1:
            best = max(best, self._leader_depth(last - 1) + (self.block > 1))
        return best

    @property
    def hops(self) -> int:
        """Sequential messages in one round: up the longest path and down again."""
        return 2 * self.depth


LEVELS = 3
"""A round agrees on the largest of the ranks' levels 0, 1, 2 (a bool is level 0 or 1).
The preemption vote uses two bits in one value: 2 = stop (a signal), 1 = save a
checkpoint (rank 0's ``checkpoint.every_s`` clock), 0 = go on. The max of the levels
is the verdict; a stop outranks a save because the stop saves anyway."""


class Round:
    """One agreement in flight: :meth:`done` without waiting, :meth:`result` waits."""

    def __init__(self, flag: bool | int) -> None:
        self.flag = int(flag)
        self._done = threading.Event()
        self._value = 0
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> int:
        """The largest level any rank started with (for bool flags: 1 when any rank's flag
        was set, else 0); raises the round's failure on this rank.

        Waits with no limit of its own: every receive in the round is bounded by the
        groups' timeout (``ddp.init(timeout=...)``), after which the round fails."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: int = 0, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()


class Agreement:
    """The tree's groups on this rank and the thread that runs rounds over them.

    Rounds are collective: every rank starts the same rounds in the same order (each
    caller's own discipline: the vote at the same steps, lockstep evaluation at the same
    batches). One thread runs them one after the other, so two rounds never interleave
    on a group.
    """

    def __init__(self, layout: Layout, groups: dict[int, Any]) -> None:
        import torch

        self.layout = layout
        self._groups = groups  # leader index -> ProcessGroupGloo backend
        self._own = None if layout.own is None else groups[layout.own]  # I am group rank 0
        self._up = None if layout.up is None else groups[layout.up]  # the parent is group rank 0
        # [flag, hops]: the hops a message's value has travelled (a measurement that costs
        # one float beside the flag: the bench reads it, the loop does not).
        # One preallocated message per level (LEVELS), sent as they are.
        self._flags = tuple(torch.tensor([float(v), 0.0]) for v in range(LEVELS))
        self._value = torch.zeros(2)  # the answer, as it arrives from the parent
        width = len(layout.children) + 1
        self._table = torch.zeros(width, 2)  # the leader's gather: its own row, then each child's
        self._rows = list(self._table.unbind(0))
        self._hop_col = self._table[1:, 1]  # +1 for the hop each child's row took up
        self._one = torch.ones(())
        self._step = torch.tensor([0.0, 1.0])
        self._down = torch.zeros(2)  # the answer plus the hop down, scattered to the children
        self._fan = [self._down] * width
        self.last_hops = 0  # sequential messages before this rank knew the last round's answer
        self._broken: BaseException | None = None
        self._queue: queue.SimpleQueue[Round | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="ddp-agree", daemon=True)
        self._thread.start()

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a round reads or writes (CPU; tests check they never reach a device)."""
        return (
            *self._flags,
            self._value,
            self._table,
            *self._rows,
            self._hop_col,
            self._one,
            self._step,
            self._down,
        )

    @property
    def hops(self) -> int:
        """Sequential messages of a round by the layout's arithmetic (``2 * depth``)."""
        return self.layout.hops

    def start(self, flag: bool | int) -> Round:
        """Begin a round with this rank's ``flag`` (a bool, or a level below
        :data:`LEVELS`); returns at once (no tensor touched)."""
        if not 0 <= int(flag) < LEVELS:
            raise ValueError(f"agreement level {flag!r}; allowed: 0 to {LEVELS - 1}")
        job = Round(flag)
        if self._broken is not None:
            job._finish(error=self._broken)
        else:
            self._queue.put(job)
        return job

    def agree(self, flag: bool | int) -> int:
        """A whole round: the largest level of any rank (for bools: truthy when any rank's
        ``flag`` is set; collective, blocking)."""
        return self.start(flag).result()

    def close(self) -> None:
        """Stop the thread once the rounds started before have run (the process may then
        exit without a Python thread inside a C++ wait)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=2.0)

    # ---- the thread -------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._broken is not None:
                job._finish(error=self._broken)
                continue
            try:
                job._finish(self._round(job.flag))
            except BaseException as exc:  # the tree is out of step now: every later round fails
                self._broken = exc
                job._finish(error=exc)

    def _round(self, flag: int) -> int:
        """Up: a leader gathers its children's values (one Gloo gather: the messages meet in
        C++, not one Python wake-up each) and sends the max on to its parent; down: the
        root's answer, scattered by each leader to its children. The second float counts
        hops: the longest path up, then each hop down.

        Each call below hands the GIL over and back (a wait of up to the switch interval,
        5 ms, while the main thread runs Python), so there are few: a leaf makes four
        (its gather and its parent's scatter queue in order on the group's one worker)."""
        import torch
        from torch.distributed import GatherOptions, ScatterOptions

        mine = self._flags[flag]
        gather, scatter = GatherOptions(), ScatterOptions()
        gather.rootRank = scatter.rootRank = 0  # group rank 0 is always the leader
        if self._own is not None:
            self._own.gather([self._rows], [mine], gather).wait()
            self._hop_col.add_(self._one)
            mine = torch.amax(self._table, 0, out=self._value)
        if self._up is not None:
            self._up.gather([], [mine], gather)  # the group's worker runs it before the scatter
            self._up.scatter([self._value], [], scatter).wait()
        if self._own is not None:
            torch.add(self._value, self._step, out=self._down)
            self._own.scatter([self._rows[0]], [self._fan], scatter).wait()
        answer, hops = self._value.tolist()  # a CPU tensor: no device wait
        self.last_hops = int(hops)
        return int(answer)


class WorkRound:
    """A :class:`Round` over one asynchronous all-reduce (see :class:`GroupAgreement`)."""

    def __init__(self, work: Any, buf: torch.Tensor) -> None:
        self._work, self._buf = work, buf

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def result(self) -> int:
        self._work.wait()
        return int(self._buf.numpy()[0])  # a CPU tensor: no device wait


class GroupAgreement:
    """:class:`Agreement`'s interface over an existing process group (default: the default
    group), for a process group a script made itself, where ``ddp.init`` built no tree:
    one asynchronous MAX all-reduce per round (on Gloo a ring over every rank)."""

    def __init__(self, group: Any = None) -> None:
        import torch

        self.group = group
        self._buf = (torch.zeros(1), torch.zeros(1))  # double-buffered: one in flight
        self._cur = 0

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self._buf

    def start(self, flag: bool | int) -> WorkRound:
        import torch.distributed as tdist

        self._cur ^= 1
        buf = self._buf[self._cur]
        buf.fill_(float(int(flag)))  # a level, as in Agreement.start
        work = tdist.all_reduce(buf, op=tdist.ReduceOp.MAX, group=self.group, async_op=True)
        return WorkRound(work, buf)

    def agree(self, flag: bool | int) -> int:
        return self.start(flag).result()

    def close(self) -> None:
        """Nothing to stop: the group is the script's."""


def block_size(store: Any, rank: int, local_world_size: int | None) -> int:
    """The block every rank builds the tree with: rank 0's ``LOCAL_WORLD_SIZE`` (1 when
    the launcher does not say; at most :data:`MAX_BLOCK`), published in the store.

    One value for all: launchers may report different local sizes on different nodes
    (uneven tasks per node), and ranks that built different trees would wait forever.
    A block that is not really one node's ranks (a cyclic placement) costs locality only.
    """
    if rank == 0:
        block = max(1, min(MAX_BLOCK, local_world_size or 1))
        store.set(BLOCK_KEY, str(block))
        return block
    raw = store.get(BLOCK_KEY)
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_BLOCK):
        raise ConfigError(
            f"the rendezvous store holds {BLOCK_KEY}={text[:40]!r}; allowed: 1 to {MAX_BLOCK} "
            "(written by rank 0): is another program using MASTER_PORT's store?"
        )
    return int(text)


def _device() -> Any:
    """A Gloo device whose pairs connect on first use (torch >= 2.8 has ``lazy_init``;
    otherwise each small group connects its few members when made).

    One per group, not one shared: lazily connected pairs of two groups on one device
    are told apart by rank alone and cross (measured: the second group's round timed
    out). So a rank has at most two listening sockets, one per group."""
    from torch.distributed import ProcessGroupGloo

    # GLOO_SOCKET_IFNAME names the interface, as torch's own Gloo groups read it: the
    # default device binds the host name's address, which on a host whose name resolves
    # to 127.0.0.1 (network namespaces, some clusters) other hosts cannot reach.
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    make = (
        functools.partial(ProcessGroupGloo.create_device, interface=iface)
        if iface
        else ProcessGroupGloo.create_default_device
    )
    try:
        return make(lazy_init=True)
    except TypeError:  # no lazy_init: each group connects its few members when made
        return make()


def build(
    store: Any, rank: int, world: int, local_world_size: int | None, timeout: timedelta
) -> Agreement:
    """Collective over all ranks: this rank's groups of the tree, and one round that
    connects every edge (so an unreachable peer fails here, not at the first vote)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    layout = Layout(rank, world, block_size(store, rank, local_world_size))
    groups: dict[int, Any] = {}
    for n in layout.groups:
        members = layout.members(n)
        # torch's stub names it Options; the class torch builds is _Options
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [_device()]
        options._timeout = timeout
        options._threads = 1  # one gather and one scatter in flight at most
        groups[n] = ProcessGroupGloo(
            PrefixStore(f"ddp_agree/{n}", store), members.index(rank), len(members), options
        )
    agreement = Agreement(layout, groups)
    agreement.agree(False)
    return agreement
