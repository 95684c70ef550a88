"""Real CUDA runs on one GPU: device and backend choice, AMP (bf16, fp16 + GradScaler),
bit-exact resume, the CPU-loadable export, FSDP at world 1, the CUDA-only options.

Every test skips, with the reason, where ``torch.cuda.is_available()`` is False (CI has
no GPU). One GPU means world 1: NCCL cannot run two ranks on one device, so the
collectives across ranks are not exercised here. Each run is its own process started
with torchrun's variables (tests/ddp/_launch.py), as the CPU tests start theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp import checkpoint as ckpt
from tests.ddp import _launch
from tests.ddp.launch_utils import clean_env
from tests.ddp.test_trainer_dist import EXPORT_CHECK, _assert_same, _cfg, _ok
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
    ),
]

WORKER = "tests/gpu/_cuda_worker.py"
ROOT = Path(__file__).resolve().parents[2]
N, BATCH, EPOCHS, STOP = 128, 8, 2, 10  # 32 optimizer steps; the partial run stops at 10


def _spec(tmp: Path, name: str, precision: str, ck: Path | None, **extra: object) -> dict:
    cfg = _cfg(
        ck,
        training={"shuffle": True, "epochs": EPOCHS, "seed": 3, "batch_size": BATCH},
        optim={"name": "adamw", "lr": 0.01, "warmup_steps": 3},
    )
    cfg["precision"] = precision
    for section, values in extra.pop("sections", {}).items():  # type: ignore[union-attr]
        cfg.setdefault(section, {}).update(values)
    return {
        "config": cfg,
        "n": N,
        "dropout": 0.2,
        "report": str(tmp / f"{name}.json"),
        "out": str(tmp / f"{name}.pt"),
        **extra,
    }


def _start(spec: dict) -> list[subprocess.Popen]:
    return _launch.start([WORKER, json.dumps(spec)], world=1)


def _report(spec: dict) -> dict:
    with open(spec["report"]) as fh:
        return json.load(fh)


def _weights(spec: dict) -> dict:
    return torch.load(spec["out"], weights_only=True)


def _latest(directory: Path) -> dict:
    found = ckpt.load_latest(directory)
    assert found is not None, f"no checkpoint in {directory}"
    return found[1]


def _rank_state(directory: Path, rank: int = 0) -> dict:
    """Rank ``rank``'s own file of the newest checkpoint (format 3 keeps each rank's RNG
    and sampler position there, not in the shared file)."""
    found = ckpt.load_latest(directory)
    assert found is not None, f"no checkpoint in {directory}"
    return ckpt.read_rank_state(found[0], rank, found[1])


# ---- ddp.init ---------------------------------------------------------------------------
INIT_SCRIPT = """
import json, torch, ddp
ctx = ddp.init()
ddp.barrier()  # world 1: a no-op, but it must not fail
print("REPORT " + json.dumps({"device": str(ctx.device), "backend": ctx.backend,
      "world": ctx.world_size, "launcher": ctx.launcher,
      "current": torch.cuda.current_device()}))
ddp.shutdown()
"""


@pytest.mark.parametrize("how", ["torchrun", "env"])
def test_init_picks_cuda_and_nccl(tmp_path: Path, how: str) -> None:
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    if how == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--master-port",
            str(free_port()),
            str(script),
        ]
        env = clean_env()
    else:
        cmd = [sys.executable, str(script)]
        env = clean_env(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("REPORT "))
    got = json.loads(line[len("REPORT ") :])
    assert (got["device"], got["backend"], got["world"], got["current"]) == (
        "cuda:0",
        "nccl",
        1,
        0,
    ), got


# ---- AMP, GradScaler, resume, export ----------------------------------------------------
PRECISIONS = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


@pytest.fixture(scope="module", params=list(PRECISIONS))
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per precision: one uninterrupted run, and one stopped at max_steps then resumed.

    fp16 multiplies the loss by 1000 (AdamW does not care about the loss's scale): its
    gradients overflow at GradScaler's initial 65536, the scaler skips steps and halves
    the scale, so a resume that did not restore the scaler would skip other steps and
    end elsewhere. The bf16 run pins its batches and loads them with 2 workers."""
    precision = request.param
    tmp = tmp_path_factory.mktemp(precision)
    extra: dict = {"loss_mult": 1000.0} if precision == "fp16" else {}
    if precision == "bf16":
        extra["sections"] = {"data": {"pin_memory": True, "num_workers": 2}}
    full = _spec(tmp, "full", precision, tmp / "full", **extra)
    part = _spec(tmp, "part", precision, tmp / "part", **extra)
    part["config"]["training"]["max_steps"] = STOP
    procs = [_start(s) for s in (full, part)]
    for p in procs:
        _ok(_launch.finish(p, timeout=180))
    stopped = _report(part)
    checkpoint = _latest(tmp / "part")
    part["config"]["training"]["max_steps"] = None
    _ok(_launch.run([WORKER, json.dumps(part)], world=1, timeout=180))
    return {
        "precision": precision,
        "tmp": tmp,
        "full": full,
        "part": part,
        "stopped": stopped,
        "checkpoint": checkpoint,
    }


def test_trains_on_cuda_with_amp(resumed: dict) -> None:
    r = _report(resumed["full"])
    assert (r["device"], r["backend"], r["param_device"], r["batch_device"]) == (
        "cuda:0",
        "nccl",
        "cuda:0",
        "cuda:0",
    ), r
    assert r["out_dtype"] == PRECISIONS[resumed["precision"]]  # autocast really on (or off)
    losses = r["losses"]
    assert len(losses) == N // BATCH * EPOCHS
    assert all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.8 * first, (first, last)
    # the CUDA allocator's statistics, not the process RSS of the CPU path
    assert 0 < r["summary"]["peak_memory_mb"] < 1024, r["summary"]
    assert 0 < r["last_metrics"]["memory_mb"] <= r["summary"]["peak_memory_mb"]


