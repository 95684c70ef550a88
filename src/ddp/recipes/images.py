"""The user's images and crowd judgements for crowdbt, from a folder or from S3.

Layout (the same on disk and under an ``s3://bucket/prefix``)::

    DIR/judgements.csv     left,right,annotator,label   (or judgements.jsonl, one object a line)
    DIR/<image paths>      RGB images Pillow decodes (PNG, JPEG, ...), paths relative to DIR

``label`` is 1 when ``left`` wins, 0 when ``right`` wins; ``annotator`` is any name
(annotators are numbered in sorted order). S3 is read through fsspec/s3fs with the
credentials boto finds in the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, an instance role; ``AWS_ENDPOINT_URL`` for a non-AWS server).

Every image a judgement names is read and decoded once at build, before training, and
kept preprocessed as uint8 ``(3, S, S)`` (resized so the short side is S, centre-cropped
to S x S; the backbone's own preprocessing, normalised with ImageNet mean/std in
:meth:`Judgements.__getitem__`). So a corrupt image, a missing one or a bad credential
ends the run at build with one line naming it, not hours into an epoch, and no epoch
reads the disk or the network again. The price is memory: S x S x 3 bytes an image
(620 kB at B5's 456), bounded by ``recipe.max_cache_mb``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ddp.errors import ConfigError
from hpc_ddp.files import NotRegular, read_regular

log = logging.getLogger("ddp")

COLUMNS = ("left", "right", "annotator", "label")
MAX_JUDGEMENTS_BYTES = 1 << 30
MAX_IMAGE_BYTES = 64 << 20
MAX_PIXELS = 1 << 28  # Pillow's decompression-bomb guard, made an error here


def pillow() -> Any:
    """The PIL.Image module; one line naming the extra when Pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "recipe.data_dir: reading images needs Pillow; pip install hpc-ddp[crowdbt]"
        ) from None
    return Image


