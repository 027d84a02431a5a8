"""Reading dataset files into raw records, each tagged with the line it starts on.

Supported files:

- ``.jsonl``: one JSON object per line; blank lines are skipped.
- ``.json``: a JSON array of objects (a ``.json`` file whose first character is ``{`` is read
  as JSON Lines, since many datasets are published that way).
- ``.txt``: plain text, split into documents at blank lines (one paragraph = one record, its
  line number is the paragraph's first line). Paragraphs keep their inner line breaks. Whole-file
  documents were rejected because a book-sized file would exceed any ``max_seq_len`` and be
  truncated to its first page.
- ``.csv``, ``.parquet``, ``.arrow`` / ``.feather`` (Arrow IPC file or stream, as Hugging Face
  ``datasets`` saves them): one record per row, read with pyarrow in batches; a record's "line"
  is its row number (CSV: its line, the header being line 1). Null cells count as absent fields.
- a folder: every ``*.txt`` file below it, in sorted path order.

Real-world mess is tolerated: a UTF-8 byte-order mark, CRLF line endings, blank lines.
Everything else (non-UTF-8 bytes, invalid JSON, a line that is not an object, an empty file)
is a :class:`UserError` naming the file and the line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from slideformer.engine.data import tables
from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import lone_surrogate

SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet", ".arrow", ".feather")
TABLE_SUFFIXES = (".csv", ".parquet", ".arrow", ".feather")
_BOM = "\ufeff"


@dataclass(frozen=True)
class Record:
    """One raw record: a JSON object, or the text of a .txt paragraph."""

    file: Path
    line: int
    """1-based line the record starts on."""
    value: object

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def source_files(path: Path | str, setting: str = "data.train") -> list[Path]:
    """The data files named by a setting: the file itself, or the .txt files of a folder."""
    path = Path(path)
    if str(path) in ("", "."):
        raise UserError(setting, "is not set", "give the path of a .jsonl, .json or .txt file")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UserError(path, "is a folder without .txt files",
                            "put .txt files in it, or point to a .jsonl/.json file")
        return files
    if not path.is_file():
        raise UserError(path, "does not exist", f"check the path given as {setting}")
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(path, f"has an unsupported extension '{path.suffix}'",
                        "use .jsonl, .json, .txt, .csv, .parquet or .arrow (or a folder of .txt "
                        "files)")
    return [path]


def content_hash(files: list[Path]) -> str:
    """A digest of the files' names and bytes: any edit changes it (the cache key)."""
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(os.fsencode(f.name) + b"\0")  # a name need not be UTF-8
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


