"""A pickle-free codec for state trees: model/optimizer/scheduler state dicts and RNG states.

Dense snapshots are read back from media that may be corrupt or hostile, so `decode` never
executes code and never trusts a length: every malformed input raises `PoolCorruptError` with a
one-line message. (The caller checksums the whole blob; this layer only has to be safe.)
`LayoutCache` pickles trees only to compare two of them; nothing is ever unpickled.

Tree values: None, bool, int (any size), float (bit-exact, nan payloads and -0.0 included), str,
bytes, list, tuple, dict, OrderedDict, torch.Tensor (CPU, strided) and numpy.ndarray. Dict keys
are str, int, float, bool, None, or tuples of those. Types round-trip exactly (list vs tuple,
bool vs int, dict vs OrderedDict, tensor vs ndarray), and so does the `_metadata` attribute that
`Module.state_dict()` sets on its OrderedDict (module versions, which `load_state_dict` reads);
an nn.Parameter comes back as a plain tensor, as `state_dict()` gives it.

Format v1 (all integers little-endian; the host must be little-endian too):

    0     header    32 bytes: magic b"CXLSTATE", u32 version (1), u32 flags (0),
                    u64 manifest length M, u64 blob count
    32    manifest  M bytes of ASCII JSON: the tree as tagged nodes (below)
    D     data      D = align64(32 + M); blobs, each at a 64-aligned offset relative to D

Manifest nodes: JSON null/true/false/string/int are None/bool/str/int (ints within int64);
every other value is a JSON list whose first item is a tag:

    ["i", "-0x1f"]                   int outside int64, as Python's hex()
    ["f", "3ff0000000000000"]        float, its IEEE-754 binary64 bits as 16 lowercase hex digits
    ["l", [node, ...]]               list
    ["t", [node, ...]]               tuple
    ["d", [[key, value], ...]]       dict, in insertion order
    ["o", [[key, value], ...]]       OrderedDict; with a third item, the node of its `_metadata`
    ["b", offset, nbytes]            bytes
    ["T", dtype, shape, offset, nbytes]   torch.Tensor, C-order bytes
    ["A", dtype, shape, offset, nbytes]   numpy.ndarray, C-order bytes

Blobs are laid out in manifest order (depth first, dict key before value), each at the first
64-aligned offset after the previous one ends, and the buffer ends exactly where the last blob
ends: the decoder accepts only that canonical layout, so blobs can neither overlap nor hide.
Containers nest at most `MAX_DEPTH` deep; shapes have at most `MAX_NDIM` dims.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import re
import struct
import sys
from collections import OrderedDict

import numpy as np
import torch

from cxltrain.errors import PoolCorruptError

__all__ = ["encode", "decode", "lay_out", "LayoutCache", "capture_rng", "restore_rng", "MAX_DEPTH", "MAX_NDIM"]

# Blob bytes are written and read in host order; the format says little-endian.
if sys.byteorder != "little":
    raise ImportError("cxltrain.checkpoint.codec needs a little-endian host")

MAGIC = b"CXLSTATE"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, manifest length, blob count
ALIGN = 64
MAX_DEPTH = 64
MAX_NDIM = 32
# numpy and torch both overflow when sizes or strides reach 2**63 bytes, even for empty shapes.
_MAX_SPAN = 1 << 62

_TORCH_DTYPES = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
}
_NUMPY_DTYPES = {name: np.dtype(name) for name in _TORCH_DTYPES if name != "bfloat16"}
_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
# Keyed by np.dtype, so a byte-swapped '>f4' is not mistaken for float32.
_NUMPY_NAMES = {dtype: name for name, dtype in _NUMPY_DTYPES.items()}
_ITEMSIZE = {name: np.dtype("uint16" if name == "bfloat16" else name).itemsize for name in _TORCH_DTYPES}

_KEY_SCALARS = (str, int, float, bool, type(None))
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_FLOAT_HEX = re.compile(r"[0-9a-f]{16}")
_INT_HEX = re.compile(r"-?0x[0-9a-f]+")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _path(path: tuple) -> str:
    return "state" + "".join(f"[{key!r}]" for key in path)


def _is_key(key) -> bool:
    if type(key) is tuple:
        return all(_is_key(item) for item in key)
    return type(key) in _KEY_SCALARS


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
class _Encoder:
    """Turns a tree into manifest nodes, collecting each blob's bytes (a uint8 view, no copy)."""

    def __init__(self):
        self.blobs: list[tuple[int, np.ndarray | bytes]] = []  # (offset in data area, bytes)
        self.arrays: list[int] = []  # indices of the blobs that are a tensor's or an ndarray's bytes
        self.sources: list = []      # ... and those tensors and ndarrays, in the same order
        self.cursor = 0  # next free 64-aligned offset in the data area
        self.end = 0     # where the last blob ends

    def blob(self, raw: np.ndarray | bytes) -> list[int]:
        nbytes = len(raw)
        offset = self.cursor
        self.blobs.append((offset, raw))
        self.end = offset + nbytes
        self.cursor = _align(self.end)
        return [offset, nbytes]

    def node(self, x, path: tuple, depth: int):
        kind = type(x)
        if kind is torch.Tensor:  # first: most nodes of a state dict are tensors
            return self.tensor(x, path)
        if x is None or kind is bool or kind is str:
            return x
        if kind is int:
            return x if _INT64_MIN <= x <= _INT64_MAX else ["i", hex(x)]
        if kind is float:
            return ["f", struct.pack(">d", x).hex()]
        if kind is bytes:
            return ["b", *self.blob(x)]
        if kind is list or kind is tuple or kind is dict or kind is OrderedDict:
            if depth >= MAX_DEPTH:
                raise ValueError(f"cannot encode {_path(path)}: containers nest deeper than {MAX_DEPTH}")
            if kind is list or kind is tuple:
                tag = "l" if kind is list else "t"
                if all(type(item) is int for item in x) and (not x or _INT64_MIN <= min(x) and max(x) <= _INT64_MAX):
                    return [tag, list(x)]  # the nodes of plain ints (e.g. python's RNG state), without a call each
                return [tag, [self.node(item, path + (i,), depth + 1) for i, item in enumerate(x)]]
            items = [self.item(key, value, path, depth + 1) for key, value in x.items()]
            node = ["d" if kind is dict else "o", items]
            if hasattr(x, "_metadata"):
                node.append(self.node(x._metadata, path + ("_metadata",), depth + 1))
            return node
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return self.tensor(x, path)
        if kind is np.ndarray:
            return self.ndarray(x, path)
        raise TypeError(f"cannot encode {_path(path)}: unsupported type "
                        f"{kind.__module__}.{kind.__qualname__}")

    def item(self, key, value, path: tuple, depth: int) -> list:
        if type(key) is str or type(key) is int and _INT64_MIN <= key <= _INT64_MAX:  # the node is the key itself
            return [key, self.node(value, path + (key,), depth)]
        if not _is_key(key):
            raise TypeError(f"cannot encode {_path(path)}: dict key {key!r} of type {type(key).__qualname__} "
                            "is not str, int, float, bool, None or a tuple of those")
        return [self.node(key, path, depth), self.node(value, path + (key,), depth)]

    def tensor(self, t: torch.Tensor, path: tuple) -> list:
        name = _TORCH_NAMES.get(t.dtype)
        if name is None or not (t.is_cpu or t.is_cuda) or t.layout != torch.strided or t.is_nested:
            raise TypeError(f"cannot encode {_path(path)}: tensor of dtype {t.dtype}, device {t.device}, "
                            f"layout {t.layout} (need a CPU or CUDA strided tensor of {', '.join(_TORCH_DTYPES)})")
        self.arrays.append(len(self.blobs))
        self.sources.append(t)
        return ["T", name, list(t.shape), *self.blob(_tensor_bytes(t, name))]

    def ndarray(self, a: np.ndarray, path: tuple) -> list:
        name = _NUMPY_NAMES.get(a.dtype)
        if name is None:
            raise TypeError(f"cannot encode {_path(path)}: ndarray of dtype {a.dtype.str} "
                            f"(need native-order {', '.join(_NUMPY_DTYPES)})")
        self.arrays.append(len(self.blobs))
        self.sources.append(a)
        return ["A", name, list(a.shape), *self.blob(_array_bytes(a))]