def test_resume_on_cuda_is_bit_exact(resumed: dict) -> None:
    full, part = _report(resumed["full"]), _report(resumed["part"])
    assert resumed["stopped"]["summary"]["steps"] == STOP
    assert resumed["stopped"]["losses"] == full["losses"][:STOP]
    # the resumed run's losses are the uninterrupted run's, bit for bit (dropout draws
    # from the restored CUDA RNG; batches from the restored sampler position)
    assert part["losses"] == full["losses"][STOP:]
    assert part["summary"]["steps"] == full["summary"]["steps"] == N // BATCH * EPOCHS
    _assert_same(_weights(resumed["part"]), _weights(resumed["full"]), atol=0.0)
    # the CUDA generator's state is saved, in rank 0's own file
    assert "cuda" in _rank_state(resumed["tmp"] / "part")["rank_rng"]


def test_fp16_grad_scaler_state_saved_and_restored(resumed: dict) -> None:
    scaler = resumed["checkpoint"]["scaler"]
    if resumed["precision"] != "fp16":
        assert scaler is None
        assert _report(resumed["part"])["scalers"] == []
        return
    default = torch.amp.GradScaler("cuda").get_scale()
    assert scaler is not None and 0 < scaler["scale"] < default, scaler  # steps were skipped
    stopped, part = resumed["stopped"]["scalers"], _report(resumed["part"])["scalers"]
    assert stopped[-1]["final"] == scaler  # what the run had is what the checkpoint holds
    assert part[-1]["loaded"] == scaler  # and the resumed run starts from it
    assert part[-1]["final"] == _report(resumed["full"])["scalers"][-1]["final"]


def test_final_model_loads_on_a_machine_without_cuda(resumed: dict) -> None:
    final = resumed["tmp"] / "full" / "final" / "model.pt"
    env = {**os.environ, "PYTHONPATH": "", "CUDA_VISIBLE_DEVICES": ""}
    check = "import torch; assert not torch.cuda.is_available()\n" + EXPORT_CHECK
    check = check.replace("nn.Dropout(0.0)", "nn.Dropout(0.2)")
    out = subprocess.run(
        [sys.executable, "-c", check, str(final)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    state = torch.load(final, weights_only=True)
    assert {t.device.type for t in state.values()} == {"cpu"}
    _assert_same(state, _weights(resumed["full"]), atol=0.0)


# ---- FSDP at world 1 --------------------------------------------------------------------
def test_fsdp_at_world_one_is_the_plain_model_with_sharded_checkpoints(tmp_path: Path) -> None:
    """README: "One process gets the plain model, as with DDP"; checkpoints are still
    the sharded format (``step_N/``), resume bit-exactly and export a plain state_dict."""
    sections = {"sections": {"ddp": {"strategy": "fsdp", "fsdp_mixed_precision": "bf16"}}}
    full = _spec(tmp_path, "full", "bf16", tmp_path / "full", **sections)
    part = _spec(tmp_path, "part", "bf16", tmp_path / "part", **sections)
    part["config"]["training"]["max_steps"] = STOP
    for p in [_start(s) for s in (full, part)]:
        _ok(_launch.finish(p, timeout=180))
    saved = sorted((tmp_path / "part").glob("step_*"))
    assert saved and all(p.is_dir() and (p / ckpt.META).is_file() for p in saved), saved
    part["config"]["training"]["max_steps"] = None
    _ok(_launch.run([WORKER, json.dumps(part)], world=1, timeout=180))
    a, b = _report(part), _report(full)
    assert b["wrapped"] == type(torch.nn.Sequential()).__name__, b["wrapped"]  # not FSDPModule
    assert b["param_device"] == "cuda:0"
    assert a["losses"] == b["losses"][STOP:]
    _assert_same(_weights(part), _weights(full), atol=0.0)
    final = torch.load(tmp_path / "full" / "final" / "model.pt", weights_only=True)
    _assert_same(final, _weights(full), atol=0.0)


# ---- NCCL ---------------------------------------------------------------------------------
def test_trainer_collectives_run_over_nccl(tmp_path: Path) -> None:
    """Every collective of a run with checkpoints and evaluation, on a real (1-rank) NCCL
    group: a CPU tensor in any of them fails ("No backend type associated with device
    type cpu"), which Gloo on the CPU never shows."""
    spec = _spec(tmp_path, "nccl", "bf16", tmp_path / "ck", nccl_group=True, eval_n=37)
    _ok(_launch.run([WORKER, json.dumps(spec)], world=1, timeout=180))
    r = _report(spec)
    assert r["summary"]["samples"] == N * EPOCHS, r["summary"]
    assert _latest(tmp_path / "ck")["global_step"] == N // BATCH * EPOCHS
    assert "eval_loss" in r["summary"], r["summary"]


# ---- CUDA-only options ------------------------------------------------------------------
def test_max_memory_fraction_caps_the_allocator(tmp_path: Path) -> None:
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    spec = _spec(
        tmp_path,
        "cap",
        "fp32",
        None,
        sections={"memory": {"max_memory_fraction": 0.1}},
        probe_alloc_gb=0.5 * total_gb,
    )
    _ok(_launch.run([WORKER, json.dumps(spec)], world=1, timeout=180))
    assert _report(spec)["probe"] == "oom"
    spec = _spec(tmp_path, "nocap", "fp32", None, probe_alloc_gb=0.5 * total_gb)
    _ok(_launch.run([WORKER, json.dumps(spec)], world=1, timeout=180))
    assert _report(spec)["probe"] == "allocated"
