"""PBS Pro stand-in (qsub, qstat, qdel, qsig) for tests; see pbs_standin.py for what it reproduces.

Put ``STANDIN_DIR`` first on PATH and point ``PBS_STANDIN_SPOOL`` at a fresh folder.
"""

from __future__ import annotations

from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent
SAMPLES = STANDIN_DIR / "samples"
EXECUTABLES = ("qsub", "qstat", "qdel", "qsig")
