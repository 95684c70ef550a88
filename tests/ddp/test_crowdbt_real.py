"""crowdbt with a real EfficientNet on the user's images and crowd judgements (seed 003).

The data are what a user brings: a folder of RGB PNGs written with Pillow plus a
``judgements.csv`` (``left,right,annotator,label``), and the same layout in an S3
bucket served by moto's real S3 server (``ThreadedMotoServer``) in this process, with
IAM authentication on, so credentials are really checked. Training is 2 real Gloo
ranks of ``python -m ddp crowdbt`` with ``efficientnet_b0`` at 32 px and gradient
checkpointing on. Bad input (a corrupt image, a judgement naming a missing image, a
wrong S3 secret) must end in one line, exit 2.

The backbone library is whichever imports (torchvision/timm on a GPU cluster,
efficientnet_pytorch beside this machine's CPU torch); the tests check the one in use
builds EfficientNet-B0's real parameter count.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddp.__main__ import main
from ddp.errors import ConfigError
from ddp.recipes import backbones, crowdbt, resolve
from tests.ddp import _launch
from tests.support.parts import require_module

require_module("PIL")  # the `test` extra installs pillow, efficientnet_pytorch, s3fs, moto
require_module("efficientnet_pytorch")

ROOT = _launch.ROOT
#: EfficientNet-B0 without its 1000-way classifier: 4,007,548 parameters (5,288,548 with
#: it, the published figure), the same in torchvision, timm and efficientnet_pytorch.
B0_FEATURE_PARAMS = 5_288_548 - (1280 * 1000 + 1000)
SMALL = [
    "--backbone",
    "efficientnet_b0",
    "--input-size",
    "32",
    "--batch-size",
    "4",
    "--epochs",
    "1",
    "--set",
    "memory.gradient_checkpointing=true",
    "--set",
    "logging.progress=plain",
    "--set",
    "recipe.eval_fraction=0.25",
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread in this process, as the ranks have (OMP_NUM_THREADS=1): on a
    busy 2-core machine two threads spin against each other (B0's step: 9 s vs 0.1 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_data(root: Path, n_images: int = 8, n_judgements: int = 24) -> list[dict[str, str]]:
    """RGB PNGs of several sizes under ``root/img`` and ``root/judgements.csv``."""
    from PIL import Image

    rng = random.Random(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    names = []
    for n in range(n_images):
        w, h = 40 + 4 * n, 48 - 2 * n
        im = Image.new("RGB", (w, h))
        im.putdata([(rng.randrange(256), (n * 30) % 256, rng.randrange(256)) for _ in range(w * h)])
        name = f"img/p{n}.png"
        im.save(root / name)
        names.append(name)
    rows = []
    for k in range(n_judgements):
        a, b = rng.sample(names, 2)
        rows.append(
            {"left": a, "right": b, "annotator": f"worker{k % 3}", "label": str(int(a < b))}
        )
    with open(root / "judgements.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["left", "right", "annotator", "label"])
        w.writeheader()
        w.writerows(rows)
    return rows


def _run2(out: Path, *args: str, timeout: float = 300) -> list[tuple[int, str, str]]:
    argv = [
        "-m",
        "ddp",
        "crowdbt",
        "--config",
        "configs/crowdbt.yaml",
        *SMALL,
        "--set",
        f"checkpoint.dir={out}",
        *args,
    ]
    return _launch.run(argv, world=2, timeout=timeout)


def _ok(results: list[tuple[int, str, str]]) -> str:
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    log = results[0][1] + results[0][2]
    assert "world=2" in log and "done:" in log
    return log


def _one_line_exit_2(results: list[tuple[int, str, str]], *needles: str) -> str:
    """Every rank exits 2 with one error line on stderr holding every needle; no traceback."""
    lines = []
    for rank, (rc, _o, e) in enumerate(results):
        assert rc == 2, f"rank {rank} exit {rc}\n{e[-3000:]}"
        assert "Traceback" not in e, e[-3000:]
        errs = [ln for ln in e.splitlines() if "error" in ln.lower()]
        assert len(errs) == 1, e[-3000:]
        lines.append(errs[0])
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _check_trained(out: Path, n_annotators: int) -> None:
    """The exported model is a real EfficientNet-B0 scorer whose weights moved."""
    state = torch.load(out / "final" / "model.pt", weights_only=True)
    cfg = resolve(
        crowdbt,
        ROOT / "configs/crowdbt.yaml",
        ["model.backbone=efficientnet_b0", "model.input_size=32"],
    )
    fresh = crowdbt.make_model(cfg, n_annotators)
    assert set(state) == set(fresh.state_dict())
    feats = sum(p.numel() for p in fresh.backbone.parameters())
    assert feats == B0_FEATURE_PARAMS, feats
    moved = [
        k
        for k, v in fresh.state_dict().items()
        if v.is_floating_point() and not torch.equal(v, state[k])
    ]
    assert any(k.startswith("backbone.") for k in moved) and "eta_raw" in moved


# ---- from a folder -------------------------------------------------------------------------
def test_two_ranks_efficientnet_b0_from_a_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_data(data)
    out = tmp_path / "ck"
    log = _ok(_run2(out, "--data-dir", str(data)))
    assert f"crowdbt: backbones from {backbones.library()}" in log
    assert "crowdbt: 8 images from" in log and "32px" in log
    assert "eval_agree=" in log and "eval_loss=" in log
    _check_trained(out, 3)


def test_jsonl_judgements_and_backbone_sizes(tmp_path: Path) -> None:
    """JSONL reads like CSV; B3/B4/B5 default to their own 300/380/456 px."""
    rows = write_data(tmp_path)
    (tmp_path / "judgements.csv").unlink()
    (tmp_path / "judgements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve(
        crowdbt,
        ROOT / "configs/crowdbt.yaml",
        [f"recipe.data_dir={tmp_path}", "model.input_size=20"],
    )
    train, evals, n_ann = crowdbt.user_datasets(cfg)
    assert (len(train), len(evals), n_ann) == (22, 2, 3)  # eval_fraction 0.1 of 24 -> 2
    item = train[0]
    assert item["a"].shape == (3, 20, 20) and item["a"].dtype == torch.float32
    # normalised with ImageNet's mean/std: a pixel of 0 is -mean/std
    assert item["a"].min() >= -0.485 / 0.229 - 1e-5 and item["a"].max() <= (1 - 0.406) / 0.225
    sizes = {
        b: crowdbt.image_size(resolve(crowdbt, None, [f"model.backbone={b}"]))
        for b in ("efficientnet_b3", "efficientnet_b4", "efficientnet_b5")
    }
    assert sizes == {"efficientnet_b3": 300, "efficientnet_b4": 380, "efficientnet_b5": 456}


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointing every MBConv block recomputes the same numbers (and is really on)."""
    cfg = resolve(crowdbt, None, ["model.backbone=efficientnet_b0", "model.input_size=32"])
    calls: list[int] = []
    real = backbones.checkpoint

    def spy(*a: object, **k: object) -> object:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(backbones, "checkpoint", spy)
    grads = []
    for on in (False, True):
        model = crowdbt.make_model(cfg, 2)
        model.gradient_checkpointing = on
        model.train()
        torch.manual_seed(0)
        batch = {
            "a": torch.randn(2, 3, 32, 32),
            "b": torch.randn(2, 3, 32, 32),
            "annotator": torch.tensor([0, 1]),
            "label": torch.tensor([1.0, 0.0]),
        }
        calls.clear()
        model(batch)["loss"].backward()
        # one backbone pass scores both images; B0 has 16 MBConv blocks
        if backbones.library() == "efficientnet_pytorch":
            assert len(calls) == (16 if on else 0), calls
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# ---- bad input: one line, exit 2 -----------------------------------------------------------
def test_corrupt_image_is_one_line(tmp_path: Path) -> None:
    write_data(tmp_path)
    (tmp_path / "img/p3.png").write_bytes((tmp_path / "img/p3.png").read_bytes()[:60])
    results = _run2(tmp_path / "ck", "--data-dir", str(tmp_path))
    _one_line_exit_2(results, "img/p3.png", "not an image Pillow can decode")
    assert not (tmp_path / "ck" / "final").exists()


