"""Stage the job's Python environment to node-local storage before the ranks start.

Why: at scale, every rank importing torch from a virtual environment on the shared file
system makes tens of thousands of metadata calls (stat, open of each module, each
``.pth``, each shared library), all at the same moment, from every node. ALCF writes
that Python start-up at large node counts needs its cooperative cache (Copper) "in order
to scale beyond 2k nodes" (https://docs.alcf.anl.gov/aurora/data-management/copper/copper/).
Staging replaces those calls with one sequential read of one file per node: the venv is
packed once into the run directory (``python-env.tar``), spread to each node's local
storage (``sbcast`` on SLURM, one ``mpiexec --ppn 1`` unpack on PBS), unpacked there,
and the ranks run ``python`` from the copy.

The spec says ``python: {venv: PATH, stage: auto|always|never}`` (``auto`` when left
out, also for the venv ``hpc submit`` runs from): ``auto`` stages from the profile's
``python_stage.min_nodes`` on, ``always`` at any size, ``never`` not at all. The pack is
made at submit time on the login node (``pack: submit``, the default) or by the batch
script on the job's first node (``pack: job``: the login node stays free for a venv of
several GB). ``hpc submit --dry-run`` shows the lines; plain ``hpc render`` has no run
directory to pack into and renders the shared venv's activation.

What moves and what does not: the venv's own files do (site-packages, ``bin``); the
entry points' ``#!`` lines are pointed at the copy while unpacking. What the venv only
points to stays where it is: the base interpreter (``pyvenv.cfg``'s ``home``), a
``--system-site-packages`` base (Aurora's ``frameworks`` module), editable installs
(``.pth`` files naming a checkout). A node whose unpack fails is named by the
launcher (``srun: error: NODE: task N: Exited``) and the job stops before training;
under ``resilience:`` the job goes on instead: each node that unpacked leaves a mark in
``RUN/stage-ok-JOBID/`` and ``ddp.supervise --staged`` leaves the others out.
"""

from __future__ import annotations

import os
import shlex
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.job import Job

STAGES = ("auto", "always", "never")
PACK_AT = ("submit", "job")
#: The pack's name in the run directory.
TAR_NAME = "python-env.tar"
#: Node-local storage when the profile names none.
DEFAULT_LOCAL_DIR = "/tmp"
PROFILE_KEYS = ("min_nodes", "local_dir", "source")

#: Unpack on one node: ``bash -c UNPACK unpack TAR DEST OLD``. Several processes may run
#: it on one host at once (two emulated nodes, or a PBS host file that repeats a host):
#: each extracts into its own temporary folder and the first ``mv -T`` wins. The entry
#: points' ``#!OLD/bin/...`` lines are matched as plain text (a quoted case pattern, no
#: regex), so any path works. No user value is part of this text: they arrive as $1..$3.
UNPACK = r"""set -eu
tar_file=$1 dest=$2 old=$3 ok_dir=${4:-}
if [ ! -d "$dest" ]; then
  tmp=$(mktemp -d "$dest.XXXXXX")
  tar -xf "$tar_file" -C "$tmp"
  for f in "$tmp"/bin/*; do
    if [ -f "$f" ] && [ ! -L "$f" ] && IFS= read -r first < "$f"; then
      case $first in
        "#!$old/bin/"*)
          { printf '#!%s\n' "$dest/bin/${first#"#!$old/bin/"}"; tail -n +2 "$f"; } > "$f.new"
          chmod --reference="$f" "$f.new"
          mv -f "$f.new" "$f";;
      esac
    fi
  done
  mv -T "$tmp" "$dest" 2>/dev/null || rm -rf "$tmp"
fi
echo "python.stage: $(hostname): $dest"
if [ -n "$ok_dir" ]; then : > "$ok_dir/${SLURMD_NODENAME:-$(hostname)}"; fi
"""


