"""Tar shards read at random: an index of each sample's members, and reads by byte range.

NOTE [ Tar shards ]
-------------------
Shards in webdataset's layout (``key.ext`` members in plain tar files, a sample's members next
to each other) are usually read as streams, shuffled through a buffer, so an epoch's order
depends on the buffer, the shard split and the number of workers, and a resume starts the
shard again. Indexed, they are a map-style dataset like any other: every sample has a byte
range in one shard, the loader's sampler orders them (a true shuffle of the whole set, sharded
by rank, resumed exactly, the same for any number or kind of workers), and a worker reads the
range with one ``pread``.

The index is built when the dataset is: each shard's headers are read (512 bytes each; the
members' data is skipped: about 1% of a shard of 100 KB images is read) and kept in numpy arrays
(shard, offset and size of a member per sample: no Python object per sample, so forked workers
share them). Headers are parsed here (ustar and GNU); a shard with any other kind of header (pax
or GNU long names, sparse files) is listed by Python's ``tarfile`` instead. A damaged header
(its checksum wrong, unsigned and signed) is an error naming its byte, never the end of the
shard: ``tarfile`` ends a listing quietly there, so after its listing the next block must be an
end-of-archive block or the file's end. The checksums cost about a third of the indexing and
are kept: a damaged size field would otherwise skip members silently. Keys and extensions are
webdataset's: the key is a member's path up to the first dot of its file name, the extension the
rest, lower-cased; consecutive members with one key are one sample; directories, links and names
without a dot are skipped. Compressed shards cannot be read at random and are refused, naming
the fix (``gunzip``). A read opens the shard, reads and closes it (no descriptor kept between
batches: thread workers share nothing, forked workers inherit nothing, and a thousand shards
need no ``ulimit -n``); a shard changed since it was indexed is caught by its size and mtime at
the read, an error even with ``on_error="skip"`` (its offsets no longer hold).

Threads help when the headers come from disk and hurt when they come from memory (the parsing
holds the GIL, which changes hands at every short read), so shards are indexed one after
another until one is slow (over 25 us a member: a cold cache, a network file system), and the
rest then eight at a time.
Measurements: docs/how-it-works/measurements/sources.md#tar-shard-index.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from .protocol import SourceChanged

_BLOCK = 512
#: a shard indexed slower than this a member had its headers read from disk, not memory
_SLOW_MEMBER_S = 25e-6
_REGULAR = (b"0", b"\0", b"7")
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos
_COMPRESSED = {b"\x1f\x8b": "gzip (gunzip it)", b"BZh": "bzip2 (bunzip2 it)",
               b"\xfd7zXZ\0": "xz (unxz it)", b"(\xb5/\xfd": "zstd (unzstd it)"}


class Member(NamedTuple):
    """A regular file in a shard: its path, where its data starts, how many bytes."""

    name: str
    offset: int
    size: int


class ShardStamp(NamedTuple):
    """A shard's size and modification time when it was indexed."""

    size: int
    mtime_ns: int


class TarFormatError(ValueError):
    """A header this parser leaves to ``tarfile`` (pax, GNU long names, sparse files)."""


