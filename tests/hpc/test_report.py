"""hpc report: metrics.jsonl of one or several runs -> one PNG and a summary table."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from hpc import report as rpt
from hpc import sweep
from hpc.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _lines(lr: float, steps: int = 60, t0: float = 1000.0, every: int = 20) -> list[dict]:
    """What the trainer writes: train lines each step, an eval line every ``every``."""
    recs: list[dict] = []
    for step in range(1, steps + 1):
        recs.append(
            {
                "kind": "train",
                "step": step,
                "epoch": 0,
                "time": t0 + step,
                "loss": 2.0 * math.exp(-lr * step),
                "lr": lr,
                "samples_per_s": 100.0 * (1 + lr),
                "step_time_s": 0.01,
                "memory_mb": 12.5,
            }
        )
        if step % every == 0:
            recs.append(
                {
                    "kind": "eval",
                    "step": step,
                    "epoch": 0,
                    "time": t0 + step,
                    "loss": 2.1 * math.exp(-lr * step),
                    "accuracy": 0.5,
                }
            )
    return recs


def _write(path: Path, recs: list[dict], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)
    return path


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def _pixels_near(png: Path, hex_color: str, tol: float = 0.06) -> int:
    """How many pixels of the image are (nearly) this colour."""
    import numpy as np
    from matplotlib import colors
    from matplotlib.image import imread

    img = imread(str(png))[..., :3]
    target = np.array(colors.to_rgb(hex_color))
    return int((np.abs(img - target).max(axis=-1) < tol).sum())


def test_two_runs_overlaid_in_one_png(tmp_path: Path):
    from rich.console import Console

    a = tmp_path / "lr-0.1"
    b = tmp_path / "lr-0.02"
    _write(a / "metrics.jsonl", _lines(0.1))
    _write(b / "metrics.jsonl", _lines(0.02, t0=5000.0))
    buf = io.StringIO()
    result = rpt.report([a, b], console=Console(file=buf, width=200, color_system=None))

    assert result.png == a / "report.png"
    data = result.png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    from matplotlib.image import imread

    height, width = imread(str(result.png)).shape[:2]
    assert (width, height) == (900, 1000)

    assert result.labels == ["lr-0.1", "lr-0.02"]
    by_label = {s.label: s for s in result.series}
    assert by_label["lr-0.1"].values("lr") == [0.1] * 60
    assert by_label["lr-0.02"].values("lr") == [0.02] * 60
    assert [s for s, _ in by_label["lr-0.1"].eval_loss] == [20, 40, 60]
    # Both series were drawn in different colours, each over far more pixels than a
    # legend handle alone covers.
    colors = [s.color for s in result.series]
    assert len(set(colors)) == 2
    for color in colors:
        assert _pixels_near(result.png, color) > 300, color

    rows = {r.label: r for r in result.runs}
    assert rows["lr-0.1"].steps == 60 and rows["lr-0.1"].last_lr == 0.1
    assert rows["lr-0.1"].best_eval_loss == pytest.approx(2.1 * math.exp(-0.1 * 60))
    assert rows["lr-0.1"].mean_samples_per_s == pytest.approx(110.0)
    assert rows["lr-0.02"].wall_time_s == pytest.approx(59.0)
    table = buf.getvalue()
    assert "lr-0.1" in table and "lr-0.02" in table and "0:00:59" in table
    assert f"plot: {result.png}" in table


def test_one_run_is_drawn_in_one_colour(tmp_path: Path):
    """The control for the pixel check above: the second colour is absent with one run."""
    _write(tmp_path / "metrics.jsonl", _lines(0.1))
    result = rpt.report([tmp_path])
    assert _pixels_near(result.png, result.series[0].color) > 300
    assert _pixels_near(result.png, "C1") < 20


def test_sweep_tasks_are_labelled_by_their_overrides(tmp_path: Path):
    tasks = sweep.tasks_from_flags(["optim.lr=0.1,0.02,0.5"])
    sweep.write_manifest(tmp_path, tasks)
    _write(sweep.task_dir(tmp_path, tasks[0]) / "metrics.jsonl", _lines(0.1))
    _write(sweep.task_dir(tmp_path, tasks[1]) / "checkpoints" / "metrics.jsonl", _lines(0.02))
    # task 2 has not started: no file, left out
    result = rpt.report([tmp_path], out=tmp_path / "sweep.png")
    assert result.png == tmp_path / "sweep.png" and result.png.is_file()
    assert result.labels == ["optim.lr=0.1", "optim.lr=0.02"]


def test_checkpoint_dir_and_unique_labels(tmp_path: Path):
    one = tmp_path / "x" / "train"
    two = tmp_path / "y" / "train"
    _write(one / "checkpoints" / "metrics.jsonl", _lines(0.1))
    _write(two / "metrics.jsonl", _lines(0.2))
    result = rpt.report([one, two], out=tmp_path)
    assert result.png == tmp_path / "report.png"
    assert result.labels == ["train checkpoints", "train"]


def test_runs_of_one_name_get_unique_labels(tmp_path: Path):
    runs = [tmp_path / d / "train" for d in ("x", "y")]
    for run in runs:
        _write(run / "metrics.jsonl", _lines(0.1, steps=3))
    assert rpt.report(runs).labels == ["train", "train (2)"]


def test_partial_last_line_blank_lines_and_missing_keys(tmp_path: Path):
    recs = _lines(0.1, steps=5)
    del recs[2]["lr"]  # a line without lr
    recs.insert(1, {"kind": "train", "loss": 1.0})  # no step: skipped
    path = _write(tmp_path / "metrics.jsonl", recs, tail='\n\n{"kind": "train", "step": 6, "lo')
    series = rpt.read_metrics(path, "run")
    assert [s for s, _ in series.train["loss"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in series.train["lr"]] == [1, 2, 4, 5]
    assert rpt.report([tmp_path]).runs[0].steps == 5


def test_nan_and_inf_do_not_crash(tmp_path: Path):
    recs = _lines(0.1, steps=40)
    recs[5]["loss"] = math.nan
    recs[6]["loss"] = math.inf
    last_train = max(i for i, r in enumerate(recs) if r["kind"] == "train")
    recs[last_train]["loss"] = math.nan  # the last loss logged
    recs[last_train - 1]["samples_per_s"] = -math.inf
    _write(tmp_path / "metrics.jsonl", recs)  # json.dumps writes NaN / Infinity
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
    result = rpt.report([tmp_path])
    row = result.runs[0]
    assert math.isnan(row.last_loss)
    assert row.best_eval_loss == pytest.approx(2.1 * math.exp(-0.1 * 40))
    assert math.isfinite(row.mean_samples_per_s)
    assert result.png.read_bytes()[:8] == PNG_SIGNATURE


def test_a_step_logged_twice_keeps_the_last(tmp_path: Path):
    recs = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 1, "loss": 1.0},
        {"kind": "other", "step": 3, "loss": 9.0},
        {"step": True, "loss": 9.0},
        {"step": 2**60, "loss": 9.0},
        {"step": 4, "loss": "9", "lr": None},
    ]
    series = rpt.read_metrics(_write(tmp_path / "m.jsonl", recs), "r")
    assert series.train == {"loss": [(1, 1.0), (2, 2.0)]}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "line 1: not UTF-8 text"),
        (b'{"step": 1}\n\x00\x00\x00\n{"step": 2}\n', "line 2: holds NUL bytes"),
        (b'{"step": 1, "loss": 1.0}\n\xff\xfe\xfd\n', "line 2: not UTF-8 text"),
        (b'{"step": 1}\nnot json\n{"step": 2}\n', "line 2: not JSON"),
        (b"[1, 2, 3]\n", "line 1: a JSON list, not an object"),
        (b"[" * 200_000 + b"\n{}\n", "line 1: not JSON"),
        (b"x" * (rpt.MAX_LINE + 10), "line 1: longer than"),
    ],
    ids=["png", "nul", "latin1", "garbage-mid-file", "list", "deep", "long-line"],
)
def test_bad_file_is_one_line_naming_it(tmp_path: Path, content: bytes, expected: str):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    message = _error(rpt.report, [tmp_path])
    assert expected in message and str(path) in message
    assert not (tmp_path / "report.png").exists()


def test_empty_or_missing_metrics(tmp_path: Path):
    assert "no metrics.jsonl in" in _error(rpt.report, [tmp_path])
    (tmp_path / "metrics.jsonl").write_text("")
    assert "no metrics logged yet" in _error(rpt.report, [tmp_path])
    assert "not a run directory" in _error(rpt.report, [tmp_path / "nope"])
    assert "no run directory" in _error(rpt.report, [])


def test_out_in_missing_folder(tmp_path: Path):
    _write(tmp_path / "metrics.jsonl", _lines(0.1, steps=3))
    assert "does not exist" in _error(rpt.report, [tmp_path], out=tmp_path / "no" / "r.png")


def test_metrics_file_path_and_no_leftover_temp(tmp_path: Path):
    path = _write(tmp_path / "run" / "metrics.jsonl", _lines(0.1, steps=3))
    result = rpt.report([path])
    assert result.png == tmp_path / "run" / "report.png"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl", "report.png"]


def test_many_series_draw_without_legend(tmp_path: Path):
    runs = []
    for i in range(rpt.MAX_LEGEND + 1):
        runs.append(tmp_path / f"r{i}")
        _write(runs[-1] / "metrics.jsonl", _lines(0.01 * (i + 1), steps=3))
    result = rpt.report(runs)
    assert len(result.series) == rpt.MAX_LEGEND + 1
    assert len({s.color for s in result.series}) == rpt.MAX_LEGEND + 1


def test_missing_matplotlib_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    _write(tmp_path / "metrics.jsonl", _lines(0.1, steps=3))
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert "pip install 'hpc-ddp[report]'" in _error(rpt.report, [tmp_path])


def test_import_hpc_report_does_not_import_matplotlib_or_rich():
    import subprocess
    import sys

    code = "import sys, hpc.report; print(any(m.split('.')[0] in ('matplotlib', 'rich', 'torch') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lines_as_the_trainer_writes_them(tmp_path: Path):
    """Copied from a real `python -m ddp dpo` run: recipes name their eval loss eval_loss."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "train", "step": 2, "epoch": 0, "time": 1795564643.435, "loss": 0.6934957504272461, "margin": -0.0006731867324560881, "reward_acc": 0.40625, "samples_per_s": 169.50446629926424, "step_time_s": 0.09439279300022463, "lr": 0.0006, "memory_mb": 330.78125}\n'
        '{"kind": "train", "step": 4, "epoch": 0, "time": 1795564643.493, "loss": 0.686271071434021, "margin": 0.014029956422746181, "reward_acc": 0.71875, "samples_per_s": 557.9907978846751, "step_time_s": 0.028674308000518067, "lr": 0.001, "memory_mb": 332.24609375}\n'
        '{"kind": "eval", "step": 4, "epoch": 0, "time": 1795564655.779, "eval_loss": 0.6634882688522339, "eval_margin": 0.06705265864729881, "eval_reward_acc": 0.59375}\n'
    )
    (row,) = rpt.report([tmp_path]).runs
    assert (row.steps, row.last_loss, row.last_lr) == (4, 0.686271071434021, 0.001)
    assert row.best_eval_loss == 0.6634882688522339
    assert row.wall_time_s == pytest.approx(12.344)