@dataclass(frozen=True)
class Stage:
    """One job's staging: where the venv is, its pack, and the node-local folder."""

    venv: str
    local_dir: str
    pack_at: str
    why: str
    #: The spec asked (``stage: always``): nothing to explain on stderr.
    asked: bool = False
    #: Under ``resilience:``: an unpack that fails does not end the job; each node that
    #: unpacked leaves a mark in ``$HPC_STAGE_OK`` and ``ddp.supervise --staged`` leaves
    #: the others out (the scheduler's unpack line passes ``"$HPC_STAGE_OK"`` last).
    tolerant: bool = False

    @property
    def ok_arg(self) -> str:
        """The unpack script's 4th argument: the marks' folder, or nothing."""
        return ' "$HPC_STAGE_OK"' if self.tolerant else ""

    def dest(self, job_id_var: str) -> str:
        """The copy's folder on each node, as shell text (the job id from ``job_id_var``)."""
        return f'{shlex.quote(self.local_dir + "/hpc-ddp-env-")}"${{{job_id_var}}}"'

    def lines(
        self, job_id_var: str, spread: list[str], unpack: list[str], cleanup: list[str]
    ) -> list[str]:
        """The batch script's lines: pack (``pack: job``), spread, unpack, activate.

        ``spread``/``unpack``/``cleanup`` are the scheduler's own lines around the
        constant unpack script (``$HPC_STAGE_UNPACK``), with ``$HPC_STAGE_TAR`` the pack
        on shared storage and ``$HPC_STAGE_DEST`` the node-local copy."""
        out = [
            f"# python.stage: {self.why}",
            f'HPC_STAGE_TAR="$HPC_RUN_DIR"/{TAR_NAME}',
            f"HPC_STAGE_DEST={self.dest(job_id_var)}",
            f"HPC_STAGE_UNPACK={shlex.quote(UNPACK)}",
        ]
        if self.pack_at == "job":
            out.append(
                f'tar -cf "$HPC_STAGE_TAR.$$" -C {shlex.quote(self.venv)} . '
                '&& mv -f "$HPC_STAGE_TAR.$$" "$HPC_STAGE_TAR"'
            )
        if self.tolerant:  # resilience: a node that fails is left out by ddp.supervise
            said = (
                "python.stage: an unpack failed; ddp.supervise leaves out the nodes with no mark in"
            )
            out += [
                f'HPC_STAGE_OK="$HPC_RUN_DIR"/stage-ok-"${{{job_id_var}}}"',
                'mkdir -p "$HPC_STAGE_OK"',
                *spread,
                *(f'{line} || echo {shlex.quote(said)} "$HPC_STAGE_OK"' for line in unpack),
                *cleanup,
            ]
        else:
            out += [*spread, *unpack, *cleanup]
        out += [
            'export VIRTUAL_ENV="$HPC_STAGE_DEST"',
            'export PATH="$HPC_STAGE_DEST/bin${PATH:+:$PATH}"',
            "unset PYTHONHOME",
        ]
        return out


def check_spec_value(value: Any, where: str = "python.stage") -> str:
    if value not in STAGES:
        raise UserError(f"{where}: {value!r} is not allowed; allowed: {', '.join(STAGES)}")
    return str(value)


def check_pack_value(value: Any, where: str = "python.pack") -> str:
    if value not in PACK_AT:
        raise UserError(f"{where}: {value!r} is not allowed; allowed: {', '.join(PACK_AT)}")
    return str(value)