def test_judgement_naming_a_missing_image_is_one_line(tmp_path: Path) -> None:
    write_data(tmp_path)
    with open(tmp_path / "judgements.csv", "a") as f:
        f.write("img/p1.png,img/gone.png,worker0,1\n")
    results = _run2(tmp_path / "ck", "--data-dir", str(tmp_path))
    _one_line_exit_2(results, "img/gone.png", "does not exist")


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("../etc/passwd,img/p1.png,w,1", "leaves the data dir"),
        ("img/p0.png,img/p1.png,w,2", "label '2'"),
        ("img/p0.png,img/p0.png,w,1", "compared with itself"),
    ],
)
def test_bad_judgements_refused(tmp_path: Path, row: str, needle: str) -> None:
    write_data(tmp_path)
    with open(tmp_path / "judgements.csv", "a") as f:
        f.write(row + "\n")
    cfg = resolve(crowdbt, None, [f"recipe.data_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="judgements.csv line 26") as err:
        crowdbt.user_datasets(cfg)
    assert needle in str(err.value)


def test_unknown_backbone_and_missing_library_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["crowdbt", "--backbone", "efficientnet_b9", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'efficientnet_b9' is not a backbone; allowed: tiny_cnn" in err[0]
    monkeypatch.setattr(backbones, "library", lambda: "efficientnet_pytorch")
    with pytest.raises(ConfigError, match="'resnet50' needs torchvision .* or timm"):
        backbones.check_name("resnet50")
    monkeypatch.setattr(backbones, "library", lambda: None)
    with pytest.raises(ConfigError, match=r"pip install hpc-ddp\[crowdbt\]"):
        backbones.check_name("efficientnet_b3")


def test_pretrained_loads_a_given_file_and_never_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--pretrained PATH`` loads that file (weights_only); ``--pretrained`` alone looks in
    the library's cache and says where when the file is not there."""
    from efficientnet_pytorch import EfficientNet

    ref = EfficientNet.from_name("efficientnet-b0", image_size=32)  # the library's own layout
    torch.save(ref.state_dict(), tmp_path / "b0.pth")
    if backbones.library() != "efficientnet_pytorch":
        pytest.skip("the file is efficientnet_pytorch's layout; torchvision imports here")
    cfg = resolve(
        crowdbt,
        None,
        [
            "model.backbone=efficientnet_b0",
            "model.input_size=32",
            f"model.pretrained={tmp_path / 'b0.pth'}",
        ],
    )
    model = crowdbt.make_model(cfg, 2)
    got = model.backbone.net.state_dict()
    body = {k: v for k, v in ref.state_dict().items() if not k.startswith("_fc.")}
    assert all(torch.equal(got[k], v) for k, v in body.items())  # all but the classifier
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    cfg = resolve(crowdbt, None, ["model.backbone=efficientnet_b0", "model.pretrained=cache"])
    with pytest.raises(ConfigError, match="no cached weights for efficientnet_b0 at .*empty"):
        crowdbt.make_model(cfg, 2)
    (tmp_path / "bad.pth").write_bytes(b"not a pickle")
    cfg = resolve(
        crowdbt,
        None,
        ["model.backbone=efficientnet_b0", f"model.pretrained={tmp_path / 'bad.pth'}"],
    )
    with pytest.raises(ConfigError, match="is not a weights file"):
        crowdbt.make_model(cfg, 2)


def test_seed_example_configs_parse_and_scale(capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's three example configurations, as written; lr as given (rule none), and
    the seed's formula with rule linear (by batch over its base of 16)."""
    import yaml

    for world, backbone, size, batch, lr in (
        (2, "b3", 384, 32, 2e-4),
        (4, "b5", 512, 8, 4e-4),
        (8, "b4", 448, 16, 8e-4),
    ):
        argv = [
            "crowdbt",
            "--config",
            "configs/crowdbt.yaml",
            "--backbone",
            f"efficientnet_{backbone}",
            "--input-size",
            str(size),
            "--batch-size",
            str(batch),
            "--lr",
            str(lr),
            "--print-config",
        ]
        if world == 8:
            argv += [
                "--data-source",
                "s3",
                "--epochs",
                "50",
                "--weight-decay",
                "1e-5",
                "--num-workers",
                "8",
            ]
        assert main(argv) == 0
        cfg = yaml.safe_load(capsys.readouterr().out)
        assert cfg["model"]["backbone"] == f"efficientnet_{backbone}"
        assert (cfg["model"]["input_size"], cfg["training"]["batch_size"]) == (size, batch)
        tc = resolve(crowdbt, None, [f"training.batch_size={batch}", f"optim.lr={lr}"])
        assert tc.scaled_lr(world) == pytest.approx(lr)  # used as written
    # seed 003: base batch 16, lr 1e-4; 4 GPUs x 16 -> 4e-4
    tc = resolve(crowdbt, ROOT / "configs/crowdbt.yaml", ["scaling.rule=linear"])
    assert tc.scaled_lr(4) == pytest.approx(4e-4)


def test_tiny_training_at_a_seed_resolution(tmp_path: Path) -> None:
    """One step of the seed's B3 config at its own 384 px, batch 1, one process."""
    write_data(tmp_path / "d", n_images=3, n_judgements=4)
    ((rc, o, e),) = _launch.run(
        [
            "-m",
            "ddp",
            "crowdbt",
            "--config",
            "configs/crowdbt.yaml",
            "--backbone",
            "efficientnet_b3",
            "--input-size",
            "384",
            "--batch-size",
            "1",
            "--lr",
            "2e-4",
            "--max-steps",
            "1",
            "--data-dir",
            str(tmp_path / "d"),
            "--set",
            "memory.gradient_checkpointing=true",
            "--set",
            "logging.progress=plain",
            "--set",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "--set",
            "recipe.eval_fraction=0",
        ],
        world=1,
        timeout=300,
    )
    assert rc == 0, e[-3000:]
    assert "384px" in o + e and (tmp_path / "ck" / "final" / "model.pt").is_file()


# ---- from S3 (moto's server, IAM auth on) --------------------------------------------------
BUCKET = "crowd-data"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A local S3 server holding the layout under s3://crowd-data/set1; the environment
    (endpoint, region, a real IAM user's keys) a job would get."""
    require_module("s3fs")
    boto3 = require_module("boto3")
    server_mod = require_module("moto.server")
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    data = tmp_path_factory.mktemp("s3data")
    write_data(data)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    kw = {
        "endpoint_url": url,
        "region_name": "us-east-1",
        "aws_access_key_id": "setup",
        "aws_secret_access_key": "setup",
    }
    iam = boto3.client("iam", **kw)
    iam.create_user(UserName="trainer")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    client = boto3.client("s3", **kw)
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(data.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"set1/{path.relative_to(data).as_posix()}")
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on every request is authenticated
    ActionAuthenticatorMixin.request_count = 0
    try:
        yield {
            "AWS_ENDPOINT_URL": url,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        server.stop()


def _aws_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_two_ranks_from_s3(
    tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _aws_env(monkeypatch, s3)
    out = tmp_path / "ck"
    log = _ok(_run2(out, "--data-source", "s3", "--data-dir", f"s3://{BUCKET}/set1"))
    assert f"8 images from s3://{BUCKET}/set1 (s3)" in log
    _check_trained(out, 3)


def test_bad_s3_credential_is_one_line(
    tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _aws_env(monkeypatch, {**s3, "AWS_SECRET_ACCESS_KEY": "wrong-secret"})
    results = _run2(tmp_path / "ck", "--data-source", "s3", "--data-dir", f"s3://{BUCKET}/set1")
    _one_line_exit_2(results, f"s3://{BUCKET}/set1/judgements.csv", "AWS credentials")


def test_pin_memory_follows_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On as in the seed where CUDA is; off without it (pinning only speeds copies to CUDA)."""
    write_data(tmp_path)
    sets = [f"recipe.data_dir={tmp_path}", "model.input_size=8"]
    cfg = resolve(crowdbt, ROOT / "configs/crowdbt.yaml", sets)
    assert cfg.data.pin_memory is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    crowdbt.build(cfg)
    assert cfg.data.pin_memory is False
    cfg = resolve(crowdbt, ROOT / "configs/crowdbt.yaml", sets)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    crowdbt.build(cfg)
    assert cfg.data.pin_memory is True


def test_data_source_and_dir_must_agree(tmp_path: Path) -> None:
    cfg = resolve(crowdbt, None, ["recipe.data_source=s3", f"recipe.data_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="with --data-source s3; allowed: s3://bucket/prefix"):
        crowdbt.build(cfg)
    cfg = resolve(crowdbt, None, ["recipe.data_source=s3"])
    with pytest.raises(ConfigError, match="--data-source s3 needs --data-dir"):
        crowdbt.build(cfg)