def _viewable(t: torch.Tensor, name: str) -> bool:
    """Whether _tensor_bytes gives a view of the tensor's memory (not a copy)."""
    if not t.is_cpu:
        return False
    return name != "bfloat16" and t.is_contiguous() and not t.is_neg()


def _tensor_bytes(t: torch.Tensor, name: str) -> np.ndarray:
    """A tensor's bytes in C order, uint8 [nbytes]: a view of it when it can be (no copy). A tensor
    on a GPU is copied to the host first, before anything can change it (the snapshot's D2H copy)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    if _viewable(t, name):  # the common case, ~3x cheaper
        return (t.detach() if t.requires_grad else t).numpy().reshape(-1).view(np.uint8)
    # A lazily negated view holds un-negated bits; contiguous() copies only strided views.
    return t.detach().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()


def _array_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class Layout:
    """A tree laid out in the format above but not yet assembled: the header and manifest, and where
    each blob goes. `pieces()` covers [0, nbytes) exactly, so a writer can store the blobs straight
    from the live tensors into their destination (one copy) instead of assembling bytes first."""

    def __init__(self, head: bytes, data_start: int, blobs: list, data_end: int) -> None:
        self.head = head              # header + manifest
        self.data_start = data_start  # 64-aligned offset of the data area
        self.blobs = blobs            # [(offset in the data area, uint8 array or bytes)]
        self.nbytes = data_start + data_end

    def pieces(self):
        """(offset, bytes-like) in increasing offset order, zero padding included: everything encode()
        would return, piece by piece; the arrays are views of the live tensors (no copy)."""
        yield 0, self.head + bytes(self.data_start - len(self.head))
        pos = self.data_start
        for offset, raw in self.blobs:
            if self.data_start + offset > pos:
                yield pos, bytes(self.data_start + offset - pos)
            yield self.data_start + offset, raw
            pos = self.data_start + offset + len(raw)


def lay_out(tree) -> Layout:
    """Lay `tree` out (see encode) without copying its tensors."""
    enc = _Encoder()
    return _assemble(_json(enc.node(tree, (), 0)), enc.blobs, enc.end)


def _json(node) -> str:
    return json.dumps(node, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def _assemble(manifest: str, blobs: list, data_end: int) -> Layout:
    raw = manifest.encode("ascii")
    head = HEADER.pack(MAGIC, VERSION, 0, len(raw), len(blobs)) + raw
    return Layout(head, _align(len(head)), blobs, data_end)


class LayoutCache:
    """lay_out for a tree laid out again and again — a run's dense state at every batch — at a
    fraction of its cost when the tree keeps its shape.

    The tree (a plain dict) is compared with the previous one at C speed: pickled, with each tensor
    and ndarray pickled as its descriptor (dtype, shape, ...) instead of its values, and the
    `volatile` items left out: top-level items of plain data (no tensors, arrays or bytes) that
    change every batch — the batch, the run's metadata with its running metrics — encoded afresh at
    every call. Equal pickles mean equal shapes, types, keys in the same order and equal scalars bit
    for bit (pickle writes floats' bits and tells int, bool, float, list, tuple, dict and OrderedDict
    apart), so the previous manifest holds, with the volatile items' new text; its blobs are the new
    tree's tensors and arrays, found in the same order (pickle and the encoder both go depth first,
    a dict's items in order, then `_metadata`). Anything else (another shape, an object twice, a
    volatile item holding a tensor) is laid out afresh. Either way the result is what lay_out(tree)
    gives.

    A miss costs the pickling on top of lay_out, and some trees miss every time (a scheduler that
    steps every batch changes the learning rate; Python's RNG state is in the tree): after
    MISSES_BEFORE_PAUSE misses in a row the cache lays out plainly for PAUSE_CALLS calls, then
    compares again (one more miss pauses it again, a hit ends the streak)."""

    MISSES_BEFORE_PAUSE = 4
    PAUSE_CALLS = 8

    def __init__(self, volatile: tuple[str, ...] = ()) -> None:
        if not all(type(key) is str for key in volatile):
            raise TypeError(f"LayoutCache volatile items are top-level str keys, got {volatile!r}")
        self.volatile = volatile
        self.hits = self.misses = 0
        self.compared = 0                 # calls that pickled a skeleton to compare
        self._misses_in_a_row = 0
        self._paused = 0                  # calls left to lay out plainly, without comparing
        self._skeleton: bytes | None = None
        self._items: list[str] = []       # each top-level item's manifest text ([key, value] node)
        self._blobs: list = []            # the last layout's blobs
        self._arrays: list[int] = []      # which of them are tensors' or ndarrays' bytes
        self._views_of: list[int] = []    # for each of those, the address it views, or 0 (a copy, an ndarray)
        self._end = 0

    def lay_out(self, tree) -> Layout:
        if type(tree) is not dict:
            self._skeleton = None
            return lay_out(tree)
        if self._paused:  # the last compared layout stays: a tree that settled meanwhile hits at once
            self._paused -= 1
            return lay_out(tree)
        self.compared += 1
        try:
            skeleton, sources = _skeleton({key: None if key in self.volatile else value for key, value in tree.items()})
        except Exception:  # noqa: BLE001 — what pickle refuses, lay_out refuses with its own message, or lays out
            self._skeleton = None
            return lay_out(tree)
        items = self._items_with_volatile(tree) if skeleton == self._skeleton else None
        if items is not None and len(sources) == len(self._arrays):
            blobs = list(self._blobs)
            for index, view_of, source in zip(self._arrays, self._views_of, sources):
                offset, old = blobs[index]
                if type(source) is np.ndarray:
                    raw = _array_bytes(source)
                elif view_of and source.data_ptr() == view_of and source.is_contiguous() and not source.is_neg():
                    continue  # the same memory as the last layout's view (whose tensor keeps it alive)
                else:
                    raw = _tensor_bytes(source, _TORCH_NAMES[source.dtype])
                if raw.size != old.size:  # cannot be, with equal descriptors; refuse rather than misplace
                    break
                blobs[index] = offset, raw
            else:
                self.hits += 1
                self._misses_in_a_row = 0
                return _assemble('["d",[' + ",".join(items) + "]]", blobs, self._end)
        self.misses += 1
        self._misses_in_a_row += 1
        if self._misses_in_a_row >= self.MISSES_BEFORE_PAUSE:  # and after a pause, one more miss pauses again
            self._misses_in_a_row, self._paused = self.MISSES_BEFORE_PAUSE - 1, self.PAUSE_CALLS
        enc = _Encoder()
        nodes, plain = [], True
        for key, value in tree.items():
            blobs_before = len(enc.blobs)
            nodes.append(enc.item(key, value, (), 1))
            plain = plain and (key not in self.volatile or len(enc.blobs) == blobs_before)
        # Reused only where pickle met the very tensors and arrays the encoder wrote, in its order: not
        # where an object is met twice (pickled once) or an attribute the encoder skips holds one; and
        # only where the volatile items need no blob (their text alone is encoded again).
        same = plain and len(sources) == len(enc.sources) and all(a is b for a, b in zip(sources, enc.sources))
        self._skeleton = skeleton if same else None
        self._items = [_json(node) for node in nodes]
        self._blobs, self._arrays, self._end = enc.blobs, enc.arrays, enc.end
        # where a tensor's blob is a view of it (not a copy): the address it views
        self._views_of = [source.data_ptr() if type(source) is not np.ndarray and
                          _viewable(source, _TORCH_NAMES[source.dtype]) else 0 for source in enc.sources]
        return _assemble('["d",[' + ",".join(self._items) + "]]", enc.blobs, enc.end)  # the items' texts, joined

    def _items_with_volatile(self, tree: dict) -> list[str] | None:
        """The last layout's item texts with the volatile items encoded afresh; None where one of
        them now needs a blob (it is laid out afresh then)."""
        items = []
        for key, text in zip(tree, self._items):
            if key in self.volatile:
                enc = _Encoder()
                node = enc.item(key, tree[key], (), 1)
                if enc.blobs:
                    return None
                text = _json(node)
            items.append(text)
        return items


class _SkeletonPickler(pickle.Pickler):
    """Pickles a tree with its tensors and ndarrays as descriptors, collecting them in order."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=5)
        self.sources: list = []

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            self.sources.append(obj)
            return tuple, ((_TORCH_NAMES.get(obj.dtype), tuple(obj.shape), obj.is_cpu, obj.layout == torch.strided,
                            obj.is_nested),)
        if kind is np.ndarray:
            self.sources.append(obj)
            return tuple, ((obj.dtype.str, obj.shape),)
        return NotImplemented


def _skeleton(tree) -> tuple[bytes, list]:
    """(the pickled skeleton of `tree`, its tensors and ndarrays in encoding order)."""
    out = io.BytesIO()
    pickler = _SkeletonPickler(out)
    pickler.dump(tree)
    return out.getvalue(), pickler.sources


def encode(tree) -> bytes:
    """Serialize `tree` (see the module docstring) into one self-describing bytes object.

    Each tensor's bytes are copied once, straight into the result (strided views once more).
    Raises TypeError naming the path, e.g. "state['opt']['state'][3]['exp_avg']", for a value
    or dict key of an unsupported type, and ValueError for containers nested deeper than MAX_DEPTH.
    """
    return b"".join(raw for _, raw in lay_out(tree).pieces())


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
def _corrupt(msg: str) -> PoolCorruptError:
    return PoolCorruptError(f"state blob is corrupt: {msg}")


def _brief(x) -> str:
    """A short description of a manifest value for an error line (it may be huge or nested)."""
    if type(x) is str:
        return repr(x[:20])
    if type(x) is int:
        return str(x) if abs(x) < 1 << 64 else "a huge int"
    return f"a JSON {type(x).__name__}"


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


class _Decoder:
    """Rebuilds a tree from manifest nodes, checking each blob against the canonical layout."""

    def __init__(self, buf: memoryview, data_start: int):
        self.buf = buf
        self.data_start = data_start
        self.data_len = len(buf) - data_start
        self.count = 0
        self.cursor = 0
        self.end = 0

    def blob(self, offset, nbytes) -> np.ndarray:
        """The blob's bytes as a uint8 view (nbytes,) into the input, which callers must copy."""
        if type(offset) is not int or type(nbytes) is not int:
            raise _corrupt(f"blob offset {_brief(offset)} or size {_brief(nbytes)} is not an integer")
        if offset != self.cursor:
            raise _corrupt(f"blob {self.count} at offset {offset}, expected {self.cursor}")
        if not 0 <= nbytes <= self.data_len - offset:
            raise _corrupt(f"blob {self.count} of {nbytes} bytes at offset {offset} overruns the "
                           f"{self.data_len}-byte data area")
        self.count += 1
        self.end = offset + nbytes
        self.cursor = _align(self.end)
        return np.frombuffer(self.buf, np.uint8, nbytes, self.data_start + offset)

    def node(self, n, depth: int):
        kind = type(n)
        if n is None or kind is bool or kind is str or kind is int:
            return n
        if kind is not list or not n or type(n[0]) is not str:
            raise _corrupt(f"manifest node is {_brief(n)}, not a tagged list")
        tag, args = n[0], n[1:]
        if tag in ("l", "t", "d", "o"):
            if not 1 <= len(args) <= (2 if tag == "o" else 1) or type(args[0]) is not list:
                raise _corrupt(f"container node {tag!r} without one item list")
            if depth >= MAX_DEPTH:
                raise _corrupt(f"containers nest deeper than {MAX_DEPTH}")
            if tag == "l" or tag == "t":
                items = [self.node(item, depth + 1) for item in args[0]]
                return items if tag == "l" else tuple(items)
            out = self.dict(args[0], depth + 1, dict if tag == "d" else OrderedDict)
            if len(args) == 2:
                out._metadata = self.node(args[1], depth + 1)
                if type(out._metadata) is not dict and type(out._metadata) is not OrderedDict:
                    raise _corrupt("OrderedDict _metadata is not a dict")
            return out
        if tag == "f" and len(args) == 1 and type(args[0]) is str and _FLOAT_HEX.fullmatch(args[0]):
            return struct.unpack(">d", bytes.fromhex(args[0]))[0]
        if tag == "i" and len(args) == 1 and type(args[0]) is str and _INT_HEX.fullmatch(args[0]):
            return int(args[0], 16)
        if tag == "b" and len(args) == 2:
            return self.blob(*args).tobytes()
        if tag in ("T", "A") and len(args) == 4:
            return self.array(tag, *args)
        raise _corrupt(f"unknown or malformed node with tag {_brief(tag)} and {len(args)} arguments")

    def dict(self, pairs: list, depth: int, kind: type) -> dict:
        out = kind()
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2:
                raise _corrupt("dict item is not a [key, value] pair")
            key = self.node(pair[0], depth)
            if not _is_key(key):
                raise _corrupt(f"dict key of type {type(key).__qualname__}")
            out[key] = self.node(pair[1], depth)
        # Equal keys (1, 1.0, True) collapse: the encoder never writes them from one dict.
        if len(out) != len(pairs):
            raise _corrupt("dict has duplicate keys")
        return out

    def array(self, tag: str, dtype, shape, offset, nbytes) -> torch.Tensor | np.ndarray:
        names = _TORCH_DTYPES if tag == "T" else _NUMPY_DTYPES
        if type(dtype) is not str or dtype not in names:
            raise _corrupt(f"array dtype {_brief(dtype)} is not one of {', '.join(names)}")
        if (type(shape) is not list or len(shape) > MAX_NDIM
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise _corrupt(f"array shape is {_brief(shape)}, not a list of at most {MAX_NDIM} sizes")
        itemsize = _ITEMSIZE[dtype]
        numel = span = 1
        for d in shape:
            numel *= d
            span *= max(d, 1)
            if span * itemsize >= _MAX_SPAN:
                raise _corrupt(f"array shape with {len(shape)} dims spans 2**62 bytes or more")
        if numel * itemsize != nbytes:
            raise _corrupt(f"array of {dtype} {shape} needs {numel * itemsize} bytes, "
                           f"blob has {_brief(nbytes)}")
        raw = self.blob(offset, nbytes)
        # Any other byte in a bool array is undefined behaviour in torch and numpy.
        if dtype == "bool" and nbytes and raw.max() > 1:
            raise _corrupt("bool array holds a byte other than 0 or 1")
        if tag == "T":
            # Copy into a fresh uint8 tensor of stride 1 (the view to a wider dtype needs it).
            out = torch.empty(nbytes, dtype=torch.uint8)
            out.numpy()[:] = raw
            return out.view(_TORCH_DTYPES[dtype]).reshape(shape)
        return raw.copy().view(_NUMPY_DTYPES[dtype]).reshape(shape)


def decode(data: bytes | bytearray | memoryview):
    """Rebuild the tree `encode` wrote. Tensors and arrays are fresh, contiguous, not aliasing `data`.

    Raises PoolCorruptError (one line) for any malformed input, TypeError if `data` is not a
    contiguous bytes-like object.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER.size:
        raise _corrupt(f"{len(buf)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, flags, manifest_len, blob_count = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise _corrupt(f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION or flags:
        raise _corrupt(f"format version {version} flags {flags:#x}, "
                       f"this build reads version {VERSION} flags 0")
    data_start = _align(HEADER.size + manifest_len)
    if data_start > len(buf):
        raise _corrupt(f"manifest of {manifest_len} bytes overruns the {len(buf)}-byte buffer")
    try:
        text = bytes(buf[HEADER.size:HEADER.size + manifest_len]).decode("ascii")
        root = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise _corrupt(f"manifest is not valid JSON: {e}") from None
    dec = _Decoder(buf, data_start)
    tree = dec.node(root, 0)
    if dec.count != blob_count:
        raise _corrupt(f"manifest names {dec.count} blobs, header says {blob_count}")
    if dec.end != dec.data_len:
        raise _corrupt(f"data area is {dec.data_len} bytes, blobs end at {dec.end}")
    return tree


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------
_MT_N = 624  # words of Mersenne Twister state, for numpy and for Python's random


def capture_rng() -> dict:
    """The global torch (CPU), numpy (legacy) and Python `random` generators' states, encodable.

    {"torch": uint8 tensor (S,),
     "numpy": {"bit_generator": "MT19937", "key": int64 ndarray (624,), "pos": int,
               "has_gauss": int, "cached_gaussian": float},
     "python": (3, tuple of 625 ints, float | None)}   # exactly random.getstate()
    The numpy key is widened from uint32 to int64, which the codec carries.
    """
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"bit_generator": name, "key": key.astype(np.int64), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }


def _check_rng(state) -> None:
    """Checks everything before anything is set, so a bad state leaves all generators untouched."""
    if type(state) is not dict or set(state) != {"torch", "numpy", "python"}:
        raise _corrupt("rng state is not a dict of torch, numpy and python")
    t = state["torch"]
    if (type(t) is not torch.Tensor or t.dtype != torch.uint8
            or t.shape != torch.get_rng_state().shape):
        raise _corrupt("torch rng state is not a uint8 tensor of the generator's size")
    n = state["numpy"]
    if (type(n) is not dict or set(n) != {"bit_generator", "key", "pos", "has_gauss", "cached_gaussian"}
            or type(n["bit_generator"]) is not str or n["bit_generator"] != "MT19937"
            or type(n["key"]) is not np.ndarray or n["key"].dtype != np.int64 or n["key"].shape != (_MT_N,)
            or not ((n["key"] >= 0) & (n["key"] < 1 << 32)).all()
            or type(n["pos"]) is not int or not 0 <= n["pos"] <= _MT_N
            or type(n["has_gauss"]) is not int or n["has_gauss"] not in (0, 1)
            or type(n["cached_gaussian"]) is not float):
        raise _corrupt("numpy rng state is not a legacy MT19937 state")
    p = state["python"]
    if (type(p) is not tuple or len(p) != 3 or type(p[0]) is not int or p[0] != 3
            or type(p[1]) is not tuple or len(p[1]) != _MT_N + 1
            or not all(type(w) is int and 0 <= w < 1 << 32 for w in p[1]) or p[1][-1] > _MT_N
            or not (p[2] is None or type(p[2]) is float)):
        raise _corrupt("python rng state is not a version-3 random.getstate() tuple")


def restore_rng(state: dict) -> None:
    """Set the torch, numpy and Python generators back to a `capture_rng` state, exactly.

    Raises PoolCorruptError (and changes nothing) if `state` is not such a state.
    """
    _check_rng(state)
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], n["key"].astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