def profile_rule(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A profile's ``python_stage: {min_nodes: N, local_dir: PATH, source: URL}``."""
    value = data.get("python_stage")
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - set(PROFILE_KEYS):
        raise UserError(
            f"{where}: python_stage: {value!r} is not allowed; allowed: a mapping "
            f"with {', '.join(PROFILE_KEYS)}"
        )
    out: dict[str, Any] = {"source": str(value.get("source") or "")}
    nodes = value.get("min_nodes")
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise UserError(
                f"{where}: python_stage.min_nodes: {nodes!r} is not allowed; "
                "allowed: a whole number >= 1"
            )
        out["min_nodes"] = nodes
    local = value.get("local_dir", DEFAULT_LOCAL_DIR)
    if (
        not isinstance(local, str)
        or not local.startswith("/")
        or any(c.isspace() or c == "\0" for c in local)
    ):
        raise UserError(
            f"{where}: python_stage.local_dir: {local!r} is not allowed; allowed: "
            "an absolute path without blanks (the copy's #! lines name it)"
        )
    out["local_dir"] = local.rstrip("/") or "/"
    return out


def decide(job: Job) -> Stage | None:
    """Whether this job stages, and how (None: the shared venv is activated as before).

    One line (exit 2) for a stage the job cannot do: ``always`` with a conda
    environment (not relocatable by copying) or on a scheduler that starts no nodes."""
    python = job.spec.python if isinstance(job.spec.python, dict) else {}
    stage = python.get("stage", "auto")
    if stage == "never":
        return None
    if "venv" not in python:
        if "stage" in python:
            raise UserError(
                "python.stage: a conda environment cannot be moved by copying its "
                "folder; allowed: stage with {venv: PATH}, or leave stage out"
            )
        return None
    rule = job.cluster.python_stage
    if stage == "auto":
        threshold = rule.get("min_nodes")
        if threshold is None or job.nodes < threshold:
            return None
        why = (
            f"{job.nodes} nodes >= {threshold}, the {job.cluster.name} profile's "
            f"python_stage.min_nodes ({rule.get('source') or 'unverified'})"
        )
    else:
        why = "stage: always"
    if not (Path(python["venv"]) / "pyvenv.cfg").is_file():
        raise UserError(
            f"python.venv: {python['venv']!r} is not a virtual environment (no "
            "pyvenv.cfg), so it cannot be staged; allowed: the folder python -m "
            "venv made, or stage: never"
        )
    if job.scheduler.runs_here:
        raise UserError(
            f"python.stage: {stage}: the {job.cluster.name} profile runs the job on "
            "this machine, which has no nodes to stage to; allowed: never here"
        )
    return Stage(
        venv=str(python["venv"]),
        local_dir=rule.get("local_dir", DEFAULT_LOCAL_DIR),
        pack_at=str(python.get("pack", "submit")),
        why=why,
        asked=stage == "always",
        tolerant=bool(job.spec.resilience),
    )


def pack(stage: Stage, run_dir: Path) -> str:
    """Pack the venv into the run directory, atomically; returns a line for the user.

    The tar keeps symlinks as links (``bin/python`` -> the base interpreter) and the
    files' times, so the copied ``__pycache__`` entries stay valid for their sources."""
    venv, tar = Path(stage.venv), run_dir / TAR_NAME
    if not (venv / "pyvenv.cfg").is_file():
        raise UserError(
            f"python.venv: {stage.venv!r} is not a virtual environment (no "
            "pyvenv.cfg); allowed: the folder python -m venv made"
        )
    start, files, size = time.monotonic(), 0, 0
    tmp = tar.with_name(f".{tar.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as out:
            for root, dirs, names in os.walk(venv):
                dirs.sort()
                for name in [*dirs, *sorted(names)]:  # dirs sorted in place: walked in order
                    path = Path(root, name)
                    rel = path.relative_to(venv)
                    info = out.gettarinfo(str(path), arcname=str(rel))
                    if info.isreg():
                        files += 1
                        size += info.size
                        with open(path, "rb") as fh:
                            out.addfile(info, fh)
                    elif info.isdir() or info.issym():
                        out.addfile(info)
        os.replace(tmp, tar)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"python.stage: cannot pack {stage.venv!r} into {str(tar)!r}: {exc.strerror or exc}"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return (
        f"python.stage: packed {stage.venv} ({files} files, {size / 1e6:.1f} MB) into "
        f"{tar.name} in {time.monotonic() - start:.1f} s; {stage.why}"
    )


def note(stage: Stage) -> None:
    """Say once on stderr why the environment is staged, where the spec did not ask."""
    if not stage.asked:
        print(f"hpc: python.stage: {stage.why}", file=sys.stderr)