def expand(shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Shard paths from a list of paths, a folder (its ``*.tar`` files, sorted), a glob
    pattern, brace ranges such as ``train-{000000..000146}.tar`` (zero-padded by the first
    bound's width) and brace lists such as ``{train,extra}-{0..9}.tar``."""
    if not isinstance(shards, (str, os.PathLike)):
        paths = [os.fspath(p) for p in shards]
        if not paths:
            raise ValueError("shards=[] names no shard; pass tar files, a folder or a pattern")
        return paths
    spec = os.path.expanduser(os.fspath(shards))
    if os.path.isdir(spec):
        paths = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.endswith(".tar"))
        if not paths:
            raise FileNotFoundError(f"no *.tar file in the folder {spec!r}")
        return paths
    m = re.search(r"\{([^{}]*,[^{}]*)\}", spec)
    if m:  # a list of alternatives: {train,extra}
        return [p for alt in m[1].split(",")
                for p in expand(spec[:m.start()] + alt + spec[m.end():])]
    m = re.search(r"\{(\d+)\.\.(\d+)\}", spec)
    if m:
        lo, hi, width = int(m[1]), int(m[2]), len(m[1])
        if hi < lo:
            raise ValueError(f"shards={spec!r}: the range {{{m[1]}..{m[2]}}} is empty")
        return [p for k in range(lo, hi + 1)
                for p in expand(spec[:m.start()] + str(k).zfill(width) + spec[m.end():])]
    if glob.has_magic(spec):
        paths = sorted(glob.glob(spec))
        if not paths:
            raise FileNotFoundError(f"no file matches the shard pattern {spec!r}")
        return paths
    return [spec]


def members(path: str) -> list[Member]:
    """The regular files of the tar file ``path``, in order (NOTE [ Tar shards ])."""
    with open(path, "rb") as f:
        head = f.read(_BLOCK)
        what = next((w for m, w in _COMPRESSED.items() if head.startswith(m)), None)
        if what is not None and not _is_header(head):  # (a member's name may start so)
            raise ValueError(f"shard {path!r} is compressed with {what}: tar shards are "
                             "read at random, which needs plain (uncompressed) tar files")
        try:
            return _parse(f.fileno(), path)
        except TarFormatError:
            return _with_tarfile(path)


def _parse(fd: int, path: str) -> list[Member]:
    out: list[Member] = []
    offset, end = 0, os.fstat(fd).st_size
    while True:
        if offset >= end and out:  # no end-of-archive blocks: tarfile accepts that too
            return out
        hdr = os.pread(fd, _BLOCK, offset)
        if len(hdr) < _BLOCK:
            raise ValueError(f"shard {path!r} is not a tar file or is cut short "
                             f"(a {len(hdr)}-byte header at byte {offset})")
        if hdr.count(0) == _BLOCK:  # end of archive
            return out
        if not _checksum_ok(hdr, _number(hdr[148:156], path, offset)):
            raise ValueError(f"shard {path!r} is not a tar file or is damaged: bad header "
                             f"checksum at byte {offset}")
        kind = hdr[156:157]
        size = _number(hdr[124:136], path, offset)
        data = offset + _BLOCK
        if data + size > end:
            raise ValueError(f"shard {path!r} is cut short: a member of {size} bytes at byte "
                             f"{data} ends past the file's end ({end} bytes)")
        if kind in _REGULAR:
            name = hdr[:100].split(b"\0", 1)[0]
            if hdr[257:263] == b"ustar\0":  # POSIX: a prefix holds the path's start
                prefix = hdr[345:500].split(b"\0", 1)[0]
                if prefix:
                    name = prefix + b"/" + name
            out.append(Member(name.decode("utf-8", "surrogateescape"), data, size))
        elif kind not in _SKIPPED:
            raise TarFormatError(kind)
        offset = data + -(-size // _BLOCK) * _BLOCK


def _is_header(block: bytes) -> bool:
    """Whether ``block`` is a tar header (its checksum holds)."""
    try:
        return len(block) == _BLOCK and _checksum_ok(block, _number(block[148:156], "", 0))
    except ValueError:
        return False


def _checksum_ok(hdr: bytes, stored: int) -> bool:
    """The header's sum of bytes (its checksum field as spaces), unsigned or, as some old
    writers made it, of signed bytes."""
    total = sum(hdr[:148]) + 8 * 32 + sum(hdr[156:])
    if total == stored:
        return True
    high = sum(1 for b in hdr[:148] + hdr[156:] if b > 127)
    return total - 256 * high == stored


def _number(field: bytes, path: str, offset: int) -> int:
    if field[0] & 0x80:  # GNU base-256, for sizes past 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ValueError(f"shard {path!r} is not a tar file or is damaged: a header at byte "
                         f"{offset} holds {field!r} where a number belongs") from None


def _with_tarfile(path: str) -> list[Member]:
    try:
        with tarfile.open(path, "r:") as tf:
            found = [Member(m.name, m.offset_data, m.size) for m in tf
                     if m.isreg() and not m.sparse]
            stop = tf.offset
    except tarfile.TarError as exc:
        raise ValueError(f"shard {path!r} is not a readable tar file: {exc}") from None
    with open(path, "rb") as f:  # tarfile ends its listing quietly at a damaged header
        rest = os.pread(f.fileno(), _BLOCK, stop)
    if rest.count(0) != len(rest):
        raise ValueError(f"shard {path!r} is damaged: no tar header at byte {stop}, where "
                         "the listing stopped (members after it would be lost)")
    if found and found[-1].offset + found[-1].size > os.path.getsize(path):
        raise ValueError(f"shard {path!r} is cut short: its last member ends past the file")
    return found


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member, webdataset's way; None for a name it skips."""
    slash = name.rfind("/") + 1
    base = name[slash:]
    dot = base.find(".")
    if dot <= 0 or "__MACOSX" in name:  # no extension, or a hidden file
        return None
    return name[:slash + dot], base[dot + 1:].lower()


def samples(path: str, found: list[Member]) -> Iterator[tuple[str, dict[str, Member]]]:
    """(key, {extension: member}) per sample of one shard, in order."""
    key: str | None = None
    parts: dict[str, Member] = {}
    for m in found:
        split = split_name(m.name)
        if split is None:
            continue
        k, ext = split
        if k != key:
            if key is not None:
                yield key, parts
            key, parts = k, {}
        if ext in parts:
            raise ValueError(f"shard {path!r} holds {m.name!r} twice in a row (sample "
                             f"{k!r}); a sample's members must have distinct names")
        parts[ext] = m
    if key is not None:
        yield key, parts


def index_all(paths: Sequence[str],
              per_shard: Callable[[str, list[Member], ShardStamp], object]) -> list[object]:
    """``per_shard(path, members(path), stamp)`` for every shard, in order (the stamp taken
    before the shard is read, so a change while it is indexed is caught at a later read), in
    threads from the first slow shard on (NOTE [ Tar shards ])."""

    def index(path: str) -> tuple[object, int]:
        st = os.stat(path)
        before = ShardStamp(st.st_size, st.st_mtime_ns)
        found = members(path)
        return per_shard(path, found, before), len(found)

    out: list[object] = []
    for k, path in enumerate(paths):
        start = time.perf_counter()
        done, count = index(path)
        out.append(done)
        rest = paths[k + 1:]
        if rest and time.perf_counter() - start > _SLOW_MEMBER_S * max(count, 1):
            with ThreadPoolExecutor(min(8, len(rest)),
                                    thread_name_prefix="gpufeed-tar-index") as pool:
                out.extend(done for done, _ in pool.map(index, rest))
            break
    return out


def read_range(path: str, offset: int, size: int, expect: ShardStamp) -> bytes:
    """``size`` bytes of ``path`` from ``offset``, refusing a shard changed since it was
    indexed."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != expect:
            raise SourceChanged(f"shard {path!r} changed since the dataset indexed it (size "
                                f"{expect.size} -> {st.st_size} bytes); build the dataset again")
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise ValueError(f"shard {path!r} is cut short: {size} bytes at {offset} gave "
                         f"{len(data)}")
    return data
