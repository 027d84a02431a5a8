"""The on-disk data cache: content-addressed folders written atomically.

An entry is a folder ``<cache_dir>/<kind>-<key>/`` whose ``meta.json`` is written last; the
folder is built under a temporary name and renamed into place, so a crash leaves either a
complete entry or none. A temporary name says which process writes it
(``<entry>.tmp-<host>-<pid>-<random>``): the next build removes the ones of processes of this
machine that no longer run (a run killed while it tokenized), and any a day old (another
machine's, sharing the folder). Keys are digests of everything the content depends on, so a
changed input simply misses.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

from slideformer.engine.config import format_bytes
from slideformer.engine.data.records import content_hash
from slideformer.engine.errors import UserError
from slideformer.engine.models.tokenizer import TokenizerInfo
from slideformer.engine.testhooks import pause_at

CACHE_VERSION = 2
"""Bumped whenever the stored layout or the tokenization rules change."""
META = "meta.json"
_STALE_S = 24 * 3600
_WRITER = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-[^-]*$")
_RACY_S = 2.0
_MEMO_SIZE = 512


def digest(*parts) -> str:
    """A short hex key of JSON-serialisable parts."""
    text = json.dumps([CACHE_VERSION, *parts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def tokenizer_hash(tok: TokenizerInfo) -> str:
    """Digest of tokenizer.json and tokenizer_config.json, plus what was read from them."""
    h = hashlib.blake2b(digest_size=16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = tok.source / name
        h.update(path.read_bytes() if path.is_file() else tok.tok.to_str().encode())
    for value in (tok.chat_template, tok.bos_token, tok.eos_token, tok.pad_token):
        h.update(b"\0" + str(value).encode())
    return h.hexdigest()


def source_hash(cache_dir: Path, files: list[Path]) -> str:
    """``content_hash(files)``, remembered per (path, size, mtime) in ``cache_dir``.

    Hashing reads every byte (~0.4 s for 200 MB, minutes for a large corpus); the stat check
    makes re-opening an unchanged source instant. File times are coarse (a few ms), so, as git
    does, a file modified in the last seconds is hashed every time: a same-size edit within one
    clock tick of the memoised state would otherwise go unseen.
    """
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = digest(stats)
    memo_path = cache_dir / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    value = content_hash(files)
    if time.time() - max(s[2] for s in stats) / 1e9 > _RACY_S:
        memo[key] = value
        while len(memo) > _MEMO_SIZE:  # oldest first (dicts keep insertion order)
            memo.pop(next(iter(memo)))
        make_folder(cache_dir)
        tmp = memo_path.with_name(_tmp_prefix("hashes.json") + "memo")
        _write_json(tmp, memo)
        os.replace(tmp, memo_path)
    return value


def make_folder(cache_dir: Path) -> None:
    """``cache_dir`` as a folder, or one clear error (a file in its place, no permission)."""
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UserError(cache_dir, "is a file where the token cache folder goes",
                        "move or delete that file (the runs of this folder keep their "
                        "tokenised data there)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(cache_dir, f"cannot be created as the token cache folder "
                        f"({e.strerror or e})", "make its parent folder writable, or run "
                        "from a folder you can write to") from None


def read_meta(entry: Path) -> dict:
    return json.loads((entry / META).read_text(encoding="utf-8"))


def cached(cache_dir: Path, name: str, build: Callable[[Path], dict]) -> tuple[Path, bool]:
    """The folder ``cache_dir/name``, built by ``build(tmp_folder) -> meta`` when missing.

    Returns:
        (folder, hit): hit is True when the entry already existed.
    """
    make_folder(cache_dir)
    final = cache_dir / name
    if (final / META).is_file():
        return final, True
    _remove_stale(cache_dir)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(name), dir=cache_dir))
    try:
        try:
            meta = build(tmp)
            pause_at("cache.entry")
            _write_json(tmp / META, meta)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(cache_dir).free
            raise UserError(cache_dir, f"ran out of disk space while the data was tokenised "
                            f"into it ({format_bytes(written)} written, "
                            f"{format_bytes(free)} free once that was removed)",
                            "free disk space there, or set output.run_dir to a folder on a "
                            "larger disk (the token cache is the run folder's sibling "
                            ".token-cache, about 5 bytes per token of the data)") from None
        if final.exists() and not (final / META).is_file():
            shutil.rmtree(final)  # an incomplete entry (edited by hand): rebuild
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / META).is_file():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, False


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _tmp_prefix(name: str) -> str:
    """The start of a temporary name of this process for ``name`` (see the module docstring)."""
    return f"{name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _remove_stale(cache_dir: Path) -> None:
    """Delete the temporary entries and files no process will finish."""
    now = time.time()
    for p in cache_dir.glob("*.tmp-*"):
        try:
            if not _abandoned(p, now):
                continue
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()  # source_hash's memo
        except OSError:
            pass


def _abandoned(p: Path, now: float) -> bool:
    """Whether the writer of the temporary ``p`` is a process of this machine that has ended,
    or ``p`` is a day old."""
    writer = _WRITER.search(p.name)
    if writer and writer["host"] == socket.gethostname() and not _running(int(writer["pid"])):
        return True
    return now - p.stat().st_mtime > _STALE_S


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
