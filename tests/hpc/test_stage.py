"""``python: {venv: P, stage: ...}``: when a job stages its venv, the lines it renders
per scheduler, the pack, and the one-line refusals (the real runs:
tests/test_e2e_stage.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest
import yaml

from hpc.errors import UserError
from hpc.spec import JobSpec
from hpc.stage import TAR_NAME, UNPACK, Stage, pack

ROOT = Path(__file__).resolve().parents[2]


def _hpc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [sys.executable, "-m", "hpc", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _spec(tmp: Path, python: object, **extra: object) -> Path:
    path = tmp / "job.yaml"
    path.write_text(
        yaml.safe_dump({"name": "st", "python": python, "command": ["python", "train.py"], **extra})
    )
    return path


@pytest.fixture
def a_venv(tmp_path: Path) -> Path:
    where = tmp_path / "venv's$HOME"  # a quote and a dollar: every use must be quoted
    venv.EnvBuilder(symlinks=True, with_pip=False).create(where)
    (where / "bin" / "tool").write_text(f"#!{where}/bin/python\nprint('tool')\n")
    (where / "bin" / "tool").chmod(0o755)
    return where


def _dry_run(tmp: Path, spec: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _hpc("submit", str(spec), "--dry-run", "--runs-dir", str(tmp / "runs"), *args, cwd=tmp)


def test_always_on_slurm_renders_sbcast_one_unpack_per_node_and_the_copy_first_on_path(
    tmp_path: Path, a_venv: Path
) -> None:
    proc = _dry_run(
        tmp_path,
        _spec(tmp_path, {"venv": str(a_venv), "stage": "always"}),
        "--cluster",
        "slurm",
        "--nodes",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert 'sbcast --force "$HPC_STAGE_TAR" "$HPC_STAGE_DEST.tar"' in text
    assert (
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
        '--ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$HPC_STAGE_UNPACK" unpack'
    ) in text
    assert 'export PATH="$HPC_STAGE_DEST/bin${PATH:+:$PATH}"' in text
    assert "bin/activate" not in text  # the shared venv is not activated
    # the order: HPC_RUN_DIR (where the pack is) before staging, staging before the launch
    assert text.index("export HPC_RUN_DIR=") < text.index("sbcast") < text.index("srun --kill")
    assert proc.stderr == ""  # asked for: nothing to say
    assert not list((tmp_path / "runs").glob("*/" + TAR_NAME))  # a dry run packs nothing
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_the_venv_path_reaches_the_script_only_quoted(tmp_path: Path, a_venv: Path) -> None:
    text = _dry_run(
        tmp_path, _spec(tmp_path, {"venv": str(a_venv), "stage": "always"}), "--cluster", "slurm"
    ).stdout
    # bash reads the unpack line's last word back as the exact path
    line = next(w for w in text.splitlines() if "unpack" in w and "srun" in w)
    words = subprocess.run(
        ["bash", "-c", 'eval "set -- ${LINE#*unpack }"; printf "%s\\n" "$3"'],
        env={"LINE": line, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert words == f"{a_venv}\n"


@pytest.mark.parametrize(("nodes", "staged"), [(1999, False), (2000, True)])
def test_auto_stages_on_aurora_from_the_cited_node_count(
    tmp_path: Path, a_venv: Path, nodes: int, staged: bool
) -> None:
    proc = _dry_run(
        tmp_path,
        _spec(tmp_path, {"venv": str(a_venv)}),
        "--cluster",
        "aurora",
        "--nodes",
        str(nodes),
        "--account",
        "P",
        "--walltime",
        "01:00:00",
    )
    assert proc.returncode == 0, proc.stderr
    unpack = f'mpiexec -n {nodes} --ppn 1 bash -c "$HPC_STAGE_UNPACK" unpack'
    assert (unpack in proc.stdout) is staged
    assert ("bin/activate" in proc.stdout) is not staged
    assert ("docs.alcf.anl.gov/aurora/data-management/copper" in proc.stderr) is staged


def test_never_and_profiles_without_a_rule_activate_the_shared_venv(
    tmp_path: Path, a_venv: Path
) -> None:
    never = _dry_run(
        tmp_path,
        _spec(tmp_path, {"venv": str(a_venv), "stage": "never"}),
        "--cluster",
        "aurora",
        "--nodes",
        "4000",
        "--account",
        "P",
        "--walltime",
        "01:00:00",
    )
    auto = _dry_run(
        tmp_path, _spec(tmp_path, {"venv": str(a_venv)}), "--cluster", "slurm", "--nodes", "4000"
    )
    for proc in (never, auto):
        assert proc.returncode == 0, proc.stderr
        assert "HPC_STAGE" not in proc.stdout and "bin/activate" in proc.stdout


def test_pack_at_job_start_renders_the_tar_on_the_first_node(tmp_path: Path, a_venv: Path) -> None:
    spec = _spec(tmp_path, {"venv": str(a_venv), "stage": "always", "pack": "job"})
    text = _dry_run(tmp_path, spec, "--cluster", "pbs", "--nodes", "2").stdout
    assert 'tar -cf "$HPC_STAGE_TAR.$$" -C ' in text
    assert text.index("tar -cf") < text.index("mpiexec -n 2 -ppn 1 bash -c")


@pytest.mark.parametrize(
    ("python", "says"),
    [
        (
            {"venv": "/v", "stage": "sometimes"},
            "python.stage: 'sometimes' is not allowed; allowed: auto, always, never",
        ),
        (
            {"venv": "/v", "pack": "later"},
            "python.pack: 'later' is not allowed; allowed: submit, job",
        ),
        (
            {"conda": "base", "stage": "always"},
            "python.stage: not allowed here; allowed: conda alone",
        ),
        ({"venv": "/v", "stge": "always"}, "python.stge: not allowed here"),
        ({"venv": "/v", "conda": "base"}, "allowed: {venv: PATH}, {conda: NAME} or site"),
    ],
)
def test_bad_values_are_one_line(python: object, says: str) -> None:
    with pytest.raises(UserError) as info:
        JobSpec.from_mapping({"command": ["x"], "python": python})
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_cli_says_one_line_and_exit_2(tmp_path: Path, a_venv: Path) -> None:
    local = _hpc(
        "submit",
        str(_spec(tmp_path, {"venv": str(a_venv), "stage": "always"})),
        "--cluster",
        "local",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert local.returncode == 2 and local.stderr.count("\n") == 1, local.stderr
    assert "has no nodes to stage to" in local.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_failed_pack_leaves_no_run_behind(tmp_path: Path) -> None:
    notvenv = tmp_path / "plain"
    notvenv.mkdir()
    proc = _hpc(
        "submit",
        str(_spec(tmp_path, {"venv": str(notvenv), "stage": "always"})),
        "--cluster",
        "slurm",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "is not a virtual environment (no pyvenv.cfg)" in proc.stderr
    assert proc.stderr.count("\n") == 1
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())  # no record of a job never submitted


def test_a_pack_that_cannot_be_written_leaves_no_run_behind(tmp_path: Path, a_venv: Path) -> None:
    # a FIFO in the venv is skipped, never opened (an open would wait for a writer)
    os.mkfifo(a_venv / "pipe")
    runs = tmp_path / "runs"
    runs.mkdir()
    # a file-size limit of 1 KiB: the pack's write fails as on a full disk (EFBIG)
    full = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -f 1; exec "$@"',
            "hpc",
            sys.executable,
            "-m",
            "hpc",
            "submit",
            str(_spec(tmp_path, {"venv": str(a_venv), "stage": "always"})),
            "--cluster",
            "slurm",
            "--runs-dir",
            str(runs),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}"),
    )
    assert full.returncode == 2, full.stderr
    assert "python.stage: cannot pack" in full.stderr and full.stderr.count("\n") == 1
    assert not any(runs.iterdir())


def test_pack_keeps_links_and_the_unpack_points_entry_points_at_the_copy(
    tmp_path: Path, a_venv: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    stage = Stage(venv=str(a_venv), local_dir=str(tmp_path / "node"), pack_at="submit", why="t")
    assert "packed" in pack(stage, run)
    with tarfile.open(run / TAR_NAME) as tar:
        python = tar.getmember("bin/python")
        assert python.issym()  # the base interpreter stays a link, never a copy
        assert "pyvenv.cfg" in tar.getnames()
    assert [p.name for p in run.iterdir()] == [TAR_NAME]  # no temporary left
    dest = tmp_path / "node-copy"
    # twice at once on one host (two emulated nodes): the first rename wins, nothing breaks
    procs = [
        subprocess.Popen(
            ["bash", "-c", UNPACK, "unpack", str(run / TAR_NAME), str(dest), str(a_venv)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert (dest / "bin" / "tool").read_text().splitlines()[0] == f"#!{dest}/bin/python"
    assert os.access(dest / "bin" / "tool", os.X_OK)
    assert not list(tmp_path.glob("node-copy.*"))  # the loser's folder is gone
    out = subprocess.run([str(dest / "bin" / "tool")], capture_output=True, text=True, timeout=60)
    assert out.stdout == "tool\n"
    prefix = subprocess.run(
        [str(dest / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert prefix == str(dest)


def test_under_resilience_a_failed_unpack_leaves_a_node_out_instead_of_ending_the_job(
    tmp_path: Path, a_venv: Path
) -> None:
    """With ``resilience:`` the unpack step does not end the job (no --kill-on-bad-exit,
    ``|| echo``), each node that unpacked leaves a mark, and the supervisor gets the marks'
    folder; the unpack script writes its node's mark (tests/ddp/test_relaunch.py: the
    supervisor leaves an unmarked node out)."""
    proc = _dry_run(
        tmp_path,
        _spec(tmp_path, {"venv": str(a_venv), "stage": "always"}, resilience=True),
        "--cluster",
        "slurm",
        "--nodes",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert 'HPC_STAGE_OK="$HPC_RUN_DIR"/stage-ok-"${SLURM_JOB_ID}"' in text
    unpack = next(x for x in text.splitlines() if "$HPC_STAGE_UNPACK" in x)
    assert "--kill-on-bad-exit" not in unpack and unpack.split(" || echo ")[0].endswith(
        ' "$HPC_STAGE_OK"'
    ), unpack
    assert '--staged="$HPC_STAGE_OK"' in text.split("ddp.supervise", 1)[1].split(" -- ")[0]
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    plain = _dry_run(
        tmp_path,
        _spec(tmp_path, {"venv": str(a_venv), "stage": "always"}),
        "--cluster",
        "slurm",
        "--nodes",
        "2",
    ).stdout
    assert "HPC_STAGE_OK" not in plain and "--kill-on-bad-exit=1 bash -c" in plain
    run, marks = tmp_path / "run", tmp_path / "marks"
    run.mkdir()
    marks.mkdir()
    stage = Stage(venv=str(a_venv), local_dir=str(tmp_path / "node"), pack_at="submit", why="t")
    pack(stage, run)
    env = {**os.environ, "SLURMD_NODENAME": "n7"}
    for dest, code in ((tmp_path / "copy", 0), (tmp_path / "no" / "such" / "copy", 1)):
        got = subprocess.run(
            [
                "bash",
                "-c",
                UNPACK,
                "unpack",
                str(run / TAR_NAME),
                str(dest),
                str(a_venv),
                str(marks),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert got.returncode == code, got.stderr
        assert sorted(p.name for p in marks.iterdir()) == (["n7"] if code == 0 else [])
        (marks / "n7").unlink(missing_ok=True)  # a mark only where the unpack worked
