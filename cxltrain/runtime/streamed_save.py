"""torch.save, byte for byte, of a state whose big tensors are written chunk by chunk (docs/tiers.md, memory).

torch.save needs every tensor whole in memory, so an export needed its tables in memory. Here a
table is a `Streamed` value (its shape, dtype and a generator of row chunks) and never exists
whole: torch's own pickling and writer (torch.serialization._save, PyTorchFileWriter) write
data.pkl, every header, the padding, the zip64 records and the central directory, and are told to
skip a Streamed tensor's bytes (write_record_metadata): the writer seeks over them, and the seek
is where we write them, a chunk at a time. The writer cannot know the CRC-32 of bytes it skipped:
it writes 0 in the record's data descriptor and central directory entry, and derives the
serialization id from those zeros. Once it is done, those three are patched in place with what
torch.save would have written, so the file equals torch.save's byte for byte
(tests/test_streamed_save.py compares them).

A Streamed value is pickled as a placeholder, torch.empty of its shape: memory the allocator maps
and nothing ever touches, so it costs address space, not memory.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import zlib
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

DESCRIPTOR = b"PK\x07\x08"       # a record's data descriptor (CRC-32, sizes), written after its bytes
LOCAL_HEADER = b"PK\x03\x04"
CENTRAL_ENTRY = b"PK\x01\x02"
SERIALIZATION_ID = "archive/.data/serialization_id"
MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A tensor [shape] of `dtype` that is written as `chunks()` yields it: contiguous arrays whose
    bytes, in order, are the tensor's row-major bytes (each a whole number of rows)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        """The whole tensor in memory (what an in-process export returns)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        flat = out.view(-1).numpy().view(np.uint8)
        at = 0
        for chunk in self.chunks():
            raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            flat[at : at + raw.size] = raw
            at += raw.size
        if at != flat.size:
            raise RuntimeError(f"a streamed tensor {list(self.shape)} yielded {at} bytes, not {flat.size}")
        return out


