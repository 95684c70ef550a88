"""``python -m ddp.data download-uniref50`` against a local HTTP server (the standard
library's, in a thread) laid out as UniProt's uniref/uniref50/: complete, cut and
resumed (HTTP Range), checksum mismatch, no metalink, a server that ignores Range."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp.data.__main__ import main
from ddp.data.download import DownloadError, download, parse_metalink
from ddp.data.fasta import TOKENIZER, VOCAB_SIZE
from ddp.data.store import TokenStore
from ddp.errors import ConfigError
from tests.support.polling import wait_until
from tests.support.signals import default_signals

ROOT = Path(__file__).resolve().parents[2]


def _fasta(n: int = 300, seed: int = 0) -> tuple[bytes, int]:
    """A gzipped FASTA of ``n`` random proteins (incompressible enough to be ~20 KB)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(20, 90)))
        lines.append(f">UniRef50_T{i} test n={i}\n{seq[:60]}\n{seq[60:]}\n".replace("\n\n", "\n"))
    return gzip.compress("".join(lines).encode(), mtime=0), n


def _metalink(name: str, size: int, md5: str) -> bytes:
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<metalink version="3.0" xmlns="http://www.metalinker.org/">
 <publisher><name>test</name></publisher>
 <files>
  <file name="uniref50.xml.gz"><size>1</size></file>
  <file name="{name}">
   <size>{size}</size>
   <verification><hash type="md5">{md5}</hash></verification>
   <resources><url type="http" location="xx">http://example.invalid/{name}</url></resources>
  </file>
 </files>
</metalink>
""".encode()


class Mirror:
    """What the server serves and how it misbehaves; every GET is recorded."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.cut_at: int | None = None  # the next FASTA transfer stops after this many bytes
        self.cuts = 0  # how many transfers to cut
        self.ignore_range = False
        self.stall = False  # send half the FASTA, then hold the connection until released
        self.sent_half = threading.Event()
        self.release = threading.Event()
        self.requests: list[tuple[str, str | None]] = []


@pytest.fixture
def mirror() -> Iterator[tuple[Mirror, str]]:
    state = Mirror()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            state.requests.append((path, self.headers.get("Range")))
            name = path.rsplit("/", 1)[-1]
            if not path.startswith("/uniref/uniref50/") or name not in state.files:
                self.send_error(404)
                return
            data = state.files[name]
            start = 0
            rng = self.headers.get("Range")
            if rng and not state.ignore_range:
                start = int(rng.removeprefix("bytes=").rstrip("-"))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if name.endswith(".gz") and state.stall:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                state.sent_half.set()
                state.release.wait(60)  # bound against a hang only: the test releases it
                self.close_connection = True
                return
            if name.endswith(".gz") and state.cuts and state.cut_at is not None:
                state.cuts -= 1
                self.wfile.write(body[: state.cut_at])  # then the connection closes early
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/uniref/uniref50/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _publish(state: Mirror, md5: str | None = None, metalink: bool = True) -> tuple[bytes, int]:
    data, n = _fasta()
    state.files["uniref50.fasta.gz"] = data
    if metalink:
        state.files["RELEASE.metalink"] = _metalink(
            "uniref50.fasta.gz", len(data), md5 or hashlib.md5(data).hexdigest()
        )
    return data, n


