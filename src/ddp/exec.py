"""Bring your own script: ``python -m ddp.exec -- CMD ARGS...``.

Reads whichever launcher started this process (srun, MPICH, PALS, Open MPI,
torchrun), exports the variables torchrun would have set (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and replaces
itself with CMD. An unmodified torchrun-style script that calls
``init_process_group(init_method="env://")`` therefore runs under every launcher.
It never imports torch, so it adds only Python's start-up to each rank.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

from ddp.dist import check_resolves
from ddp.env import detect
from ddp.errors import ConfigError

USAGE = "usage: python -m ddp.exec [--print] -- CMD [ARGS...]"


def main(argv: Sequence[str] | None = None) -> int:
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
    os.environ.update(info.torchrun_vars())
    os.environ.setdefault("DDP_LAUNCHER_ORIGINAL", info.launcher)
    if show:
        print(" ".join(f"{k}={v}" for k, v in info.torchrun_vars().items()), file=sys.stderr)
    exe = shutil.which(args[0]) or args[0]
    try:
        os.execv(exe, args)
    except OSError as exc:
        print(f"ddp.exec: error: cannot run {args[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    raise SystemExit(main())