# ---- issue 24: user text through rich, values past the plot, the PNG's mode and path ----


@pytest.mark.parametrize("name", ["[/x]", "[bold red]lr", "a[link=file:///etc]b"])
def test_run_names_with_brackets_print_as_they_are(name: str, tmp_path: Path):
    """A label is a folder name or a sweep's KEY=VALUE: user text, never rich markup
    (``[/x]`` raised MarkupError; ``[bold red]`` vanished into a style)."""
    from rich.console import Console

    run = tmp_path / name
    _write(run / "metrics.jsonl", _lines(0.1, steps=3))
    other = tmp_path / "plain"
    _write(other / "metrics.jsonl", _lines(0.2, steps=3))
    out = io.StringIO()
    rpt.report([run, other], console=Console(file=out, width=300, color_system=None))
    text = out.getvalue()
    assert f"│ {run.name} " in text  # the label: its folder's name ('[/x]' is x] in [)
    assert f"plot: {run / 'report.png'}" in text


def test_sweep_labels_with_brackets_print_as_they_are(tmp_path: Path):
    """A sweep's labels are its KEY=VALUE overrides, and a value may hold '[/x]'."""
    from rich.console import Console

    tasks = sweep.tasks_from_flags(["model.tag=[/x],[bold]b"])
    sweep.write_manifest(tmp_path, tasks)
    for task in tasks:
        _write(sweep.task_dir(tmp_path, task) / "metrics.jsonl", _lines(0.1, steps=3))
    out = io.StringIO()
    result = rpt.report([tmp_path], console=Console(file=out, width=300, color_system=None))
    assert result.labels == ["model.tag=[/x]", "model.tag=[bold]b"]
    assert "│ model.tag=[/x] " in out.getvalue() and "│ model.tag=[bold]b " in out.getvalue()