def _finished_names(folder: Path) -> list[str]:
    """What looks finished: the FASTA at its own name or a store."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith((".part", ".part.json")))


def test_complete_download_then_store(mirror, tmp_path: Path, capsys) -> None:
    state, base = mirror
    data, n = _publish(state)
    to = tmp_path / "data"
    assert main(["download-uniref50", "--url", base, "--to", str(to)]) == 0
    assert (to / "uniref50.fasta.gz").read_bytes() == data
    store = TokenStore(to / "uniref50.fasta.gz.tokens", TOKENIZER, VOCAB_SIZE)
    assert store.n_seqs == n
    assert sorted(p.name for p in to.iterdir()) == ["uniref50.fasta.gz", "uniref50.fasta.gz.tokens"]
    assert [r for r in state.requests if r[0].endswith(".gz")] == [
        ("/uniref/uniref50/uniref50.fasta.gz", None)
    ]
    # run again: nothing fetched, the store kept
    state.requests.clear()
    assert main(["download-uniref50", "--url", base, "--to", str(to)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert not [r for r in state.requests if r[0].endswith(".gz")]


def test_cut_transfer_resumes_with_range_in_the_same_run(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, n = _publish(state)
    state.cut_at, state.cuts = len(data) // 3, 1
    to = tmp_path / "data"
    assert main(["download-uniref50", "--url", base, "--to", str(to)]) == 0
    gz = [r for r in state.requests if r[0].endswith(".gz")]
    assert gz == [
        ("/uniref/uniref50/uniref50.fasta.gz", None),
        ("/uniref/uniref50/uniref50.fasta.gz", f"bytes={len(data) // 3}-"),
    ]
    assert (to / "uniref50.fasta.gz").read_bytes() == data
    assert TokenStore(to / "uniref50.fasta.gz.tokens", TOKENIZER, VOCAB_SIZE).n_seqs == n


def test_interrupted_run_leaves_a_part_that_the_next_run_resumes(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, n = _publish(state)
    state.cut_at, state.cuts = len(data) // 2, 1
    to = tmp_path / "data"
    with pytest.raises(
        DownloadError, match=f"{len(data) // 2:,} bytes kept in .*run again to resume"
    ):
        download(base, to, tries=1)
    assert (to / "uniref50.fasta.gz.part").read_bytes() == data[: len(data) // 2]
    assert _finished_names(to) == []  # nothing at the final name, no store
    state.requests.clear()
    proc = subprocess.run(
        [sys.executable, "-m", "ddp.data", "download-uniref50", "--url", base, "--to", str(to)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resuming {to / 'uniref50.fasta.gz.part'} at {len(data) // 2:,} bytes" in proc.stderr
    assert [r[1] for r in state.requests if r[0].endswith(".gz")] == [f"bytes={len(data) // 2}-"]
    assert (to / "uniref50.fasta.gz").read_bytes() == data
    assert TokenStore(to / "uniref50.fasta.gz.tokens", TOKENIZER, VOCAB_SIZE).n_seqs == n


def test_ctrl_c_mid_transfer_keeps_only_the_part(mirror, tmp_path: Path) -> None:
    import signal

    state, base = mirror
    data, _ = _publish(state)
    state.stall = True
    to = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddp.data", "download-uniref50", "--url", base, "--to", str(to)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
        preexec_fn=default_signals,
    )  # SIGINT at its default: see signals.py
    try:
        assert state.sent_half.wait(60), "the transfer never started"
        part = to / "uniref50.fasta.gz.part"
        # the client has written what it received: interrupt it mid-transfer
        wait_until(
            lambda: part.is_file() and part.stat().st_size > 0,
            60,
            "bytes in the part",
            ended=lambda: proc.poll(),
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        state.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "ddp.data: interrupted by SIGINT; no partial store is left (a download keeps only "
        "its .part, to resume)"
    )
    assert _finished_names(to) == []  # no FASTA at its name, no store
    assert data.startswith(part.read_bytes())


def test_a_terminal_gets_a_progress_bar(mirror, tmp_path: Path) -> None:
    state, base = mirror
    _publish(state)
    main_fd, side_fd = os.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # read while the child writes: a full terminal buffer would block it
        while True:
            try:
                chunk = os.read(main_fd, 1 << 16)
            except OSError:  # EIO: the terminal's other side is closed, all is read
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddp.data",
                "download-uniref50",
                "--url",
                base,
                "--to",
                str(tmp_path / "d"),
            ],
            stderr=side_fd,
            stdout=subprocess.PIPE,
            timeout=120,
            env={
                **os.environ,
                "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                "COLUMNS": "100",
                "TERM": "xterm",
            },
        )
    finally:
        os.close(side_fd)
        reader.join(timeout=30)
        os.close(main_fd)
    out = b"".join(chunks)
    assert proc.returncode == 0
    text = out.decode(errors="replace")
    assert "download uniref50.fasta.gz" in text and "\x1b[" in text  # rich's live bar
    assert "download: " not in text  # the plain log lines are for logs only


def test_checksum_mismatch_is_one_line_exit_2_and_nothing_looks_finished(
    mirror, tmp_path: Path
) -> None:
    state, base = mirror
    _publish(state, md5="0" * 32)
    to = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-m", "ddp.data", "download-uniref50", "--url", base, "--to", str(to)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("download:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddp.data: error: uniref50.fasta.gz: MD5 ")
    assert f"RELEASE.metalink says {'0' * 32}" in lines[0]
    assert list(to.iterdir()) == []  # no FASTA, no part, no store
    assert "\x1b[" not in proc.stderr  # no terminal: plain lines, no progress bar


def test_size_mismatch_after_a_resume_removes_the_part(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, _ = _publish(state)
    to = tmp_path / "data"
    to.mkdir()
    # a part of this release whose bytes are wrong: resumed, then caught by the MD5
    download_meta = to / "uniref50.fasta.gz.part.json"
    (to / "uniref50.fasta.gz.part").write_bytes(b"x" * 100)
    import json

    download_meta.write_text(
        json.dumps(
            {
                "url": base + "uniref50.fasta.gz",
                "size": len(data),
                "md5": hashlib.md5(data).hexdigest(),
            }
        )
    )
    with pytest.raises(ConfigError, match="MD5 .* the download was removed"):
        download(base, to)
    assert list(to.iterdir()) == []


def test_part_of_another_release_starts_over(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, _ = _publish(state)
    to = tmp_path / "data"
    to.mkdir()
    (to / "uniref50.fasta.gz.part").write_bytes(b"old release bytes")
    notes: list[str] = []
    assert download(base, to, note=notes.append).read_bytes() == data
    assert any("another release" in n for n in notes)
    assert [r[1] for r in state.requests if r[0].endswith(".gz")] == [None]


def test_server_ignoring_range_is_read_from_the_start(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, _ = _publish(state)
    state.cut_at, state.cuts, state.ignore_range = len(data) // 2, 1, True
    to = tmp_path / "data"
    assert download(base, to).read_bytes() == data


def test_mirror_without_metalink_checks_the_servers_size(mirror, tmp_path: Path) -> None:
    state, base = mirror
    data, _ = _publish(state, metalink=False)
    notes: list[str] = []
    assert download(base, tmp_path / "d", note=notes.append).read_bytes() == data
    assert any("no RELEASE.metalink" in n and "no MD5" in n for n in notes)


def test_missing_fasta_and_bad_url_are_one_line(mirror, tmp_path: Path, capsys) -> None:
    state, base = mirror
    assert main(["download-uniref50", "--url", base, "--to", str(tmp_path / "d")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "uniref50.fasta.gz: HTTP 404; allowed: --url naming" in err[0]
    assert list((tmp_path / "d").iterdir()) == []
    assert main(["download-uniref50", "--url", "ftp://x/uniref50/", "--to", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ddp.data: error: --url: 'ftp://x/uniref50/' is not allowed; allowed: an "
        "http:// or https:// folder laid out as UniProt's uniref/uniref50/"
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        (b"<not xml", "not XML"),
        (_metalink("other.fasta.gz", 1, "0" * 32), "no <file name='uniref50.fasta.gz'>"),
        (_metalink("uniref50.fasta.gz", -5, "0" * 32), "has size '-5'"),
        (_metalink("uniref50.fasta.gz", 5, "zz"), "has MD5 'zz'"),
        (
            b'<!DOCTYPE m [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
            b'<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">'
            b'<!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;"><!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;">'
            b'<!ENTITY g "&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;"><!ENTITY h "&g;&g;&g;&g;&g;&g;&g;&g;&g;&g;">]>'
            b"<m>&h;&h;&h;&h;&h;&h;&h;&h;&h;&h;</m>",
            "not XML",
        ),
    ],
)
def test_crafted_metalinks_are_one_line(text: bytes, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_metalink(text)
