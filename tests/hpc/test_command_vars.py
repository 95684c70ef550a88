"""``expand_vars``: ``$NAME``/``${NAME}`` in command words reach the job as the variable's
value; nothing else a word or a value holds is ever run, globbed or split (issue 26)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc.launchers import var_word
from hpc.render import render
from tests.hpc.conftest import REPO, make_job
from tests.hpc.test_injection import MARK, PAYLOADS, TEXT

NAMES = ["HPC_V1", "HPC_V2", "HPC_VAR_3"]
REFS = st.sampled_from([f"${n}" for n in NAMES] + [f"${{{n}}}" for n in NAMES])
PIECES = st.one_of(REFS, st.sampled_from(PAYLOADS), TEXT)
WORD = st.lists(PIECES, min_size=0, max_size=4).map("".join)
VALUE = st.one_of(st.sampled_from(PAYLOADS), TEXT.filter(bool))
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# no $NAME of its own: with expand_vars the outer shell would expand it (see hpc.launchers)
PROBE = 'printf "%s\\0" "$@"'
_REF = re.compile(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def _expected(word: str, env: dict[str, str]) -> str | None:
    """The word as the job sees it, written independently of hpc.launchers; None when a
    variable it names is unset or empty there (the job must stop)."""
    missing = False

    def sub(m: re.Match[str]) -> str:
        nonlocal missing
        value = env.get(m.group(1) or m.group(2), "")
        missing = missing or not value
        return value

    out = _REF.sub(sub, word)
    return None if missing else out


def _run_local(
    tmp_path: Path, values: dict[str, str], args: list[str]
) -> subprocess.CompletedProcess:
    # "-" first: printf with no argument would still print its format once
    job = make_job(
        "local",
        env=values,
        command=["bash", "-c", PROBE, "probe", "-", *args],
        wrap="never",
        expand_vars=True,
    )
    text = render(job)
    # a clean environment: only what the script itself exports, plus PATH
    return subprocess.run(
        ["bash", "-c", text],
        capture_output=True,
        timeout=30,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )


@SETTINGS
@given(values=st.lists(VALUE, min_size=3, max_size=3), args=st.lists(WORD, max_size=5))
def test_variables_expand_and_nothing_else_runs(
    tmp_path: Path, values: list[str], args: list[str]
) -> None:
    env = dict(zip(NAMES, values, strict=True))
    proc = _run_local(tmp_path, env, args)
    expected = [_expected(a, env) for a in args]
    assert not (tmp_path / MARK).exists(), "injected text was executed"
    if any(e is None for e in expected):  # a word names a variable the job lacks
        assert proc.returncode != 0 and b"parameter null or not set" in proc.stderr
        assert proc.stdout == b""
        return
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"".join(e.encode() + b"\0" for e in ["-", *expected])  # type: ignore[misc]
    assert list(tmp_path.iterdir()) == []  # no glob, no redirection made a file


@SETTINGS
@given(word=WORD)
def test_a_word_without_variables_is_quoted_as_before(word: str) -> None:
    import shlex

    if not _REF.search(word):
        assert var_word(word) == shlex.quote(word)
    else:
        _check_structure(var_word(word))


def _check_structure(text: str) -> None:
    """Read ``text`` as bash would: only single-quoted text, ``"'"`` (shlex's quote of a
    quote), ``"${NAME:?}"`` and characters no shell reads; anything else fails."""
    var = re.compile(r'"\$\{[A-Za-z_][A-Za-z0-9_]*:\?\}"')
    i = 0
    while i < len(text):
        if text[i] == "'":
            end = text.index("'", i + 1)  # ValueError: an unclosed quote
            i = end + 1
        elif text.startswith('"\'"', i):
            i += 3
        elif m := var.match(text, i):
            i = m.end()
        else:
            assert re.fullmatch(r"[\w@%+=:,./-]", text[i], re.ASCII), (text, i)
            i += 1


def test_hostile_values_and_words_run_nothing(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    env = {"HPC_V1": f"$(touch {MARK})", "HPC_V2": f"`touch {MARK}`", "HPC_VAR_3": "* ~ a b"}
    args = [
        "$HPC_V1/x",
        "${HPC_V2}",
        "$HPC_VAR_3",
        f"$(touch {MARK})$HPC_V1",
        f"`touch {MARK}`",
        "*",
        "~/$HPC_V1",
        "a$$HPC_V1",
    ]
    proc = _run_local(tmp_path, env, args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(b"\0")[:-1] == [
        b"-",
        f"$(touch {MARK})/x".encode(),
        f"`touch {MARK}`".encode(),
        b"* ~ a b",
        f"$(touch {MARK})$(touch {MARK})".encode(),
        f"`touch {MARK}`".encode(),
        b"*",
        f"~/$(touch {MARK})".encode(),
        f"a${env['HPC_V1']}".encode(),
    ]
    assert not (tmp_path / MARK).exists()


def test_off_by_default_words_stay_literal(tmp_path: Path) -> None:
    job = make_job(
        "local", command=["bash", "-c", PROBE, "probe", "$HOME/x", "${HOME}"], wrap="never"
    )
    proc = subprocess.run(
        ["bash", "-c", render(job)], capture_output=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"$HOME/x\0${HOME}\0"


def test_expand_vars_must_be_a_boolean(tmp_path: Path) -> None:
    from hpc.errors import UserError

    with pytest.raises(
        UserError, match="expand_vars: 'yes' is not allowed; allowed: true or false"
    ):
        make_job("local", command=["true"], expand_vars="yes")


@pytest.mark.parametrize("cluster", ["slurm", "pbs", "aurora", "perlmutter"])
def test_batch_scripts_parse_with_variables(cluster: str) -> None:
    extra = {"account": "p"} if cluster in ("aurora", "perlmutter") else {}
    job = make_job(
        cluster,
        expand_vars=True,
        command=[
            "python",
            "-m",
            "ddp",
            "uniref50",
            "--work_dir",
            "${PBS_O_WORKDIR}/x",
            "--datafile",
            f"$SCRATCH/d $(touch {MARK})`x`*",
        ],
        **extra,
    )
    text = render(job)
    assert '--work_dir "${PBS_O_WORKDIR:?}"/x' in text
    assert f"\"${{SCRATCH:?}}\"'/d $(touch {MARK})`x`*'" in text
    proc = subprocess.run(["bash", "-n"], input=text.encode(), capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_the_run_record_keeps_the_opt_in(tmp_path: Path) -> None:
    """spec.yaml of a run directory is a spec again (--resume): expand_vars must survive."""
    from hpc.spec import JobSpec

    job = make_job("local", command=["echo", "$HOME"], expand_vars=True)
    again = JobSpec.from_mapping(job.to_dict())
    assert again.expand_vars and again.command == ["echo", "$HOME"]
    assert "expand_vars" not in make_job("local", command=["echo"]).to_dict()


# --- the CLI: hpc run here, --dry-run, the real SLURM --------------------------------

WRITER = (
    "import pathlib, sys; p = pathlib.Path(sys.argv[sys.argv.index('--work_dir') + 1]); "
    "p.mkdir(parents=True); (p / 'done').write_text(' '.join(sys.argv[1:]))"
)


def _spec(path: Path, cluster: str, **fields) -> Path:
    data = {
        "name": "vars",
        "cluster": cluster,
        "expand_vars": True,
        "wrap": "never",
        "command": [
            sys.executable,
            "-c",
            WRITER,
            "--work_dir",
            "$SCRATCH/x",
            "--tag",
            "${HPC_TAG}",
            "--tag2",
            f"$(touch {MARK})`touch {MARK}`*",
        ],
        "env": {"HPC_TAG": "$(touch pwned)"},
    }
    data.update(fields)
    path.write_text(yaml.safe_dump(data))
    return path


def _hpc(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def _check_written(scratch: Path, cwd: Path) -> None:
    done = scratch / "x" / "done"
    assert done.is_file(), list(scratch.rglob("*"))
    assert done.read_text().endswith(
        f"--work_dir {scratch}/x --tag $(touch pwned) --tag2 $(touch {MARK})`touch {MARK}`*"
    )
    assert not (cwd / MARK).exists() and not (cwd / "pwned").exists()
    assert not (cwd / "$SCRATCH").exists()


def test_hpc_run_writes_under_the_jobs_scratch(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    spec = _spec(tmp_path / "vars.yaml", "local")
    proc = _hpc(
        "run",
        str(spec),
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
        env={"SCRATCH": str(scratch), "PYTHONPATH": f"{REPO}:{REPO / 'src'}"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_written(scratch, tmp_path)


def test_hpc_run_stops_when_the_variable_is_unset(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "vars.yaml", "local")
    env = {k: v for k, v in os.environ.items() if k != "SCRATCH"}
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", "run", str(spec), "--runs-dir", str(tmp_path / "runs")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "SCRATCH: parameter null or not set" in proc.stdout + proc.stderr
    assert not Path("/x/done").exists() and not (tmp_path / "x").exists()


def test_dry_run_shows_what_the_job_sees(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "vars.yaml", "local")
    proc = _hpc("run", "--dry-run", str(spec), cwd=tmp_path, env={"SCRATCH": "/scr/me"})
    assert proc.returncode == 0, proc.stderr
    assert '--work_dir "${SCRATCH:?}"/x' in proc.stdout  # the script: expanded by the job
    seen = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# the job sees"))
    assert (
        seen.startswith("# the job sees: ")
        and "--work_dir /scr/me/x --tag '$(touch pwned)'" in seen
    )
    env = {k: v for k, v in os.environ.items() if k != "SCRATCH"}
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", "render", str(spec)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "# the job sees (not set here: SCRATCH): " in proc.stderr
    assert "--work_dir '${SCRATCH}/x'" in proc.stderr
    assert "the job sees" not in proc.stdout  # the script itself does not depend on here


def test_the_flag_opts_in_and_is_in_the_regenerate_line(tmp_path: Path) -> None:
    proc = _hpc(
        "render",
        "--cluster",
        "local",
        "--expand-vars",
        "--",
        "echo",
        "$HOME/x",
        cwd=tmp_path,
        env={},
    )
    assert proc.returncode == 0, proc.stderr
    assert 'echo "${HOME:?}"/x' in proc.stdout
    assert "regenerate: hpc render --cluster local --expand-vars -- echo '$HOME/x'" in proc.stdout
    plain = _hpc("render", "--cluster", "local", "--", "echo", "$HOME/x", cwd=tmp_path, env={})
    assert "echo '$HOME/x'" in plain.stdout and "the job sees" not in plain.stderr


@pytest.mark.slurm
def test_slurm_job_writes_under_its_scratch(slurm_cluster, tmp_path: Path) -> None:
    from tests.test_e2e_schedulers import FINAL, log_of, wait_status

    scratch = tmp_path / "scratch"
    spec = _spec(
        tmp_path / "vars.yaml", "slurm", queue="debug", nodes=1, ppn=1, walltime="00:05:00"
    )
    runs = tmp_path / "runs"
    proc = _hpc(
        "submit",
        str(spec),
        "--runs-dir",
        str(runs),
        cwd=tmp_path,
        env={"SCRATCH": str(scratch), "PYTHONPATH": f"{REPO}:{REPO / 'src'}"},
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    (run_dir,) = runs.iterdir()
    assert wait_status(job_id, runs, FINAL) == "COMPLETED", log_of(run_dir)
    _check_written(scratch, tmp_path)
