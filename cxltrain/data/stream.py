"""The bytes of a Criteo file, plain or gzipped, as blocks: what the index, the gzipped reader
and `cxltrain data convert` stream through.

A gzipped file (told by its magic bytes, whatever its name: `day_0.gz` or `day_0`) is inflated
with Python's zlib, member after member (concatenated gzip files are one stream). A truncated or
corrupt one is a ConfigError naming the file, never a silently shorter stream.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError

GZIP_MAGIC = b"\x1f\x8b"
READ_BYTES = 4 << 20      # compressed or plain bytes read at a time
_GZIP_WBITS = 16 + zlib.MAX_WBITS


def open_binary(path: Path):
    """`open(path, "rb")`, with the usual failures as one line each."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a Criteo file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def is_gzip(path: Path) -> bool:
    with open_binary(path) as f:
        return f.read(2) == GZIP_MAGIC


def blocks(path: Path, read_bytes: int = READ_BYTES, progress=None) -> Iterator[bytes]:
    """The file's (inflated) bytes, block by block. `progress(n)` is told each n bytes read from disk."""
    gz = is_gzip(path)
    with open_binary(path) as f:
        if not gz:
            while chunk := f.read(read_bytes):
                if progress is not None:
                    progress(len(chunk))
                yield chunk
            return
        yield from _inflate(path, f, read_bytes, progress)


def _inflate(path: Path, f, read_bytes: int, progress) -> Iterator[bytes]:
    inflater = zlib.decompressobj(_GZIP_WBITS)
    while True:
        chunk = f.read(read_bytes)
        if progress is not None and chunk:
            progress(len(chunk))
        if not chunk:
            if not inflater.eof:
                raise ConfigError(f"{path}: truncated .gz file (it ends inside compressed data)")
            return
        while chunk:
            if inflater.eof:  # another member follows (concatenated .gz files are one stream)
                if not chunk.startswith(GZIP_MAGIC[:len(chunk)]):
                    raise ConfigError(f"{path}: corrupt .gz file (bytes after the end of the compressed data)")
                inflater = zlib.decompressobj(_GZIP_WBITS)
            try:
                out = inflater.decompress(chunk)
            except zlib.error as e:
                raise ConfigError(f"{path}: corrupt .gz file ({e})") from None
            if out:
                yield out
            chunk = inflater.unused_data if inflater.eof else inflater.unconsumed_tail


def file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
