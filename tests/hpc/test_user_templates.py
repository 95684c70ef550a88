"""Templates from a user's folder (``--templates DIR`` or a ``./templates`` picked up from the
working directory) are files the user may not have written: they render in Jinja's sandbox,
in a child process with bounded CPU, memory and output, and every way they can fail is one
line naming the template file and line (issue 24)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from hpc import render as render_mod
from hpc.errors import UserError
from hpc.render import render
from tests.hpc.conftest import make_job

MARK = "hpc_template_pwned"


def _job(cluster: str = "slurm"):
    return make_job(
        cluster, command=["python", "train.py"], **({"account": "p"} if cluster == "aurora" else {})
    )


def _user(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    folder = tmp_path / "tpl"
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        path = folder / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
    return folder


def _error(tmp_path: Path, files: dict[str, str | bytes], cluster: str = "slurm") -> str:
    folder = _user(tmp_path, files)
    with pytest.raises(UserError) as info:
        render(_job(cluster), templates=folder)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- no code runs from a template ------------------------------------------------------

ESCAPES = [
    # the classic ways out of a plain Jinja environment into Python
    "{{ cycler.__init__.__globals__.os.system('touch " + MARK + "') }}",
    "{{ lipsum.__globals__['os'].popen('touch " + MARK + "').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = namespace().__class__.__init__.__globals__ %}{{ x }}",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_python_escapes_are_refused_and_nothing_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    payload: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n" + payload + "\n"})
    assert "slurm.sh.j2 line 2" in message, message
    assert not (tmp_path / MARK).exists(), "template code ran Python"


def test_methods_of_the_project_objects_cannot_be_called(
    tmp_path: Path,
    fake_bin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``job.scheduler.cancel(...)`` would run scancel: data may be read, behaviour not."""
    fake_bin("scancel", "exit 0")
    message = _error(
        tmp_path,
        {"slurm.sh.j2": "#!/bin/bash\n# {{ job.nodes }}\n{{ job.scheduler.cancel('1') }}\n"},
    )
    assert "slurm.sh.j2 line 3" in message and "not safely callable" in message, message
    assert not fake_bin.log.exists(), fake_bin.log.read_text()


def test_a_user_common_block_included_by_a_builtin_template_is_sandboxed_too(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The built-in slurm.sh.j2 includes ``_common.sh.j2``: a user's one is found first."""
    monkeypatch.chdir(tmp_path)
    message = _error(tmp_path, {"_common.sh.j2": ESCAPES[0] + "\n"})
    assert "_common.sh.j2 line 1" in message, message
    assert not (tmp_path / MARK).exists()


def test_the_python_api_setup_lines_render_the_user_common_block_sandboxed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpc.executors.params import setup_lines

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "_common.sh.j2").write_text(ESCAPES[1] + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"_common\.sh\.j2 line 1"):
        setup_lines(_job())
    assert not (tmp_path / MARK).exists()


# --- every failure is one line naming the template and line -----------------------------


def test_runtime_error(tmp_path: Path) -> None:
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n# ok\n{{ 1 // 0 }}\n"})
    assert "slurm.sh.j2 line 3" in message and "ZeroDivisionError" in message, message


def test_syntax_error(tmp_path: Path) -> None:
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n{% if %}\n"})
    assert "slurm.sh.j2 line 2" in message, message


def test_missing_include(tmp_path: Path) -> None:
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n\n{% include 'nope.sh.j2' %}\n"})
    assert "slurm.sh.j2 line 3" in message and "'nope.sh.j2' not found" in message, message


def test_extending_the_builtin_of_the_same_name_says_how(tmp_path: Path) -> None:
    """``{% extends "slurm.sh.j2" %}`` in ./templates/slurm.sh.j2 finds itself (a loop that
    was a RecursionError traceback); ``builtin/slurm.sh.j2`` names the built-in one."""
    message = _error(tmp_path, {"slurm.sh.j2": "{% extends 'slurm.sh.j2' %}\n"})
    assert "slurm.sh.j2 line 1" in message and "builtin/slurm.sh.j2" in message, message
    folder = _user(tmp_path, {"slurm.sh.j2": "{% extends 'builtin/slurm.sh.j2' %}\n"})
    assert render(_job(), templates=folder) == render(_job())


