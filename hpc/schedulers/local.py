"""This machine: run the script now, stream its output, keep its exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hpc.errors import UserError


class Local:
    """Runs the rendered script with bash in the current directory."""

    name = "local"

    def __init__(self) -> None:
        self.returncode: int | None = None

    def submit_command(self, script: str) -> list[str]:
        """``bash SCRIPT``."""
        return ["bash", script]

    def parse_job_id(self, stdout: str) -> str:
        """Local ids are ``local-PID``."""
        return stdout.strip()

    def submit(self, script: str, run_dir: str) -> str:
        """Run to the end, streaming output to the terminal and ``run_dir/output.log``."""
        log = Path(run_dir) / "output.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                self.submit_command(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            assert proc.stdout is not None
            out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
                sink.write(chunk)
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stdout.write(chunk.decode(errors="replace"))
            self.returncode = proc.wait()
        return f"local-{proc.pid}"

    def status(self, job_id: str) -> str:
        """RUNNING while the process lives; a finished one is known from its run dir."""
        pid = _pid(job_id)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "UNKNOWN"
        except PermissionError:
            return "RUNNING"
        return "RUNNING"

    def cancel(self, job_id: str) -> None:
        """SIGTERM to the job's process if it still runs."""
        try:
            os.kill(_pid(job_id), signal.SIGTERM)
        except ProcessLookupError:
            raise UserError(f"job: {job_id!r} is not running; allowed: a running local job") from None


def _pid(job_id: str) -> int:
    text = job_id.removeprefix("local-")
    if not text.isdigit():
        raise UserError(f"job: {job_id!r} is not a local job id; allowed: local-PID")
    return int(text)