def save(obj, f: BinaryIO) -> None:
    """torch.save(obj, f) where the Streamed values anywhere in obj's dicts, lists and tuples are
    written chunk by chunk (as the tensors they stand for). f: an empty file opened for reading and
    writing ("w+b"), with a fileno: records are patched in place once written."""
    sources: dict[int, Streamed] = {}
    placeholders = _placeholders(obj, sources)
    stream = _Stream(f)
    writer = torch._C.PyTorchFileWriter(stream, torch.serialization.get_crc32_options(),
                                        torch.serialization._get_storage_alignment())
    try:
        torch.serialization._save(placeholders, _Records(writer, stream, sources), pickle,
                                  torch.serialization.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
        stream.check()
    except BaseException:
        stream.stop()  # whatever the writer still writes (its destructor ends the file) goes nowhere
        stream.check()
        raise
    f.flush()
    stream.patch(torch.serialization.get_crc32_options())


def _placeholders(obj, sources: dict[int, Streamed]):
    """obj with each Streamed value replaced by torch.empty of its shape (untouched memory), noted
    in `sources` by its storage's address."""
    if isinstance(obj, Streamed):
        tensor = torch.empty(obj.shape, dtype=obj.dtype)
        sources[tensor.untyped_storage().data_ptr()] = obj
        return tensor
    if type(obj) is dict:
        return {k: _placeholders(v, sources) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_placeholders(v, sources) for v in obj)
    return obj


class _Records:
    """What torch.serialization._save writes its records to: torch's writer, except that a
    placeholder's record is skipped there (write_record_metadata) and its bytes streamed."""

    def __init__(self, writer, stream: "_Stream", sources: dict[int, Streamed]) -> None:
        self.writer, self.stream, self.sources = writer, stream, sources

    def write_record(self, name: str, data, size: int) -> None:
        source = self.sources.get(data.data_ptr()) if isinstance(data, torch.UntypedStorage) and size else None
        if source is None:
            self.writer.write_record(name, data, size)
        else:
            self.stream.expect(f"archive/{name}", source, size)
            self.writer.write_record_metadata(name, size)
            self.stream.check()


class _Stream(io.RawIOBase):
    """The file-like object torch's writer writes to: passes its bytes on, writes a skipped
    record's bytes where the writer seeks over them, and notes what patch() must fix.

    The writer calls write and seek from C (miniz), which an exception cannot cross (the process
    aborts): they never raise. The first error (a full disk, a chunk that fails, Ctrl-C) is kept,
    everything after it goes nowhere, and check() raises it back in Python."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self.f, self.pos = f, 0
        self.pending: tuple[str, Streamed, int] | None = None
        self.filled: dict[str, tuple[int, int]] = {}  # a streamed record -> (its descriptor's offset, CRC-32)
        self.crcs: list[int] = []   # the CRC-32s the writer combines into the serialization id, in order
        self.descriptor: tuple[str, int] | None = None   # the streamed record whose descriptor comes next
        self.last_header = -1
        self.error: BaseException | None = None
        self.stopped = False

    def writable(self) -> bool:
        return True

    def expect(self, name: str, source: Streamed, size: int) -> None:
        if size != source.nbytes:
            raise RuntimeError(f"record {name}: torch writes {size} bytes of a {source.nbytes}-byte tensor")
        self.pending = (name, source, size)

    def stop(self) -> None:
        self.stopped = True

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if not self.stopped:
            try:
                self._write(memoryview(data).cast("B"))
            except BaseException as e:  # noqa: BLE001 (kept for check(): see the class docstring)
                self.error, self.stopped = e, True
        return size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if not self.stopped:
            try:
                self._fill(offset, whence)
            except BaseException as e:  # noqa: BLE001 (as in write)
                self.error, self.stopped = e, True
        return self.pos

    def _write(self, view: memoryview) -> None:
        head = bytes(view[:8])
        if len(view) == 30 and head[:4] == LOCAL_HEADER:
            self.last_header = self.pos
        if self.descriptor is not None:
            name, crc = self.descriptor
            if head[:4] != DESCRIPTOR:
                raise RuntimeError(f"record {name}: torch's writer wrote no data descriptor after it")
            self.filled[name] = (self.pos, crc)
            head = head[:4] + crc.to_bytes(4, "little")
            self.descriptor = None
        if len(view) >= 8 and head[:4] == DESCRIPTOR:  # the writer's own rule (inline_container.cc)
            self.crcs.append(int.from_bytes(head[4:8], "little"))
        self.f.write(view)
        self.pos += len(view)

    def _fill(self, offset: int, whence: int) -> None:
        if self.pending is None or whence != os.SEEK_CUR or offset != self.pending[2]:
            raise RuntimeError(f"torch's writer moved {offset} bytes (whence {whence}), not over a streamed record")
        name, source, size = self.pending
        self.pending = None
        crc, first, written = 0, b"", 0
        for chunk in source.chunks():
            raw = memoryview(np.ascontiguousarray(chunk)).cast("B")
            first += bytes(raw[: max(0, 8 - len(first))])
            crc = zlib.crc32(raw, crc)
            self.f.write(raw)
            written += len(raw)
            self.pos += len(raw)
        if written != size:
            raise RuntimeError(f"record {name}: {written} bytes streamed, {size} expected")
        if len(first) >= 8 and first[:4] == DESCRIPTOR:  # the rule again: torch.save writes the record at once
            self.crcs.append(int.from_bytes(first[4:8], "little"))
        self.descriptor = (name, crc)

    def tell(self) -> int:
        return self.pos

    def patch(self, with_crc: bool) -> None:
        """Write the streamed records' CRC-32s into their descriptors and central directory entries,
        and the serialization id the writer would have made from them (and that record's CRC-32).
        with_crc: torch writes CRC-32s (torch.serialization.get_crc32_options); without, only zeros."""
        if not with_crc:
            return  # the writer wrote 0 for every record, as for ours
        fd = self.f.fileno()
        for offset, crc in self.filled.values():
            os.pwrite(fd, crc.to_bytes(4, "little"), offset + 4)
        header = os.pread(fd, 30, self.last_header)
        name_len, extra_len = struct.unpack_from("<HH", header, 26)
        name = os.pread(fd, name_len, self.last_header + 30).decode(errors="replace")
        if header[:4] != LOCAL_HEADER or name != SERIALIZATION_ID:
            raise RuntimeError(f"torch's writer ended with record {name!r}, not {SERIALIZATION_ID}")
        at = self.last_header + 30 + name_len + extra_len
        old = os.pread(fd, 40, at)
        # the id is two 20-digit numbers: the record names' hash (the writer's, kept) and the
        # records' CRC-32s combined as c10::hash_combine does, in the order they were written
        combined = 0
        for crc in self.crcs[:-1]:  # the last is the id record's own
            combined = (combined ^ (crc + 0x9E3779B9 + (combined << 6) + (combined >> 2))) & MASK64
        new = old[:20] + f"{combined:020d}".encode()
        os.pwrite(fd, new, at)
        crcs = {name: zlib.crc32(new), **{record: crc for record, (_, crc) in self.filled.items()}}
        os.pwrite(fd, crcs[name].to_bytes(4, "little"), at + len(new) + 4)
        _patch_central_directory(fd, crcs)


def _patch_central_directory(fd: int, crcs: dict[str, int]) -> None:
    """Set the CRC-32 of the central directory entries named in `crcs` (zip64 end records: the
    writer always writes them)."""
    end = os.fstat(fd).st_size
    locator = os.pread(fd, 20, end - 22 - 20)
    if locator[:4] != b"PK\x06\x07":
        raise RuntimeError("torch's writer wrote no zip64 end locator")
    record = os.pread(fd, 56, struct.unpack_from("<Q", locator, 8)[0])
    size, offset = struct.unpack_from("<QQ", record, 40)
    central = os.pread(fd, size, offset)
    at, found = 0, 0
    while at < len(central) and central[at : at + 4] == CENTRAL_ENTRY:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", central, at + 28)
        name = central[at + 46 : at + 46 + name_len].decode(errors="replace")
        if name in crcs:
            os.pwrite(fd, crcs[name].to_bytes(4, "little"), offset + at + 16)
            found += 1
        at += 46 + name_len + extra_len + comment_len
    if found != len(crcs):
        raise RuntimeError(f"torch's central directory names {found} of the {len(crcs)} records patched")