def test_templates_that_include_each_other(tmp_path: Path) -> None:
    message = _error(
        tmp_path,
        {
            "slurm.sh.j2": "#!/bin/bash\n{% include 'a.j2' %}\n",
            "a.j2": "{% include 'b.j2' %}\n",
            "b.j2": "\n{% include 'a.j2' %}\n",
        },
    )
    assert "a.j2 line 1" in message or "b.j2 line 2" in message, message
    assert "nested too deeply" in message, message


def test_non_utf8_template(tmp_path: Path) -> None:
    message = _error(tmp_path, {"slurm.sh.j2": b"#!/bin/bash\n# caf\xe9\n"})
    assert "slurm.sh.j2" in message and "not UTF-8" in message and "line 2" in message, message


def test_a_named_pipe_as_template_is_refused_at_once(tmp_path: Path) -> None:
    folder = _user(tmp_path, {})
    os.mkfifo(folder / "slurm.sh.j2")
    with pytest.raises(UserError, match=r"slurm\.sh\.j2.*named pipe"):
        render(_job(), templates=folder)


def test_huge_output_is_bounded(tmp_path: Path) -> None:
    loop = (
        "{% for i in range(100000) %}{% for j in range(100000) %}"
        "0123456789abcdef{% endfor %}{% endfor %}"
    )
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n" + loop + "\n"})
    assert "slurm.sh.j2 line 2" in message and "MiB" in message, message


def test_endless_loop_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_mod, "USER_CPU_S", 1)  # the child inherits it
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n\n" + loop + "\n"})
    assert "slurm.sh.j2 line 3" in message and "CPU" in message, message


def test_memory_is_bounded(tmp_path: Path) -> None:
    message = _error(tmp_path, {"slurm.sh.j2": "#!/bin/bash\n{{ 'x' * 4000000000 }}\n"})
    assert "slurm.sh.j2 line 2" in message and "memory" in message, message


def test_a_user_template_renders_as_before(tmp_path: Path) -> None:
    folder = _user(
        tmp_path,
        {
            "slurm.sh.j2": "#!/bin/bash\n# {{ name|q }} {{ job.nodes }}\n"
            "{% macro loop_ok() %}{% for x in [1, 2] %}"
            "{{ loop.index }}{{ loop.cycle('a', 'b') }}{% endfor %}"
            "{% endmacro %}{% for m in modules %}{{ m|upper }}"
            "{% endfor %}{{ '%s-%d'|format('a', 3) }} "
            "{{ loop_ok() }} {{ 'a,b'.split(',')|join('+') }}\n"
            "{{ launch }}\n"
        },
    )
    text = render(_job(), templates=folder)
    assert text.startswith("#!/bin/bash\n# train 1\na-3 1a2b a+b\n"), text
    assert "python" in text


# --- say which template from the working directory is used ---------------------------


def test_a_template_from_the_working_directory_is_announced_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "templates").mkdir()
    own = tmp_path / "templates" / "slurm.sh.j2"
    own.write_text("#!/bin/bash\n{% include '_common.sh.j2' %}{{ launch }}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(render_mod, "_ANNOUNCED", set())
    with caplog.at_level(logging.INFO, logger="hpc.render"):
        first = render(_job())
        render(_job())
        render(_job("aurora"))  # the built-in pbs.sh.j2: nothing from here to announce
    assert first.startswith("#!/bin/bash\n")
    notes = [r.getMessage() for r in caplog.records if r.name == "hpc.render"]
    assert len(notes) == 1 and str(own.resolve()) in notes[0] and "working directory" in notes[0], (
        notes
    )
