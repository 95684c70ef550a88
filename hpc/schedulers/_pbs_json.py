"""``qstat -F json`` read leniently and as it streams: the JSON half of the PBS client.

Kept apart from the readers in :mod:`hpc.schedulers._pbs_qstat` because it is a
JSON tokenizer, not PBS knowledge: it cuts one job's value at a time out of an
answer that may be gigabytes long, and reads old PBS Pro's unescaped backslashes.
The leading underscore keeps it out of scheduler discovery (``hpc.schedulers.names``).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import IO, Any


def loads_qstat_json(text: str) -> dict[str, Any]:
    """Parse ``qstat -F json`` leniently.

    PBS Pro before 2021 writes job variables into ``Variable_List`` without escaping
    backslashes (``PS1=\\u@\\h``) and with raw control characters, which strict JSON
    refuses; such backslashes are doubled and control characters allowed.
    """
    try:
        data: dict[str, Any] = json.loads(text, strict=False)
        return data
    except ValueError:
        fixed = re.sub(r'\\(?!["\\/bfnrtu])', r"\\\\", text)
        fixed = re.sub(r"\\u(?![0-9a-fA-F]{4})", r"\\\\u", fixed)
        data = json.loads(fixed, strict=False)
        return data


_WS = re.compile(r"[ \t\n\r]*")
_TOKEN = re.compile(r'["{}\[\]]')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SCALAR = re.compile(r"[^\s,}\]]*")
#: Characters read from qstat at a time, and the most one value (one job's attributes)
#: may take: a real job is a few kilobytes; a bigger one is damage.
_CHUNK = 256 * 1024
_MAX_VALUE = 64 * 1024 * 1024


class _JsonStream:
    """``qstat -F json`` read a value at a time as it streams.

    Each value is decoded with :class:`json.JSONDecoder` (C speed) from a buffer that
    holds the current job and at most one chunk more; what was read is dropped. A job
    that strict JSON refuses (PBS Pro before 2021: unescaped backslashes in
    ``Variable_List``) is cut out by a tolerant scan and read as
    :func:`loads_qstat_json` reads a whole answer.
    """

    def __init__(self, source: str | bytes | IO[str] | IO[bytes]) -> None:
        if isinstance(source, bytes):
            source = source.decode(errors="replace")
        self.src = None if isinstance(source, str) else source
        self.buf = source if isinstance(source, str) else ""
        self.eof = self.src is None
        self.pos = 0
        self.decoder = json.JSONDecoder(strict=False)
        self.bytes_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _more(self) -> bool:
        """Read the next chunk (dropping what was read); False at the end."""
        if self.eof or self.src is None:
            self.eof = True
            return False
        if len(self.buf) - self.pos > _MAX_VALUE:
            raise ValueError(f"qstat JSON: one value is over {_MAX_VALUE:,} characters")
        # as much again as the value read so far: a long value is read in O(its size)
        size = max(_CHUNK, len(self.buf) - self.pos)
        # what the client wrote so far (read1), not `size` of it: a pipe's read(size)
        # would wait for all of it, and damage early in a long answer would go unseen
        raw = getattr(self.src, "buffer", self.src)
        read = getattr(raw, "read1", None) or self.src.read
        text = ""
        while not text:
            chunk = read(size)
            if not chunk:
                text = self.bytes_decoder.decode(b"", final=True)
                if not text:
                    self.eof = True
                    return False
            else:
                text = self.bytes_decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end)."""
        while True:
            match = _WS.match(self.buf, self.pos)
            self.pos = match.end() if match else self.pos
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            found = self.peek() or "the end"
            raise ValueError(f"qstat JSON: {found!r} where {char!r} belongs")
        self.pos += 1

    def value(self) -> Any:
        """The next JSON value."""
        self.peek()
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(self.buf) - 8
                if not self.eof and cut:  # the value goes on in the next chunk
                    self._more()
                    continue
                return self._lenient()
            if end >= len(self.buf) and not self.eof:  # a number or word may go on
                self._more()
                continue
            self.pos = end
            return obj

    def _lenient(self) -> Any:
        """The value at ``pos`` that strict JSON refused, cut out and read leniently."""
        while (end := _value_end(self.buf, self.pos, self.eof)) is None:
            if not self._more() and (end := _value_end(self.buf, self.pos, True)) is None:
                raise ValueError("qstat JSON: the answer ends inside a value")
        text = self.buf[self.pos : end]
        self.pos = end
        return loads_qstat_json(text)


def _value_end(buf: str, start: int, eof: bool) -> int | None:
    """Where the JSON value at ``start`` ends, strings and nesting followed and escapes
    taken as pairs whatever they are; None while it may go on past ``buf``."""
    if start >= len(buf):
        return None
    if buf[start] == '"':
        match = _STRING.match(buf, start)
        return match.end() if match else None
    if buf[start] not in "{[":
        scalar = _SCALAR.match(buf, start)
        assert scalar is not None  # the pattern matches the empty string too
        end = scalar.end()
        return end if end < len(buf) or eof else None
    depth, pos = 0, start
    while (token := _TOKEN.search(buf, pos)) is not None:
        if token.group() == '"':
            match = _STRING.match(buf, token.start())
            if match is None:
                return None
            pos = match.end()
            continue
        depth += 1 if token.group() in "{[" else -1
        pos = token.end()
        if depth == 0:
            return pos
    return None


def _qstat_json_jobs(source: str | bytes | IO[str] | IO[bytes]) -> Iterator[tuple[str, Any]]:
    """(id, attributes) of each job in a ``qstat -F json`` answer, one at a time."""
    reader = _JsonStream(source)
    if reader.peek() == "":  # no answer at all (no job matched)
        return
    reader.expect("{")
    if reader.peek() == "}":
        return
    while True:
        key = reader.value()
        if not isinstance(key, str):
            raise ValueError("qstat JSON: a key that is not a string")
        reader.expect(":")
        if key == "Jobs" and reader.peek() == "{":
            reader.expect("{")
            while reader.peek() != "}":
                job = reader.value()
                if not isinstance(job, str):
                    raise ValueError("qstat JSON: a job id that is not a string")
                reader.expect(":")
                yield job, reader.value()
                if reader.peek() == ",":
                    reader.pos += 1
            reader.expect("}")
        else:
            value = reader.value()
            if key == "Jobs" and value and not isinstance(value, dict):
                raise ValueError("qstat JSON: 'Jobs' is not a mapping")
        if reader.peek() == ",":
            reader.pos += 1
            continue
        reader.expect("}")
        return