def test_cli_report_of_a_bracketed_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from hpc.cli import main

    run = tmp_path / "[/lr=0.1]"
    _write(run / "metrics.jsonl", _lines(0.1, steps=3))
    assert main(["report", str(run)]) == 0
    assert "[/lr=0.1]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("losses", "left_out"),
    [
        ([1.0, 1e308, 2.0], "1 of 3 loss points not drawn (beyond ±1e+100)"),
        ([1e308, 1e308], "2 of 2 loss points not drawn (beyond ±1e+100)"),
        ([-1e308, 1e308, 1.0], "2 of 3 loss points not drawn (beyond ±1e+100)"),
        ([1.0, math.inf, -math.inf, math.nan], "3 of 4 loss points not drawn (NaN, inf)"),
        ([math.nan, math.nan], "2 of 2 loss points not drawn (NaN)"),
    ],
    ids=["one-huge", "all-huge-equal", "both-signs", "non-finite", "all-nan"],
)
def test_huge_and_non_finite_values_are_gaps_with_a_note(
    losses: list[float], left_out: str, tmp_path: Path
):
    """Two points at 1e308 raised ``ValueError: arange: cannot compute length`` inside
    matplotlib; now such points are gaps in the line, each series says how many."""
    from rich.console import Console

    recs = [{"kind": "train", "step": i + 1, "loss": v, "lr": 0.1} for i, v in enumerate(losses)]
    recs.append({"kind": "eval", "step": 1, "loss": 1e308})
    _write(tmp_path / "run" / "metrics.jsonl", recs)
    out = io.StringIO()
    result = rpt.report([tmp_path / "run"], console=Console(file=out, width=300))
    assert result.png.read_bytes()[:8] == PNG_SIGNATURE
    assert f"run: {left_out}" in result.notes
    assert "run: 1 of 1 eval loss points not drawn (beyond ±1e+100)" in result.notes
    assert not any("lr" in n for n in result.notes)  # its points are all drawn
    assert f"note: run: {left_out}" in out.getvalue()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_the_png_has_the_mode_of_the_runs_other_files(umask: int, tmp_path: Path):
    """It came out 0600 (mkstemp's mode) next to 0644 files."""
    import os

    from hpc.runs import create_free

    old = os.umask(umask)
    try:
        other = create_free(tmp_path, "job", ".sh", "x")  # how submit writes a run's files
        _write(tmp_path / "metrics.jsonl", _lines(0.1, steps=3))
        png = rpt.report([tmp_path]).png
    finally:
        os.umask(old)
    assert (png.stat().st_mode & 0o777) == (other.stat().st_mode & 0o777) == 0o644 & ~umask


