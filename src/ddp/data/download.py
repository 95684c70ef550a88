"""``python -m ddp.data download-uniref50``: UniRef50's FASTA from UniProt, resumable and
checked, then prepared into a token store (seed 004's ``download_uniref50_data.sh``).

Where from: ``BASE`` is a folder laid out as UniProt's ``uniref/uniref50/``, which holds
``uniref50.fasta.gz`` beside ``RELEASE.metalink`` (the release's file list with each
file's size and MD5). The default is UniProt's own distribution,
https://ftp.uniprot.org/pub/databases/uniprot/uniref/uniref50/ (UniProt's downloads page,
https://www.uniprot.org/help/downloads, lists the UniRef files under
``ftp.uniprot.org/pub/databases/uniprot/uniref/``); ``--url`` names a mirror.

Why it is built this way:

* Streamed (``urllib``, the standard library): the file is tens of GB; it goes to disk in
  1 MiB pieces and its MD5 is computed as it arrives, never held in memory.
* Resumable: bytes go to ``uniref50.fasta.gz.part``; a transfer that breaks is asked
  again from where it stopped (HTTP ``Range``), within the same run (a few tries) and by
  a later run (the ``.part`` stays). A server that ignores ``Range`` (200, not 206) is
  read from the start again. ``.part.json`` records which release the part belongs to
  (the metalink's size and MD5): a part of an older release is started over, not
  completed with a newer one's bytes.
* Checked: with a metalink, the size and the MD5 must match it; without one (a mirror
  that has none), the size must match the server's ``Content-Length``, a note says no MD5
  was checked, and preparing the store still checks the gzip stream end to end.
* Nothing that looks finished is left unless it is: the final name appears only by an
  atomic rename after the checks pass; a mismatch removes the part (its bytes are wrong)
  and ends with one line, exit 2; an interruption keeps only the ``.part`` to resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp.errors import ConfigError

DEFAULT_BASE = "https://ftp.uniprot.org/pub/databases/uniprot/uniref/uniref50/"
FASTA = "uniref50.fasta.gz"
METALINK = "RELEASE.metalink"
PIECE = 1 << 20
#: A real RELEASE.metalink is a few kilobytes; a bigger one is not read.
MAX_METALINK = 1 << 20
TRIES = 5
TIMEOUT_S = 60.0

Progress = Callable[[int, int], None]


class DownloadError(Exception):
    """The server or the network failed (not the user's input): one line, exit 3; the
    ``.part`` is kept for the next run to resume."""


@dataclass(frozen=True)
class Expected:
    """What the release says the file is: its size, and its MD5 where the metalink has one."""

    size: int
    md5: str | None


def _url(base: str, name: str) -> str:
    """``name`` inside the folder ``base`` (a missing trailing slash is added)."""
    return urllib.parse.urljoin(base if base.endswith("/") else base + "/", name)


def check_base(base: str) -> str:
    """``base`` if it is an http(s) URL; else one line (ftp and file URLs cannot resume)."""
    scheme = urllib.parse.urlsplit(base).scheme
    if scheme not in ("http", "https") or not urllib.parse.urlsplit(base).netloc:
        raise ConfigError(
            f"--url: {base!r} is not allowed; allowed: an http:// or https:// "
            "folder laid out as UniProt's uniref/uniref50/"
        )
    return base


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse_metalink(data: bytes, name: str = FASTA) -> Expected:
    """The size and MD5 of ``name`` in a metalink (3.0 ``<files><file>`` or RFC 5854's 4.0
    ``<file>``; namespaces ignored). One line when the file is not listed or its size is no
    whole number: a metalink that cannot vouch for the file must not pass it."""
    try:
        root = ET.fromstring(data)  # expat: no external entities, bounded entity expansion
    except ET.ParseError as exc:
        raise ConfigError(f"{METALINK}: not XML ({exc}); expected UniProt's metalink") from None
    for node in root.iter():
        if _local(node.tag) != "file" or node.get("name") != name:
            continue
        size = md5 = None
        for child in node.iter():
            tag = _local(child.tag)
            if tag == "size" and child.text is not None:
                size = child.text.strip()
            elif tag == "hash" and (child.get("type") or "").lower() == "md5" and child.text:
                md5 = child.text.strip().lower()
        if size is None or not re.fullmatch(r"[0-9]{1,15}", size):
            raise ConfigError(f"{METALINK}: {name} has size {size!r}; expected a whole number")
        if md5 is not None and not re.fullmatch(r"[0-9a-f]{32}", md5):
            raise ConfigError(f"{METALINK}: {name} has MD5 {md5[:40]!r}; expected 32 hex digits")
        return Expected(int(size), md5)
    raise ConfigError(
        f"{METALINK}: no <file name={name!r}>; expected UniProt's uniref50 release metalink"
    )


def _open(url: str, start: int = 0) -> http.client.HTTPResponse:
    headers = {"User-Agent": "hpc-ddp (python -m ddp.data download-uniref50)"}
    if start:
        headers["Range"] = f"bytes={start}-"
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)


def fetch_metalink(base: str) -> Expected | None:
    """The release's record of the FASTA, or None when the mirror has no metalink (404)."""
    url = _url(base, METALINK)
    try:
        with _open(url) as resp:
            data = resp.read(MAX_METALINK + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise DownloadError(f"{url}: {getattr(exc, 'reason', exc)}") from None
    if len(data) > MAX_METALINK:
        raise ConfigError(f"{url}: larger than {MAX_METALINK >> 20} MiB; expected a metalink")
    return parse_metalink(data)


def _hash_file(path: Path) -> tuple[int, Any]:
    md5 = hashlib.md5(usedforsecurity=False)
    size = 0
    with open(path, "rb") as fh:
        while piece := fh.read(PIECE):
            md5.update(piece)
            size += len(piece)
    return size, md5


def _content_total(resp: http.client.HTTPResponse, start: int) -> int | None:
    """The whole file's size the response implies (Content-Range, else Content-Length)."""
    headers = resp.headers
    cr = headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", cr.strip())
    if m:
        return int(m.group(3))
    length = headers.get("Content-Length")
    return start + int(length) if length and length.isdigit() else None


def download(
    base: str,
    to: Path,
    progress: Progress | None = None,
    note: Callable[[str], None] | None = None,
    tries: int = TRIES,
    backoff_s: float = 1.0,
) -> Path:
    """``to/uniref50.fasta.gz``, downloaded (resumed) and checked; returns its path.

    A file already at the final name whose size matches the release (or, without a
    metalink, that exists) is kept: it got there only by passing the checks.
    """
    say = note or (lambda s: None)
    check_base(base)
    try:
        return _download(base, to, progress, say, tries, backoff_s)
    except OSError as exc:  # this machine's side: no room, no permission
        where = exc.filename or to
        raise ConfigError(
            f"{where}: {exc.strerror or exc}; allowed: --to a writable folder "
            "with room for UniRef50 (tens of GB)"
        ) from None


def _download(
    base: str,
    to: Path,
    progress: Progress | None,
    say: Callable[[str], None],
    tries: int,
    backoff_s: float,
) -> Path:
    to.mkdir(parents=True, exist_ok=True)
    final, part, meta = to / FASTA, to / (FASTA + ".part"), to / (FASTA + ".part.json")
    expected = fetch_metalink(base)
    if expected is None:
        say(f"no {METALINK} at {base}: the size is checked against the server's, no MD5")
    if final.is_file() and (expected is None or final.stat().st_size == expected.size):
        say(f"{final} is already downloaded; nothing to fetch")
        return final
    release = {
        "url": _url(base, FASTA),
        "size": expected and expected.size,
        "md5": expected and expected.md5,
    }
    if part.exists():
        try:
            same = json.loads(meta.read_text(encoding="utf-8")) == release
        except (OSError, ValueError):
            same = False
        if not same:
            say(f"{part} is of another release or mirror: starting over")
            part.unlink()
    meta.write_text(json.dumps(release), encoding="utf-8")
    size, md5 = _hash_file(part) if part.exists() else (0, hashlib.md5(usedforsecurity=False))
    if size:
        say(f"resuming {part} at {size:,} bytes")
    total = expected.size if expected else None
    url = _url(base, FASTA)
    for attempt in range(tries):
        if expected is not None and size >= expected.size:
            break
        try:
            size, md5, total = _transfer(url, part, size, md5, total, progress)
            break
        except ConfigError:  # no such file there: leave no record of a part either
            if not part.exists():
                meta.unlink()
            raise
        except _Broken as exc:
            size, md5 = exc.size, exc.md5
            if attempt + 1 == tries:
                raise DownloadError(
                    f"{url}: {exc} after {tries} tr{'ies' if tries > 1 else 'y'};"
                    f" {size:,} bytes kept in {part}: run again to resume"
                ) from None
            say(f"{url}: {exc}; resuming at {size:,} bytes")
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
    _verify(part, size, md5.hexdigest(), expected, total)
    os.replace(part, final)
    with contextlib.suppress(OSError):
        meta.unlink()
    return final


class _Broken(Exception):
    """A transfer that ended early: where it got to, to resume from there."""

    def __init__(self, why: str, size: int, md5: Any) -> None:
        super().__init__(why)
        self.size, self.md5 = size, md5


def _transfer(
    url: str, part: Path, size: int, md5: Any, total: int | None, progress: Progress | None
) -> tuple[int, Any, int | None]:
    """Append to ``part`` from byte ``size`` on; (size, md5, total) when the server's body
    ended where it said; :class:`_Broken` when it ended early or the network failed."""
    try:
        resp = _open(url, size)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and size:  # asked past the end: the part is whole (or wrong)
            return size, md5, total
        if exc.code == 404:
            raise ConfigError(
                f"{url}: HTTP 404; allowed: --url naming a folder laid out as "
                f"UniProt's uniref/uniref50/ (with {FASTA})"
            ) from None
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
        raise _Broken(str(getattr(exc, "reason", exc)), size, md5) from None
    with resp:
        if size and resp.status != 206:  # Range ignored: the body is the whole file
            size, md5 = 0, hashlib.md5(usedforsecurity=False)
        total = _content_total(resp, size) or total
        mode = "ab" if size else "wb"
        with open(part, mode) as out:
            while True:
                try:  # read1: what has arrived (a bar that moves, a Ctrl-C that is heard)
                    piece = resp.read1(PIECE)
                except (OSError, http.client.HTTPException) as exc:  # a reset, IncompleteRead
                    out.flush()
                    why = str(exc) or type(exc).__name__
                    raise _Broken(f"the transfer broke ({why})", size, md5) from None
                if not piece:
                    break
                out.write(piece)  # a full disk: OSError, not a broken transfer
                md5.update(piece)
                size += len(piece)
                if progress is not None:
                    progress(size, total or 0)
    if total is not None and size < total:
        raise _Broken(f"the transfer ended at {size:,} of {total:,} bytes", size, md5)
    return size, md5, total


def _verify(part: Path, size: int, md5: str, expected: Expected | None, total: int | None) -> None:
    """Size and MD5 against the release; a mismatch removes the part, one line."""
    want_size = expected.size if expected else total
    problem = None
    if want_size is not None and size != want_size:
        problem = f"{size:,} bytes, the {'release' if expected else 'server'} says {want_size:,}"
    elif expected is not None and expected.md5 is not None and md5 != expected.md5:
        problem = f"MD5 {md5}, {METALINK} says {expected.md5}"
    if problem:
        with contextlib.suppress(OSError):
            part.unlink()
        with contextlib.suppress(OSError):
            part.with_name(part.name + ".json").unlink()
        raise ConfigError(
            f"{part.name[: -len('.part')]}: {problem}; the download was removed "
            "(run again to fetch it anew; a mirror mid-update can cause this)"
        )


def plain_progress(emit: Callable[[str], None], every_s: float = 10.0) -> Progress:
    """Progress lines for a batch log (no terminal): one every ``every_s`` seconds."""
    t0 = last = time.perf_counter()

    def tick(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last < every_s:
            return
        last = now
        rate = done / 1e6 / max(now - t0, 1e-9)
        of = f"/{total / 1e6:,.0f}" if total else ""
        emit(f"download: {done / 1e6:,.0f}{of} MB {rate:,.1f} MB/s")

    return tick


def download_and_prepare(base: str, to: Path) -> int:
    """The subcommand: download (a bar on a terminal, plain lines in a log), then
    ``prepare-fasta`` into ``to`` beside the FASTA, where ``--datafile`` finds it."""
    from ddp.data.__main__ import _progress_bar, default_out, prepare_into

    def note(text: str) -> None:
        print(f"ddp.data: note: {text}", file=sys.stderr)

    if sys.stderr.isatty():
        with _progress_bar() as bar:
            task = bar.add_task(f"download {FASTA}", total=None)

            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total or None)

            fasta = download(base, to, tick, note)
    else:
        fasta = download(base, to, plain_progress(lambda s: print(s, file=sys.stderr)), note)
    return prepare_into(fasta, default_out(fasta), force=False, skip_current=True)