class RecordReader:
    """Iterates the records of several files; ``bytes_done`` tracks progress."""

    def __init__(self, files: list[Path], limit: int = 0):
        """``limit``: stop after this many records in all (0: read everything)."""
        self.files = files
        self.total_bytes = sum(f.stat().st_size for f in files)
        self.bytes_done = 0
        self.limit = limit

    def __iter__(self) -> Iterator[Record]:
        total = 0
        for f in self.files:
            if f.stat().st_size == 0:
                raise UserError(f, "is empty", "add records to the file, or remove it")
            count = 0
            for count, rec in enumerate(self._file_records(f), 1):
                yield rec
                total += 1
                if total == self.limit:
                    return
            if count == 0:
                raise UserError(f, "holds no records", "add records to the file, or remove it")

    def _file_records(self, f: Path) -> Iterator[Record]:
        if f.suffix.lower() in TABLE_SUFFIXES:
            return self._table_rows(f)
        if f.suffix.lower() == ".txt":
            return self._paragraphs(f)
        if f.suffix.lower() == ".json" and _first_char(f) == "[":
            return self._json_array(f)
        return self._json_lines(f)

    def _lines(self, f: Path) -> Iterator[tuple[int, str]]:
        """(line number, decoded line without its ending); CR, LF and CRLF all end a line."""
        with open(f, "rb") as fh:
            for no, raw in enumerate(fh, 1):
                self.bytes_done += len(raw)
                text = _decode(raw, f, no)
                if no == 1:
                    text = text.removeprefix(_BOM)
                yield no, text.rstrip("\r\n")

    def _json_lines(self, f: Path) -> Iterator[Record]:
        for no, text in self._lines(f):
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(f"{f}:{no}", f"is not valid JSON ({e.msg} at column {e.colno})",
                                "fix or remove that line: each line must hold one JSON object"
                                ) from None
            except (RecursionError, ValueError) as e:
                raise _unreadable(f"{f}:{no}", e) from None
            yield _text_only(_object(Record(f, no, value)), text)

    def _table_rows(self, f: Path) -> Iterator[Record]:
        """Rows of a CSV / Parquet / Arrow file as records, a batch of rows at a time."""
        first = 2 if f.suffix.lower() == ".csv" else 1
        row, size, done = 0, f.stat().st_size, 0
        for batch, fraction in tables.batches(f):
            for value in batch.to_pylist():
                yield Record(f, first + row, value)
                row += 1
            self.bytes_done += int(size * fraction) - done
            done = int(size * fraction)

    def _paragraphs(self, f: Path) -> Iterator[Record]:
        start, lines = 0, []
        for no, text in self._lines(f):
            if text.strip():
                start = start or no
                lines.append(text)
            elif lines:
                yield Record(f, start, "\n".join(lines))
                start, lines = 0, []
        if lines:
            yield Record(f, start, "\n".join(lines))

    def _json_array(self, f: Path) -> Iterator[Record]:
        raw = f.read_bytes()
        self.bytes_done += len(raw)
        text = _decode(raw, f, None).removeprefix(_BOM)
        decoder = json.JSONDecoder()
        pos, line = text.index("[") + 1, 1 + text.count("\n", 0, text.index("["))
        expect_value, first = True, True
        while True:
            pos, line = _skip_space(text, pos, line)
            if pos >= len(text):
                raise UserError(f"{f}:{line}", "ends before the closing ']' of the array",
                                "complete the JSON array or use one object per line (.jsonl)")
            if text[pos] == "]" and (not expect_value or first):
                break
            if not expect_value:
                if text[pos] != ",":
                    raise UserError(f"{f}:{line}", f"expected ',' or ']' but found '{text[pos]}'",
                                    "separate the records of the array with commas")
                pos, expect_value = pos + 1, True
                continue
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                raise UserError(f"{f}:{e.lineno}", f"is not valid JSON ({e.msg} at column "
                                f"{e.colno})", "fix the JSON at that line") from None
            except (RecursionError, ValueError) as e:
                raise _unreadable(f"{f}:{line}", e) from None
            yield _text_only(_object(Record(f, line, value)), text[pos:end])
            line += text.count("\n", pos, end)
            pos, expect_value, first = end, False, False
        rest = text[pos + 1:].strip()
        if rest:
            raise UserError(f"{f}:{line}", "has text after the closing ']' of the array",
                            "remove it: a .json file holds one array of records")


def _first_char(f: Path) -> str:
    with open(f, "rb") as fh:
        head = fh.read(4096)
    text = head.decode("utf-8", errors="replace").removeprefix(_BOM).lstrip()
    return text[:1]


def _skip_space(text: str, pos: int, line: int) -> tuple[int, int]:
    while pos < len(text) and text[pos] in " \t\r\n":
        line += text[pos] == "\n"
        pos += 1
    return pos, line


def _decode(raw: bytes, f: Path, line: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if line is None:  # a whole file: find the line of the bad byte
            line = raw.count(b"\n", 0, e.start) + 1
            column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        else:
            column = e.start + 1
        raise UserError(f"{f}:{line}", f"is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                        f"byte column {column})",
                        "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _unreadable(where: str, e: Exception) -> UserError:
    """json's other failures on hostile input: nesting past the recursion limit, or an integer
    past Python's 4300-digit conversion limit."""
    what = "nested too deeply" if isinstance(e, RecursionError) else f"a number too large ({e})"
    return UserError(where, f"is JSON {what} to read", "fix or remove that record")


def _object(rec: Record) -> Record:
    if not isinstance(rec.value, dict):
        raise UserError(rec.where, f"is a JSON {type(rec.value).__name__}, not an object",
                        'each record must be an object such as {"text": "..."}')
    return rec


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _text_only(rec: Record, source: str) -> Record:
    """Refuse a record whose JSON escapes decode to lone surrogates ("\\ud800"): Python keeps
    them, but no encoder (the tokenizer's included) accepts them. A scan of the source line
    finds the candidates; only those records are walked."""
    if _SURROGATE_ESCAPE.search(source) and lone_surrogate(rec.value) is not None:
        raise UserError(rec.where, "holds a lone surrogate escape (\\ud800-\\udfff without its "
                        "pair), which is not text", "fix the record: surrogate escapes must "
                        "come in high/low pairs, e.g. \\ud83d\\ude00")
    return rec