# ---- where the files are ------------------------------------------------------------------
class Source:
    """Reads files under one root: a local folder, or ``s3://bucket/prefix`` via fsspec."""

    def __init__(self, root: str, kind: str) -> None:
        self.root, self.kind = root.rstrip("/") if kind == "s3" else root, kind
        self.fs: Any = None
        if kind == "s3":
            try:
                import fsspec
                import s3fs  # noqa: F401 - fsspec's "s3" protocol needs it
            except ImportError:
                raise ConfigError(
                    "recipe.data_source: s3 needs s3fs; pip install hpc-ddp[crowdbt]"
                ) from None
            # No cached filesystem: each build reads the environment's credentials anew.
            self.fs = fsspec.filesystem("s3", skip_instance_cache=True)

    def where(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.kind == "s3" else str(Path(self.root) / rel)

    def read(self, rel: str, limit: int) -> bytes:
        """The bytes of ``rel`` under the root; a ConfigError line naming it otherwise."""
        name = self.where(rel)
        if self.kind == "local":
            try:
                return read_regular(name, limit)[0]
            except NotRegular as exc:
                raise ConfigError(f"recipe.data_dir: {name!r} {exc}") from None
        try:
            size = self.fs.size(name)
            if size is not None and size > limit:
                raise ConfigError(
                    f"recipe.data_dir: {name!r} is {size:,} bytes; allowed: at most {limit:,}"
                )
            with self.fs.open(name, "rb") as f:
                return f.read(limit + 1)[:limit]
        except ConfigError:
            raise
        except FileNotFoundError:
            raise ConfigError(f"recipe.data_dir: {name!r} does not exist") from None
        except Exception as exc:
            raise ConfigError(
                f"recipe.data_dir: cannot read {name!r} "
                f"({_one_line(exc)}); check the AWS credentials and endpoint "
                "in the environment"
            ) from None

    def exists(self, rel: str) -> bool:
        if self.kind == "local":
            return Path(self.where(rel)).exists()
        try:
            return bool(self.fs.exists(self.where(rel)))
        except Exception as exc:
            raise ConfigError(
                f"recipe.data_dir: cannot list {self.where(rel)!r} "
                f"({_one_line(exc)}); check the AWS credentials and endpoint "
                "in the environment"
            ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def source(data_dir: str, data_source: str) -> Source:
    """``data_source`` is local or s3 (``auto`` picks by the ``s3://`` prefix)."""
    is_s3 = data_dir.startswith("s3://")
    kind = (
        "s3"
        if data_source == "auto" and is_s3
        else "local"
        if data_source == "auto"
        else data_source
    )
    if kind == "s3" and not is_s3:
        raise ConfigError(
            f"recipe.data_dir: {data_dir!r} with --data-source s3; allowed: s3://bucket/prefix"
        )
    if kind == "local" and is_s3:
        raise ConfigError(
            f"recipe.data_dir: {data_dir!r} with --data-source local; allowed: "
            "a folder, or --data-source s3"
        )
    if kind == "local" and not Path(data_dir).is_dir():
        raise ConfigError(f"recipe.data_dir: {data_dir!r} is not a folder")
    return Source(data_dir, kind)


# ---- judgements ---------------------------------------------------------------------------
@dataclass
class Raw:
    """Parsed judgements: image paths, annotator names, and per-judgement indices."""

    images: list[str]
    annotators: list[str]
    i: torch.Tensor
    j: torch.Tensor
    k: torch.Tensor
    y: torch.Tensor


def _rel(path: Any, where: str) -> str:
    """An image path relative to the root: no absolute path, no ``..``, no empties."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{where}: image path {path!r}; allowed: a path relative to the data dir")
    norm = posixpath.normpath(path.strip().replace("\\", "/"))
    if norm.startswith(("/", "../")) or norm == ".." or ":" in norm.split("/")[0]:
        raise ConfigError(
            f"{where}: image path {path!r} leaves the data dir; allowed: a relative path inside it"
        )
    return norm


def read_judgements(src: Source) -> Raw:
    """``judgements.csv`` (preferred) or ``judgements.jsonl`` under the root: every row
    checked (:func:`_judgement_rows` reads them), images and annotators indexed."""
    name, rows = _judgement_rows(src)
    index: dict[str, int] = {}
    ann_names: set[str] = set()
    parsed = []
    for n, r in rows:
        where = f"recipe.data_dir: {name} line {n}"
        missing = [c for c in COLUMNS if r.get(c) in (None, "")]
        if missing:
            raise ConfigError(f"{where}: no {', '.join(missing)}")
        left, right = _rel(r["left"], where), _rel(r["right"], where)
        if left == right:
            raise ConfigError(f"{where}: {left!r} is compared with itself; allowed: two images")
        label = str(r["label"]).strip()
        if label not in ("0", "1", "0.0", "1.0", "True", "False", "true", "false"):
            raise ConfigError(f"{where}: label {r['label']!r}; allowed: 1 (left wins) or 0")
        ann = str(r["annotator"]).strip()
        ann_names.add(ann)
        for p in (left, right):
            index.setdefault(p, len(index))
        parsed.append((index[left], index[right], ann, label in ("1", "1.0", "True", "true")))
    annotators = sorted(ann_names)
    aidx = {a: n for n, a in enumerate(annotators)}
    return Raw(
        list(index),
        annotators,
        torch.tensor([p[0] for p in parsed]),
        torch.tensor([p[1] for p in parsed]),
        torch.tensor([aidx[p[2]] for p in parsed]),
        torch.tensor([float(p[3]) for p in parsed]),
    )


def _judgement_rows(src: Source) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """(file name, [(line number, row)]) of the judgements file: UTF-8, a CSV header
    with every column or one JSON object per line, at least one row."""
    if src.exists("judgements.csv"):
        name, text = "judgements.csv", src.read("judgements.csv", MAX_JUDGEMENTS_BYTES)
    elif src.exists("judgements.jsonl"):
        name, text = "judgements.jsonl", src.read("judgements.jsonl", MAX_JUDGEMENTS_BYTES)
    else:
        raise ConfigError(
            f"recipe.data_dir: no judgements.csv or judgements.jsonl in "
            f"{src.root!r}; allowed: a file with columns {','.join(COLUMNS)}"
        )
    try:
        body = text.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"recipe.data_dir: {name} is not UTF-8 text") from None
    rows: list[tuple[int, dict[str, Any]]] = []
    if name.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(body))
        if not reader.fieldnames or not set(COLUMNS) <= set(reader.fieldnames):
            raise ConfigError(
                f"recipe.data_dir: {name} has columns {reader.fieldnames}; "
                f"allowed: a header with {','.join(COLUMNS)}"
            )
        try:
            rows = [(n + 2, r) for n, r in enumerate(reader)]
        except csv.Error as exc:
            raise ConfigError(f"recipe.data_dir: {name}: {exc}") from None
    else:
        for n, line in enumerate(body.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"recipe.data_dir: {name} line {n}: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"recipe.data_dir: {name} line {n}: allowed: an object with "
                    f"{', '.join(COLUMNS)}"
                )
            rows.append((n, obj))
    if not rows:
        raise ConfigError(f"recipe.data_dir: {name} holds no judgements")
    return name, rows


# ---- images -------------------------------------------------------------------------------
def preprocess(data: bytes, name: str, size: int, resample: str = "bicubic") -> torch.Tensor:
    """Decoded, RGB, short side resized to ``size``, centre-cropped: uint8 (3, size, size)."""
    image_mod = pillow()
    try:
        with image_mod.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_PIXELS:
                raise ConfigError(
                    f"recipe.data_dir: {name!r} is {im.width}x{im.height} pixels; "
                    f"allowed: at most {MAX_PIXELS:,}"
                )
            im.load()  # decodes every byte: a truncated or corrupt file fails here
            rgb = im.convert("RGB")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"recipe.data_dir: {name!r} is not an image Pillow can decode ({_one_line(exc)})"
        ) from None
    w, h = rgb.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    method = getattr(image_mod.Resampling, resample.upper())
    rgb = rgb.resize((nw, nh), method)
    left, top = (nw - size) // 2, (nh - size) // 2
    rgb = rgb.crop((left, top, left + size, top + size))
    t = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return t.view(size, size, 3).permute(2, 0, 1).contiguous()


def load_images(
    src: Source, paths: list[str], size: int, max_cache_mb: float, resample: str = "bicubic"
) -> torch.Tensor:
    """Every image, read and preprocessed: uint8 (n, 3, size, size)."""
    need = len(paths) * 3 * size * size
    if need > max_cache_mb * (1 << 20):
        raise ConfigError(
            f"recipe.max_cache_mb: {len(paths)} images at {size}px need "
            f"{need / (1 << 20):,.0f} MB; allowed: raise recipe.max_cache_mb "
            f"(now {max_cache_mb:g}) or lower --input-size"
        )
    out = torch.empty(len(paths), 3, size, size, dtype=torch.uint8)
    for n, p in enumerate(paths):
        out[n] = preprocess(src.read(p, MAX_IMAGE_BYTES), src.where(p), size, resample)
    log.info("crowdbt: %d images from %s (%s), %dpx", len(paths), src.root, src.kind, size)
    return out


class Judgements(Dataset):
    """One item per judgement: both images normalised float, annotator index, label."""

    def __init__(
        self,
        images: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
        k: torch.Tensor,
        y: torch.Tensor,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> None:
        self.images, self.i, self.j, self.k, self.y = images, i, j, k, y
        self.mean = torch.tensor(mean).view(3, 1, 1) * 255
        self.std = torch.tensor(std).view(3, 1, 1) * 255

    def __len__(self) -> int:
        return self.i.shape[0]

    def _norm(self, n: int) -> torch.Tensor:
        return (self.images[n].float() - self.mean) / self.std

    def __getitem__(self, n: int) -> dict[str, torch.Tensor]:
        return {
            "a": self._norm(int(self.i[n])),
            "b": self._norm(int(self.j[n])),
            "annotator": self.k[n],
            "label": self.y[n],
        }


def split(raw: Raw, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Judgement indices (train, eval): a seeded shuffle, ``eval_fraction`` held out."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(raw.i.shape[0], generator=g)
    n_eval = int(round(eval_fraction * len(order)))
    if eval_fraction > 0 and n_eval == 0:
        n_eval = 1
    if n_eval >= len(order):
        raise ConfigError(
            f"recipe.eval_fraction: {eval_fraction} leaves no training judgement "
            f"of {len(order)}; allowed: a fraction in [0, 1) that leaves some"
        )
    return order[n_eval:].sort().values, order[:n_eval].sort().values


def subset(
    raw: Raw, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return raw.i[idx], raw.j[idx], raw.k[idx], raw.y[idx]