@pytest.mark.parametrize("kind", ["fifo", "char-device", "link-to-device"])
def test_output_onto_what_is_not_a_regular_file_is_refused_and_left_alone(
    kind: str, tmp_path: Path
):
    """``-o /dev/null`` as root replaced the device with a PNG (os.replace over it); a
    device node or FIFO made here stands in for /dev/null."""
    import os
    import stat

    _write(tmp_path / "metrics.jsonl", _lines(0.1, steps=3))
    target = tmp_path / "out.png"
    if kind == "fifo":
        os.mkfifo(target)
        check = stat.S_ISFIFO
    else:
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        node = tmp_path / "null" if kind == "link-to-device" else target
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        if kind == "link-to-device":
            target.symlink_to(node)
        check = stat.S_ISCHR
    message = _error(rpt.report, [tmp_path], out=target)
    assert "not a regular file" in message and str(target) in message
    assert check(os.stat(target).st_mode)  # still the FIFO or device, not a PNG
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_fifo_as_metrics_file_is_one_line_not_a_hang(tmp_path: Path):
    import os
    import threading

    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            rpt.read_metrics(fifo, "x")
        except BaseException as exc:
            caught.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)  # a bound against the hang under test only
    if reader.is_alive():  # blocked in open(): give it a writer so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("read_metrics blocked on a named pipe")
    assert len(caught) == 1 and isinstance(caught[0], UserError), caught
    assert "named pipe" in str(caught[0]) and "\n" not in str(caught[0])
