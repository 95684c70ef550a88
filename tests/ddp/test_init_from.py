"""``model.init_from`` / ``--init_from``: starting weights from a Hugging Face folder, a
``final/model.pt`` export or a step checkpoint, for dpo and (generically) any recipe.

``--num_epochs 0`` trains nothing, so a run's ``final/model.pt`` is exactly the weights
it started from: each test compares that export with its source, tensor by tensor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the test extra installs it (setup.cfg)

import torch

from tests.ddp import _launch
from tests.ddp.dpo_fixtures import make_tiny_lm, write_pairs

os.environ["HF_HUB_OFFLINE"] = "1"


def _env() -> dict[str, str]:
    return {**_launch.base_env(), "HF_HUB_OFFLINE": "1"}


#: uniref50's defaults are SEDD small (768 wide): the tests take the tiny config.
TINY_UNIREF50 = str(Path(__file__).resolve().parents[2] / "configs" / "uniref50-tiny.yaml")


def _ddp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp", *args, "--set", "logging.progress=off"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=180,
    )


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final" / "model.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny LM folder, pairs, and run A: 3 steps from the LM, a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("init")
    lm = make_tiny_lm(root / "lm")
    data = write_pairs(root / "pairs.json", 10)
    run_a = root / "a"
    proc = _ddp(
        "dpo",
        "--model_name_or_path",
        str(lm),
        "--train_data",
        str(data),
        "--output_dir",
        str(run_a),
        "--max_steps",
        "3",
        "--learning_rate",
        "1e-2",
        "--set",
        "checkpoint.every_n_steps=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "lm": lm, "data": data, "a": run_a}


def test_from_hf_folder_on_two_ranks(setup: dict[str, Path], tmp_path: Path) -> None:
    """--init_from a model folder (the hub-id path) on 2 ranks: architecture and weights."""
    from safetensors.torch import load_file

    results = _launch.run(
        [
            "-m",
            "ddp",
            "dpo",
            "--init_from",
            str(setup["lm"]),
            "--train_data",
            str(setup["data"]),
            "--output_dir",
            str(tmp_path),
            "--num_epochs",
            "0",
            "--backend",
            "gloo",
        ],
        world=2,
        timeout=180,
    )
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    got, src = _final(tmp_path), load_file(setup["lm"] / "model.safetensors")
    assert src and all(torch.equal(got[k], v) for k, v in src.items())
    assert torch.equal(got["lm_head.weight"], src["transformer.wte.weight"])  # tied


def test_from_final_export(setup: dict[str, Path], tmp_path: Path) -> None:
    proc = _ddp(
        "dpo",
        "--model_name_or_path",
        str(setup["lm"]),
        "--init_from",
        str(setup["a"] / "final" / "model.pt"),
        "--train_data",
        str(setup["data"]),
        "--output_dir",
        str(tmp_path),
        "--num_epochs",
        "0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.init_from: weights loaded from" in proc.stderr + proc.stdout
    assert _same(_final(tmp_path), _final(setup["a"]))


def test_from_step_checkpoint_model_only(setup: dict[str, Path], tmp_path: Path) -> None:
    """The step-2 checkpoint's model (not the final step-3 weights, not its optimizer);
    a checkpoint directory gives its newest checkpoint (step 3)."""
    from ddp import checkpoint

    step2 = setup["a"] / "step_000000002.pt"
    saved = checkpoint.read_checkpoint(step2)["model"]
    assert not _same(saved, _final(setup["a"]))  # the two sources differ
    proc = _ddp(
        "dpo",
        "--model_name_or_path",
        str(setup["lm"]),
        "--init_from",
        str(step2),
        "--train_data",
        str(setup["data"]),
        "--output_dir",
        str(tmp_path / "b"),
        "--num_epochs",
        "0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _same(_final(tmp_path / "b"), saved)
    proc = _ddp(
        "dpo",
        "--model_name_or_path",
        str(setup["lm"]),
        "--init_from",
        str(setup["a"]),
        "--train_data",
        str(setup["data"]),
        "--output_dir",
        str(tmp_path / "c"),
        "--num_epochs",
        "0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _same(_final(tmp_path / "c"), _final(setup["a"]))


def test_resume_wins_over_init_from(setup: dict[str, Path], tmp_path: Path) -> None:
    """A run that resumes continues from its checkpoint, whatever init_from says."""
    other = make_tiny_lm(tmp_path / "other", seed=3)
    cmd = [
        "dpo",
        "--model_name_or_path",
        str(setup["lm"]),
        "--init_from",
        str(other),
        "--train_data",
        str(setup["data"]),
        "--output_dir",
        str(tmp_path / "r"),
        "--max_steps",
        "2",
        "--learning_rate",
        "1e-2",
    ]
    assert _ddp(*cmd).returncode == 0
    first = _final(tmp_path / "r")
    proc = _ddp(*cmd)  # resume: auto finds step 2, max_steps reached, exports again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _same(_final(tmp_path / "r"), first)
    from safetensors.torch import load_file

    src = load_file(other / "model.safetensors")
    assert not torch.equal(first["transformer.wte.weight"], src["transformer.wte.weight"])


def test_mismatch_is_one_line_exit_2(setup: dict[str, Path], tmp_path: Path) -> None:
    """The tiny LM's export into dpo's built-in demo GPT-2 (another width and vocabulary)."""
    proc = _ddp(
        "dpo",
        "--init_from",
        str(setup["a"] / "final" / "model.pt"),
        "--train_data",
        str(setup["data"]),
        "--output_dir",
        str(tmp_path),
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddp: error: model.init_from: ")
    assert "'transformer.wte.weight' is (" in lines[0] and "allowed:" in lines[0]
    assert not (tmp_path / "final").exists()


def test_generic_recipe_export_and_mismatch(tmp_path: Path) -> None:
    """uniref50 (no init_from code of its own): the generic loader in ``python -m ddp``."""
    base = [
        "uniref50",
        "--config",
        TINY_UNIREF50,
        "--set",
        "training.epochs=1",
        "training.max_steps=2",
    ]
    assert _ddp(*base, "--output_dir", str(tmp_path / "a")).returncode == 0
    src = tmp_path / "a" / "final" / "model.pt"
    proc = _ddp(
        "uniref50",
        "--config",
        TINY_UNIREF50,
        "--init_from",
        str(src),
        "--output_dir",
        str(tmp_path / "b"),
        "--set",
        "training.epochs=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _same(_final(tmp_path / "b"), _final(tmp_path / "a"))
    proc = _ddp(
        "uniref50",
        "--config",
        TINY_UNIREF50,
        "--init_from",
        str(src),
        "--output_dir",
        str(tmp_path / "c"),
        "--set",
        "model.d_model=32",
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "does not fit this model: 'embed.weight' is (23, 64) there and (23, 32) here" in lines[0]
    for bad, msg in [
        (tmp_path / "nope.pt", "does not exist"),
        (tmp_path / "junk.pt", "is not a loadable weights file"),
    ]:
        if bad.name == "junk.pt":
            bad.write_bytes(b"\x00not a pickle")
        proc = _ddp(
            "uniref50",
            "--config",
            TINY_UNIREF50,
            "--init_from",
            str(bad),
            "--output_dir",
            str(tmp_path / "d"),
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and msg in lines[0], proc.stderr


def test_load_into_names_first_mismatch() -> None:
    """Unit level: missing, unexpected and reshaped keys; a tied key may be absent."""
    from torch import nn

    from ddp.errors import ConfigError
    from ddp.init_from import load_into

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    w = torch.arange(15.0).view(5, 3)
    load_into(m, {"emb.weight": w}, "src")  # head.weight: tied, may be absent
    assert torch.equal(m.head.weight, w)
    with pytest.raises(ConfigError, match=r"'emb.weight' is \(5, 4\) there and \(5, 3\) here"):
        load_into(m, {"emb.weight": torch.zeros(5, 4)}, "src")
    with pytest.raises(ConfigError, match="it has 'extra', which this model lacks"):
        load_into(m, {"emb.weight": w, "extra": w}, "src")
    lin = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="it has no 'bias'"):
        load_into(lin, {"weight": torch.zeros(2, 2)}, "src")


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def test_crafted_files_are_refused_without_running_anything(tmp_path: Path) -> None:
    """A pickle that would call a function, a checkpoint whose digest does not match, a
    safetensors folder with a damaged file: one ConfigError line each, nothing runs."""
    import hashlib
    import pickle

    from ddp import checkpoint
    from ddp.errors import ConfigError
    from ddp.init_from import read_state

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"w": _Evil(str(marker))}))
    with pytest.raises(ConfigError, match="is not a loadable weights file"):
        read_state(str(evil))
    assert not marker.exists()
    ck = tmp_path / "step_000000001.pt"
    checkpoint.atomic_save_digested({"format": 2, "global_step": 1, "model": {}}, ck)
    ck.with_name(ck.name + ".sha256").write_text(hashlib.sha256(b"other").hexdigest())
    with pytest.raises(ConfigError, match="does not match its digest"):
        read_state(str(ck))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="is no readable safetensors file"):
        read_state(str(folder))
