"""The scheduler clients' calls (``sbatch``, ``qstat`` ...): run one, stream a big answer,
split many ids into calls that fit. Shared by every scheduler module; a file whose name
starts with ``_`` is not taken for a scheduler (:func:`hpc.schedulers.names`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, TypeVar

from hpc.errors import SchedulerError

if TYPE_CHECKING:
    import subprocess

T = TypeVar("T")

#: Most job ids one status query names. A query of more is split into several calls
#: (:func:`chunks`): argv has limits (one argument at most 128 KiB on Linux, all of
#: them with the environment ARG_MAX, 2 MiB by default), and a scheduler answers a
#: few thousand ids per call comfortably where it might time out on a million.
MAX_IDS_PER_CALL = 1000
#: Most characters of ids in one call, joined or as separate arguments: a quarter of
#: Linux's 128 KiB limit on one argument (``squeue -j a,b,c`` is one), so the
#: environment and the rest of the command line always fit too.
MAX_ID_CHARS = 32 * 1024


def run(
    argv: list[str],
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a scheduler client; a missing or hung client is a SchedulerError naming it.

    Every reader of a client's answer goes through here, so its output is decoded once,
    as UTF-8 with undecodable bytes replaced: a job name, a path or a server message in
    another encoding (Latin-1 file names, a localized error) must not become a
    ``UnicodeDecodeError`` in the middle of ``hpc submit`` or ``hpc status``.
    """
    import subprocess

    if shutil.which(argv[0]) is None:
        raise SchedulerError(
            f"scheduler: {argv[0]} not found on PATH; allowed: run on a login node "
            "that has it, or use --dry-run"
        )
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            check=False,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        raise SchedulerError(
            f"scheduler: {' '.join(argv)} did not answer within {timeout:.0f} s"
        ) from None
    except OSError as exc:
        raise SchedulerError(f"scheduler: {' '.join(argv)} could not run: {exc.strerror}") from None


def chunks(ids: Iterable[str], sep: int = 1) -> Iterator[list[str]]:
    """``ids`` in groups that fit one client call: at most :data:`MAX_IDS_PER_CALL`
    ids and :data:`MAX_ID_CHARS` characters (``sep``: the separator's length, the comma
    of ``-j a,b,c`` or the NUL between two arguments)."""
    group: list[str] = []
    size = 0
    for job_id in ids:
        if group and (len(group) >= MAX_IDS_PER_CALL or size + len(job_id) + sep > MAX_ID_CHARS):
            yield group
            group, size = [], 0
        group.append(job_id)
        size += len(job_id) + sep
    if group:
        yield group


def stream(
    argv: list[str], reader: Callable[[IO[str]], T], timeout: float = 60.0
) -> tuple[T, int, str]:
    """Run a client and hand its stdout to ``reader`` as it comes: (what the reader
    returned, the exit code, stderr).

    For answers too big to hold: ``qstat -f`` of a 50,000-job array is about a
    gigabyte of text, of which a status query may want one job. The reader keeps
    what it needs (memory flat in the rest); output is decoded as :func:`run` does
    (UTF-8, undecodable bytes replaced). A missing or hung client is a SchedulerError
    naming it, as in :func:`run`; the reader's own error (damaged output) is raised
    after the client was ended.
    """
    import io
    import subprocess
    import tempfile
    import threading

    if shutil.which(argv[0]) is None:
        raise SchedulerError(
            f"scheduler: {argv[0]} not found on PATH; allowed: run on a login node "
            "that has it, or use --dry-run"
        )
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: no deadlock on a chatty stderr
        try:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
            )
        except OSError as exc:
            raise SchedulerError(
                f"scheduler: {' '.join(argv)} could not run: {exc.strerror}"
            ) from None
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            proc.kill()

        # a daemon: a Ctrl-C that ends this process must not wait out the timeout for it
        timer = threading.Timer(timeout, stop)
        timer.daemon = True
        assert proc.stdout is not None
        text = io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace")
        try:
            timer.start()
            result = reader(text)
        except BaseException:
            proc.kill()
            if expired.is_set():
                raise SchedulerError(
                    f"scheduler: {' '.join(argv)} did not answer within {timeout:.0f} s"
                ) from None
            raise
        finally:
            timer.cancel()
            text.close()
            code = proc.wait()
        if expired.is_set():
            raise SchedulerError(
                f"scheduler: {' '.join(argv)} did not answer within {timeout:.0f} s"
            )
        err.seek(0)
        said = err.read(1024 * 1024).decode("utf-8", errors="replace")
    return result, code, said


def last_line(text: str) -> str:
    """The last non-empty line of a client's message, for one-line errors."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"
