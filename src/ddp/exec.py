"""Bring your own script: ``python -m ddp.exec -- CMD ARGS...``.

Reads whichever launcher started this process (srun, PALS, MPICH, Open MPI,
MVAPICH, jsrun, torchrun), exports what torch's elastic agent exports for a worker
and replaces itself with CMD. An unmodified torchrun-style script that calls
``init_process_group(init_method="env://")``, reads GROUP_WORLD_SIZE or checks
``torch.distributed.is_torchelastic_launched()`` therefore runs under every launcher.

Exported (the agent's list in ``torch/distributed/elastic/agent/server/
local_elastic_agent.py``): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME (``default``),
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID (the scheduler's job id, else
``none`` as torchrun's default ``--rdzv-id``), TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_MAX_RESTARTS (0: no agent restarts workers), TORCHELASTIC_USE_AGENT_STORE
(``False``: rank 0 hosts the store), TORCH_NCCL_ASYNC_ERROR_HANDLING (kept if set,
else 1), and OMP_NUM_THREADS=1 when several ranks share a node and it is unset
(torchrun's ``run.py`` does the same). Also NODE_RANK (= GROUP_RANK), which
Lightning reads. LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE are left out
when the launcher does not say them (``ddp.env``), with one note from rank 0.
Not exported: TORCHELASTIC_ERROR_FILE (the agent's per-worker error file for
``@record``; there is no agent to read it). Under torchrun itself, torchrun's own
elastic variables are kept as they are.

It never imports torch, so it adds only Python's start-up to each rank.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from ddp._pipes import default_sigpipe, run_main
from ddp.dist import check_resolves
from ddp.env import DistEnv, detect, job_id
from ddp.errors import ConfigError

USAGE = "usage: python -m ddp.exec [--print] -- CMD [ARGS...]"


#: Set by torchrun's agent itself; under real torchrun these are left as they are.
_ELASTIC = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "ROLE_NAME",
)


def exec_vars(info: DistEnv, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to export for CMD: torchrun's full worker environment."""
    out = info.torchrun_vars(full=True)
    out["TORCHELASTIC_RUN_ID"] = job_id(environ) or "none"
    out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if (info.local_world_size or 1) > 1 and "OMP_NUM_THREADS" not in environ:
        out["OMP_NUM_THREADS"] = "1"
    if info.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" in environ:
        for name in _ELASTIC:
            if name in environ:
                out.pop(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command; 141, quietly, once nobody reads its output (``ddp._pipes``)."""
    return run_main(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    show = False
    while args and args[0] != "--":
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            print(USAGE)
            print(__doc__)
            return 0
        if flag == "--print":
            show = True
            continue
        # Allow `ddp.exec CMD ...` without the separator, as long as CMD is no flag.
        if not flag.startswith("-"):
            args.insert(0, flag)
            break
        print(f"ddp.exec: error: unknown option {flag!r}; {USAGE}", file=sys.stderr)
        return 2
    if args and args[0] == "--":
        args.pop(0)
    if not args:
        print(f"ddp.exec: error: no command given; {USAGE}", file=sys.stderr)
        return 2
    try:
        info = detect(argv=[])
        if info.world_size > 1:
            info = check_resolves(info)  # the same fast failure / suffix fallback as ddp.init
    except ConfigError as exc:
        print(f"ddp.exec: error: {exc}", file=sys.stderr)
        return 2
    exported = exec_vars(info, os.environ)
    os.environ.update(exported)
    os.environ.setdefault("DDP_LAUNCHER_ORIGINAL", info.launcher)
    if info.rank == 0:
        for note in info.notes:
            print(f"ddp.exec: note: {note}", file=sys.stderr)
    if show:
        print(" ".join(f"{k}={v}" for k, v in exported.items()), file=sys.stderr)
    exe = shutil.which(args[0]) or args[0]
    sys.stdout.flush()  # what this process printed goes before the command's output
    sys.stderr.flush()
    default_sigpipe()  # CMD ends on a closed pipe as it would under a shell
    try:
        os.execv(exe, args)
    except OSError as exc:
        print(f"ddp.exec: error: cannot run {args[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    raise SystemExit(main())
