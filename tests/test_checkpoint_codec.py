"""The state-tree codec: exact round trips, real optimizer/scheduler/RNG states, hostile bytes."""

from __future__ import annotations

import json
import math
import random
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cxltrain.checkpoint.codec import HEADER, MAGIC, MAX_DEPTH, LayoutCache, capture_rng, decode, encode, restore_rng
from cxltrain.errors import PoolCorruptError

TORCH_DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.uint8, torch.bool]
NUMPY_DTYPES = [np.dtype(n) for n in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                      "uint8", "bool")]
SHAPES = [(), (0,), (5,), (3, 0, 2), (4, 7), (2, 3, 4)]


def fast(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True, scope="module")
def _keep_global_rng():
    """Tests here seed and replay the global generators; leave them as the module found them."""
    state = capture_rng()
    yield
    restore_rng(state)


def assert_same(a, b, path="state"):
    """Exact equality: same types all the way down, floats and arrays compared bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert b.is_contiguous() and not b.requires_grad, path
        # Byte views compare bit patterns, so nan payloads and -0.0 count.
        assert torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                           b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.tobytes() == b.tobytes() and b.flags.c_contiguous, path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), f"{path}._metadata")
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{path} key {ka!r}")
            assert_same(va, vb, f"{path}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(tree):
    out = decode(encode(tree))
    assert_same(tree, out)
    return out


def random_tensor(dtype: torch.dtype, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (floats include nans, infs, subnormals), shape `shape`."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


SPECIAL_FLOATS = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.5, 1e-40]


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    None, True, False, 0, 1, -1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 3**500, -(7**900),
    0.0, -0.0, math.nan, -math.nan, struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0],
    math.inf, -math.inf, 5e-324, 1.7976931348623157e308, 0.1,
    "", "héllo ☃ \x00 \n", "\ud800 lone surrogate", b"", bytes(range(256)) * 3,
])
def test_scalars_roundtrip(value):
    roundtrip(value)
    roundtrip([value, (value,), {"k": value}])


def test_containers_keep_their_types():
    tree = {
        "list": [1, [2, (3, [])], ()], "tuple": (1, (2,), [3]), "empty": {}, "nested": {"a": {"b": {"c": []}}},
        1: "int key", 2.5: "float key", -0.0: "neg zero key", math.nan: "nan key", None: "none key",
        (1, ("a", None), 2.0): "tuple key", (): "empty tuple key", "bools": {True: "bool key", 0: "int 0"},
    }
    out = roundtrip(tree)  # also checks key types: True stays bool, 1 stays int
    assert list(out)[:4] == ["list", "tuple", "empty", "nested"]
    assert type(out["tuple"][2]) is list and type(out["list"][1][1]) is tuple


def test_ordered_dicts_keep_type_and_metadata():
    plain = OrderedDict([("b", 1), ("a", {"c": OrderedDict()})])
    out = roundtrip(plain)
    assert type(out["a"]["c"]) is OrderedDict and not hasattr(out, "_metadata")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    state = roundtrip(model.state_dict())
    assert state._metadata == {"": {"version": 1}, "0": {"version": 1}, "1": {"version": 2}}
    model.load_state_dict(state)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensors_roundtrip(dtype, shape):
    gen = torch.Generator().manual_seed(100 * TORCH_DTYPES.index(dtype) + SHAPES.index(shape))
    roundtrip(random_tensor(dtype, shape, gen))


@pytest.mark.parametrize("dtype", [d for d in TORCH_DTYPES if d.is_floating_point], ids=str)
def test_tensor_special_floats(dtype):
    t = torch.tensor(SPECIAL_FLOATS, dtype=dtype)
    roundtrip({"t": t, "row": t[None], "scalar": t[4]})  # t[4] is -0.0, 0-dim


def test_noncontiguous_tensors_come_back_contiguous():
    gen = torch.Generator().manual_seed(1)
    base = random_tensor(torch.float32, (6, 8), gen)
    views = [base.t(), base[::2, 1::3], base[:, 3], base[2:4].expand(3, 2, 8), base.unsqueeze(1)[1:5, :, 2:],
             torch._neg_view(base)]  # a lazily negated view: its stored bits are not its values
    for v in views:
        assert_same(v.clone(), decode(encode(v)))


def test_tensor_decodes_fresh_and_detached():
    param = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    blob = bytearray(encode({"p": param, "g": torch.ones(3, requires_grad=True)}))
    out = decode(memoryview(blob))
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad and not out["g"].requires_grad
    blob[:] = bytes(len(blob))  # the caller reuses its buffer: decoded values must not alias it
    assert torch.equal(out["p"], torch.arange(6.0).reshape(2, 3)) and torch.equal(out["g"], torch.ones(3))


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ndarrays_roundtrip(dtype, shape):
    rng = np.random.default_rng(100 * NUMPY_DTYPES.index(dtype) + SHAPES.index(shape))
    if dtype == np.bool_:
        a = rng.integers(0, 2, shape).astype(bool)
    else:
        a = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    out = roundtrip(a)
    assert type(out) is np.ndarray


def test_noncontiguous_ndarrays_and_specials():
    a = np.arange(48, dtype=np.float64).reshape(6, 8)
    for v in (a.T, a[::-1, ::3], np.asfortranarray(a), a[:, 5]):
        roundtrip(v)
    roundtrip(np.array(SPECIAL_FLOATS, dtype=np.float32))


def test_tensor_and_ndarray_stay_distinct():
    out = roundtrip([torch.zeros(2), np.zeros(2, np.float32), torch.tensor(1), np.array(1)])
    assert [type(x) for x in out] == [torch.Tensor, np.ndarray, torch.Tensor, np.ndarray]


def test_layout_is_as_documented():
    blob = encode(torch.arange(3, dtype=torch.int32))
    magic, version, flags, manifest_len, blobs = struct.unpack_from("<8sIIQQ", blob)
    assert (magic, version, flags, blobs) == (b"CXLSTATE", 1, 0, 1)
    assert json.loads(blob[32:32 + manifest_len]) == ["T", "int32", [3], 0, 12]
    data_start = (32 + manifest_len + 63) // 64 * 64
    assert blob[data_start:] == np.arange(3, dtype="<i4").tobytes()
    assert json.loads(encode([1.0, -2**64])[32:].split(b"\0")[0]) == ["l", [["f", "3ff0000000000000"],
                                                                          ["i", "-0x10000000000000000"]]]


def test_decode_accepts_memoryview_slices():
    blob = encode({"x": torch.arange(10)})
    big = bytearray(b"junk" + blob + b"tail")
    assert torch.equal(decode(memoryview(big)[4:4 + len(blob)])["x"], torch.arange(10))


# ---------------------------------------------------------------------------------------------
# Real training states
# ---------------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _step(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), amsgrad=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adagrad(p, lr=0.1),
], ids=["adam", "sgd-momentum", "adagrad"])
def test_optimizer_state_roundtrips_and_resumes_bitwise(make_opt):
    model = _model()
    opt = make_opt(model.parameters())
    for seed in range(3):
        _step(model, opt, seed)
    snapshot = decode(encode({"model": model.state_dict(), "opt": opt.state_dict()}))
    assert_same(opt.state_dict(), snapshot["opt"])  # int keys of 'state', tuple 'betas', ...

    resumed = _model()
    resumed.load_state_dict(snapshot["model"])
    resumed_opt = make_opt(resumed.parameters())
    resumed_opt.load_state_dict(snapshot["opt"])
    for seed in (10, 11):
        _step(model, opt, seed)
        _step(resumed, resumed_opt, seed)
    assert_same(model.state_dict(), resumed.state_dict())
    assert_same(opt.state_dict(), resumed_opt.state_dict())


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=20),
    lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
], ids=["step", "onecycle", "plateau"])
def test_scheduler_state_roundtrips(make_sched):
    def run(steps):
        opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
        sched = make_sched(opt)
        for i in range(steps):
            opt.step()
            plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
            sched.step(*([1.0 / (i + 1)] if plateau else []))  # a falling loss
        return opt, sched

    _, sched = run(5)
    state = decode(encode(sched.state_dict()))
    assert_same(sched.state_dict(), state)
    _, fresh = run(0)
    fresh.load_state_dict(state)
    assert_same(sched.state_dict(), fresh.state_dict())


def _draws():
    return [torch.rand(5), torch.randn(3), np.random.rand(3), np.random.standard_normal(3),
            random.random(), random.gauss(0.0, 1.0), random.getrandbits(100)]


def test_rng_capture_restore_replays_all_three():
    random.gauss(0.0, 1.0)            # leave a cached second gaussian in each generator,
    np.random.standard_normal(1)      # so the cached halves of the states are exercised
    state = decode(encode(capture_rng()))
    assert state["numpy"]["has_gauss"] == 1 and state["python"][2] is not None
    first = _draws()
    restore_rng(state)
    assert_same(state, capture_rng())
    assert_same(first, _draws())


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("torch"),
    lambda s: s.update(torch=s["torch"][:-1]),
    lambda s: s.update(torch=s["torch"].float()),
    lambda s: s["numpy"].update(key=s["numpy"]["key"][:10]),
    lambda s: s["numpy"].update(key=s["numpy"]["key"] + (1 << 32)),
    lambda s: s["numpy"].update(pos=625),
    lambda s: s["numpy"].update(has_gauss=np.zeros(2)),
    lambda s: s["numpy"].update(bit_generator="PCG64"),
    lambda s: s.update(python=(3, s["python"][1][:-1], None)),
    lambda s: s.update(python=(2, s["python"][1], None)),
    lambda s: s.update(python=(3, s["python"][1][:-1] + (625,), None)),
    lambda s: s.update(python=list(s["python"])),
])
def test_restore_rng_refuses_bad_states_and_changes_nothing(mutate):
    state = capture_rng()
    mutate(state)
    before = capture_rng()
    with pytest.raises(PoolCorruptError):
        restore_rng(state)
    assert_same(before, capture_rng())


# ---------------------------------------------------------------------------------------------
# Generated trees
# ---------------------------------------------------------------------------------------------
@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=math.prod(shape) * itemsize, max_size=math.prod(shape) * itemsize))
    t = torch.tensor(list(raw), dtype=torch.uint8)
    t = (t % 2).bool() if dtype == torch.bool else t.view(dtype)
    t = t.reshape(shape)
    return t.transpose(0, -1) if t.dim() >= 2 and draw(st.booleans()) else t


@st.composite
def ndarrays(draw):
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    raw = np.frombuffer(draw(st.binary(min_size=math.prod(shape) * dtype.itemsize,
                                       max_size=math.prod(shape) * dtype.itemsize)), np.uint8)
    a = (raw % 2).astype(bool) if dtype == np.bool_ else raw.copy().view(dtype)
    a = a.reshape(shape)
    return a[::-1] if a.ndim and draw(st.booleans()) else a


KEYS = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=4)
LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
          | st.binary(max_size=20) | tensors() | ndarrays())
TREES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                     | st.dictionaries(KEYS, inner, max_size=4)
                     | st.dictionaries(KEYS, inner, max_size=4).map(OrderedDict), max_leaves=20)


@fast(200)
@given(TREES)
def test_generated_trees_roundtrip(tree):
    roundtrip(tree)


# ---------------------------------------------------------------------------------------------
# Hostile input: PoolCorruptError, one line, and nothing else
# ---------------------------------------------------------------------------------------------
SAMPLE = {"w": torch.arange(5, dtype=torch.float32), "n": np.array([1, 2], np.int16), "b": b"abc",
          "f": [1.5, -2, 2**70, (True, None)], "m": torch.tensor([True, False]), "s": "x"}


def corrupt(data) -> None:
    with pytest.raises(PoolCorruptError) as info:
        decode(data)
    assert "\n" not in str(info.value)


def decodes_or_corrupt(data) -> None:
    try:
        decode(data)
    except PoolCorruptError as e:
        assert "\n" not in str(e)


def test_every_truncation_and_extension_is_refused():
    blob = encode(SAMPLE)
    for n in range(len(blob)):
        corrupt(blob[:n])
    corrupt(blob + b"\0")


@fast(300)
@given(st.data())
def test_byte_flips_never_escape(data):
    blob = bytearray(encode(SAMPLE))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    decodes_or_corrupt(bytes(blob))  # a flip in tensor bytes still decodes: the caller checksums


@fast(100)
@given(st.binary(max_size=300))
def test_random_bytes_are_refused(data):
    corrupt(data)
    # The same bytes behind a plausible header reach the manifest parser.
    decodes_or_corrupt(HEADER.pack(MAGIC, 1, 0, len(data), 0) + data)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.sampled_from(["l", "t", "d", "f", "i", "b", "T", "A", "float32", "bool", "0x1"]),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=2), inner,
                                                                                max_size=2), max_leaves=25)


@fast(200)
@given(JSON, st.binary(max_size=200), st.integers(0, 3))
def test_random_manifests_never_escape(manifest, data, count):
    decodes_or_corrupt(craft(manifest, data, count))


def craft(manifest, data: bytes = b"", count: int = 0, *, version=1, flags=0, magic=MAGIC) -> bytes:
    """A blob with a hand-written manifest (JSON value or raw bytes) and data area."""
    text = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    head = HEADER.pack(magic, version, flags, len(text), count) + text
    return head + bytes(-len(head) % 64) + data


def nest(depth: int, tag: str = "l"):
    """A manifest of `depth` nested containers of kind `tag` around the int 0."""
    node = 0
    for _ in range(depth):
        node = [tag, [node]] if tag != "d" else ["d", [["k", node]]]
    return node


def nested_lists(depth: int) -> list:
    """`depth` nested Python lists around the int 0."""
    node = 0
    for _ in range(depth):
        node = [node]
    return node


def test_crafted_baseline_decodes():
    """The crafting helper itself makes valid blobs, so the refusals below are about one fault each."""
    assert torch.equal(decode(craft(["T", "float32", [2], 0, 8], bytes(8), 1)), torch.zeros(2))
    assert_same(decode(craft(nest(MAX_DEPTH))), nested_lists(MAX_DEPTH))
    decode(craft(nest(MAX_DEPTH, "d")))
    meta = ["d", [["", ["d", [["version", 1]]]]]]
    assert decode(craft(["o", [["k", 1]], meta]))._metadata == {"": {"version": 1}}


@pytest.mark.parametrize("manifest, data, count", [
    (["T", "complex64", [1], 0, 8], bytes(8), 1),                 # dtype not allowed
    (["A", "bfloat16", [1], 0, 2], bytes(2), 1),                  # numpy has no bfloat16
    (["T", ["float32"], [1], 0, 4], bytes(4), 1),
    (["T", "float32", [3], 0, 8], bytes(8), 1),                   # shape/nbytes mismatch
    (["T", "float32", [-1], 0, 0], b"", 1),
    (["T", "float32", [1.0], 0, 4], bytes(4), 1),
    (["T", "float32", [True], 0, 4], bytes(4), 1),
    (["T", "float32", "3", 0, 12], bytes(12), 1),
    (["T", "float32", [0, 2**62], 0, 0], b"", 1),                 # overflows sizes though empty
    (["T", "float32", [1] * 33, 0, 4], bytes(4), 1),              # too many dims
    (["T", "float32", [2], 64, 8], bytes(72), 1),                 # offset not canonical
    (["T", "float32", [2], 0, 8], bytes(4), 1),                   # blob past the end
    (["T", "float32", [2], 0, "8"], bytes(8), 1),
    (["T", "bool", [2], 0, 2], b"\x01\x02", 1),                   # bool byte other than 0/1
    (["b", -64, 4], bytes(4), 1),
    (["b", 0, -1], b"", 1),
    (["l", [["b", 0, 8], ["b", 0, 8]]], bytes(8), 2),             # overlapping blobs
    (["b", 0, 4], bytes(4), 2),                                   # blob count mismatch
    (["b", 0, 4], bytes(100), 1),                                 # trailing bytes
    (["z", 1], b"", 0),                                           # unknown tag
    ([], b"", 0),
    ([1, 2], b"", 0),
    (1.5, b"", 0),                                                # bare JSON float
    ({"a": 1}, b"", 0),                                           # JSON object
    (["f", "3FF0000000000000"], b"", 0),
    (["f", "3ff"], b"", 0),
    (["f", 1.0], b"", 0),
    (["i", "12"], b"", 0),
    (["i", "0x"], b"", 0),
    (["i", 5], b"", 0),
    (["l"], b"", 0),
    (["l", [1], 2], b"", 0),
    (["l", 5], b"", 0),
    (["d", [[1]]], b"", 0),
    (["d", [1]], b"", 0),
    (["d", [[["l", []], 1]]], b"", 0),                            # list as a dict key
    (["d", [[["b", 0, 1], 1]]], b"\0", 1),                        # bytes as a dict key
    (["d", [[1, 1], [True, 2]]], b"", 0),                         # duplicate keys
    (["d", [], ["d", []]], b"", 0),                               # only an OrderedDict has _metadata
    (["o", [], 5], b"", 0),                                       # _metadata not a dict
    (["o", [], ["d", []], 1], b"", 0),
    (nest(MAX_DEPTH + 1), b"", 0),                                # nesting too deep
    (nest(MAX_DEPTH + 1, "d"), b"", 0),
    (nest(MAX_DEPTH + 1, "t"), b"", 0),
    (b"[" * 100_000, b"", 0),                                     # deeper than the JSON parser
    (b'["l",[NaN]]', b"", 0),
    (b'"\xff"', b"", 0),                                          # not ASCII
    (b"9" * 5000, b"", 0),                                        # over Python's int digit limit
    (b'["l",[1,', b"", 0),
])
def test_crafted_manifests_are_refused(manifest, data, count):
    corrupt(craft(manifest, data, count))


@pytest.mark.parametrize("blob", [
    craft(1, magic=b"CXLSTATF"), craft(1, version=2), craft(1, flags=1), b"",
    HEADER.pack(MAGIC, 1, 0, 2**64 - 1, 0), HEADER.pack(MAGIC, 1, 0, 33, 0) + b"1",
])
def test_bad_headers_are_refused(blob):
    corrupt(blob)


def test_decode_of_a_non_buffer_is_a_type_error():
    with pytest.raises(TypeError):
        decode(12)


# ---------------------------------------------------------------------------------------------
# What encode refuses
# ---------------------------------------------------------------------------------------------
def test_unsupported_value_names_its_path():
    tree = {"opt": [{"state": {3: {"exp_avg": object()}}}]}
    path = r"state\['opt'\]\[0\]\['state'\]\[3\]\['exp_avg'\]"
    with pytest.raises(TypeError, match=path + r".*builtins\.object"):
        encode(tree)


@pytest.mark.parametrize("value", [
    {1, 2}, 1j, bytearray(b"x"), np.float64(1.0), np.int64(1), np.array([1], np.uint32),
    np.array([1.0], ">f4"), np.array(["a"]), np.array([None]), torch.zeros(2, dtype=torch.complex64),
    torch.zeros(2, dtype=torch.uint32), torch.zeros(2, device="meta"), torch.eye(2).to_sparse(),
    np.ma.masked_array([1.0]), lambda: 0,
])
def test_unsupported_values_are_type_errors(value):
    with pytest.raises(TypeError, match=r"state\['x'\]\[1\]"):
        encode({"x": [0, value]})


@pytest.mark.parametrize("key", [b"k", frozenset(), (1, b"x"), 1j, np.int64(1)], ids=repr)
def test_unsupported_dict_keys_are_type_errors(key):
    with pytest.raises(TypeError, match=r"state\['x'\]: dict key"):
        encode({"x": {key: 1}})


def test_too_deep_or_cyclic_trees_are_value_errors():
    roundtrip(nested_lists(MAX_DEPTH))
    with pytest.raises(ValueError, match="deeper than"):
        encode(nested_lists(MAX_DEPTH + 1))
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="deeper than"):
        encode(cycle)


def test_a_layout_holds_the_same_bytes_as_the_encoding():
    """lay_out's pieces (what the checkpointer copies straight into a dense slot) tile exactly the
    bytes encode returns, padding included, with the blobs as views of the live tensors."""
    from cxltrain.checkpoint.codec import lay_out

    weight = torch.randn(4, 3)
    tree = {"w": weight, "empty": torch.zeros(0), "a": np.arange(5), "b": b"xyz", "rng": (3, tuple(range(700)), None),
            "n": [1, 2.5, -(1 << 70)]}
    encoded = lay_out(tree)
    pieces = list(encoded.pieces())
    assert [offset for offset, _ in pieces] == sorted(offset for offset, _ in pieces)
    assert all(offset + len(raw) <= next_offset for (offset, raw), (next_offset, _) in zip(pieces, pieces[1:]))
    assert b"".join(bytes(raw) for _, raw in pieces) == encode(tree) and encoded.nbytes == len(encode(tree))
    assert_same(decode(b"".join(bytes(raw) for _, raw in pieces)), tree)
    weight.add_(1)  # a blob is a view of the live tensor: copy it before the tensor changes again
    assert torch.equal(decode(b"".join(bytes(raw) for _, raw in encoded.pieces()))["w"], weight)


# ---------------------------------------------------------------------------------------------
# LayoutCache: lay_out again and again, always the bytes encode gives
# ---------------------------------------------------------------------------------------------
def laid_out_bytes(layout) -> bytes:
    return b"".join(raw if isinstance(raw, bytes) else raw.tobytes() for _, raw in layout.pieces())


def assert_cached_is_encode(cache: LayoutCache, tree) -> None:
    assert laid_out_bytes(cache.lay_out(tree)) == encode(tree)


def dense_tree(model, optimizer, batch: int, scheduler=None) -> dict:
    """A tree shaped like DenseState.capture's."""
    return {"batch": batch, "model": model.state_dict(), "optimizers": [optimizer.state_dict()],
            "schedulers": [] if scheduler is None else [scheduler.state_dict()], "rng": capture_rng(),
            "tables": {"emb": "t0"}, "metadata": {"lr": 0.1}, "threads": 2}


def test_layout_cache_reuses_a_training_runs_manifest_and_stays_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    cache = LayoutCache(volatile=("batch",))
    for batch in (0, 1, 2, 9, 10, 11, 99, 100, 12345):  # the counter's digits change the manifest's length
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        torch.rand(1)  # the RNG moves: its state tensor is a fresh copy each capture
        assert_cached_is_encode(cache, dense_tree(model, optimizer, batch))
    assert (cache.misses, cache.hits) == (1, 8)  # only the first is laid out afresh
    with torch.no_grad():  # a parameter given new memory is read from there
        model[0].weight.data = model[0].weight.data.clone() + 1
    assert_cached_is_encode(cache, dense_tree(model, optimizer, 7))
    assert cache.hits == 9


def test_layout_cache_reencodes_volatile_items_and_still_reuses_the_rest():
    """The run's metadata changes every batch (its running metrics: a loss sum, a step count): as a
    volatile item it is encoded afresh while the tensors' manifest is reused; a volatile item that
    comes to hold a tensor is laid out afresh, never misplaced."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    cache = LayoutCache(volatile=("batch", "metadata"))
    loss_sum = 0.0
    for batch in range(6):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        loss_sum += 0.1 * batch + 1 / 3
        tree = dense_tree(model, optimizer, batch)
        tree["metadata"] = {"lr": 0.01, "metrics": {"batch": batch, "loss_sum": loss_sum, "steps": batch + 1}}
        assert_cached_is_encode(cache, tree)
    assert (cache.misses, cache.hits) == (1, 5)
    tree["metadata"] = {"lr": 0.01, "extra": torch.ones(2)}
    assert_cached_is_encode(cache, tree)
    assert_cached_is_encode(cache, tree)
    assert cache.hits == 5


def test_layout_cache_follows_a_scheduler_by_laying_out_afresh():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    cache = LayoutCache(volatile=("batch",))
    for batch in range(5):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        assert_cached_is_encode(cache, dense_tree(model, optimizer, batch, scheduler))
    assert cache.hits == 0  # its counters and the learning rate change every batch


def test_layout_cache_that_keeps_missing_pauses_and_one_that_settles_hits_again():
    """A tree that misses every time (a scheduler stepping every batch) stops paying for the
    comparison: after MISSES_BEFORE_PAUSE misses the cache lays out plainly for PAUSE_CALLS calls,
    then compares once, and one more miss pauses it again. A tree that settles during a pause hits
    at the first comparison after it. Every layout is encode()'s, paused or not."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    cache = LayoutCache(volatile=("batch",))
    first, pause = LayoutCache.MISSES_BEFORE_PAUSE, LayoutCache.PAUSE_CALLS
    calls = first + 3 * (pause + 1)
    for batch in range(calls):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        assert_cached_is_encode(cache, dense_tree(model, optimizer, batch, scheduler))
    assert (cache.hits, cache.compared) == (0, first + 3)
    settled = dense_tree(model, optimizer, calls, scheduler)  # the scheduler stops: the tree keeps its shape
    for batch in range(calls, calls + pause + 1):
        assert_cached_is_encode(cache, {**settled, "batch": batch})
    assert (cache.hits, cache.compared) == (1, first + 4)


BASE = {"batch": 3, "a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "f": 0.5, "i": 1, "flag": True,
        "l": [1, 2], "d": {"x": 1, "y": 2}, "o": OrderedDict(p=torch.ones(2)), "b": b"abc",
        "n": np.arange(3, dtype=np.int64), "t": (torch.zeros(2, dtype=torch.int64), None)}
MUTATIONS = {
    "counter": lambda t: t.update(batch=t["batch"] * 1000 + 7),
    "tensor values": lambda t: t["a"].add_(1),
    "fresh tensor, same shape": lambda t: t.update(a=torch.full((2, 3), 7.0)),
    "tensor shape": lambda t: t.update(a=torch.zeros(3, 2)),
    "tensor dtype": lambda t: t.update(a=t["a"].double()),
    "bfloat16": lambda t: t.update(a=t["a"].bfloat16()),
    "transposed view": lambda t: t.update(a=torch.arange(6, dtype=torch.float32).reshape(3, 2).t()),
    "negated view": lambda t: t.update(a=torch.arange(6, dtype=torch.float32).reshape(2, 3)._neg_view()),
    "int to equal float": lambda t: t.update(i=1.0),
    "bool to equal int": lambda t: t.update(flag=1),
    "negative zero": lambda t: t.update(f=-0.0 if t["f"] == 0.0 else 0.0),
    "float bits": lambda t: t.update(f=math.nextafter(t["f"], 1.0)),
    "list to tuple": lambda t: t.update(l=tuple(t["l"])),
    "dict order": lambda t: t.update(d=dict(reversed(list(t["d"].items())))),
    "ordered to plain dict": lambda t: t.update(o=dict(t["o"])),
    "metadata": lambda t: t.update(o=OrderedDict(t["o"])) or setattr(t["o"], "_metadata", {"": {"version": 2}}),
    "bytes": lambda t: t.update(b=b"abd"),
    "ndarray values": lambda t: t.update(n=t["n"] + 1),
    "reversed ndarray": lambda t: t.update(n=np.arange(3, dtype=np.int64)[::-1]),
    "one tensor twice": lambda t: t.update(t=(t["a"], t["a"])),
    "new key": lambda t: t.update(z=None),
    "counter not an int": lambda t: t.update(batch=2.5),
}


@fast(150)
@given(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=8))
def test_layout_cache_is_encode_after_any_change(changes):
    """Every change a tree can go through between two batches — values, shapes, types that compare
    equal (1 and 1.0, 0.0 and -0.0), order, views, sharing — and the cache still gives encode's bytes."""
    tree = {key: (value.clone() if isinstance(value, torch.Tensor) else value.copy() if hasattr(value, "copy")
                  else value) for key, value in BASE.items()}
    tree["o"] = OrderedDict(p=torch.ones(2))
    cache = LayoutCache(volatile=("batch",))
    assert_cached_is_encode(cache, tree)
    for change in changes:
        tree = dict(tree)
        MUTATIONS[change](tree)
        assert_cached_is_encode(cache, tree)
        assert_cached_is_encode(cache, dict(tree))  # the same again: reused


def test_layout_cache_never_reuses_what_pickle_and_the_encoder_see_differently():
    """An attribute the encoder skips holding a tensor (pickled), and one tensor twice (encoded twice,
    pickled once): the counts agree, the order does not — laid out afresh every time."""
    def tree(batch):
        ordered = OrderedDict(a=1)
        ordered.extra = torch.full((4,), 100.0 + batch)
        shared = torch.full((4,), float(batch))
        return {"batch": batch, "od": ordered, "x": shared, "y": shared}

    cache = LayoutCache(volatile=("batch",))
    for batch in range(3):
        assert_cached_is_encode(cache, tree(batch))
    assert cache.hits == 0
    odd = OrderedDict(a=1)
    odd.extra = torch.zeros(2, dtype=torch.complex64)  # not encodable, and not encoded: no error either
    assert_cached_is_encode(cache, {"batch": 0, "od": odd})
    with pytest.raises(TypeError, match="top-level str keys"):
        LayoutCache(volatile=(1,))


def test_layout_cache_refuses_what_lay_out_refuses():
    cache = LayoutCache(volatile=("batch",))
    with pytest.raises(TypeError, match=r"state\['x'\]: unsupported type .*function"):
        cache.lay_out({"batch": 1, "x": lambda: 0})
    assert_cached_is_encode(cache, [1, 2])  # not a dict: laid out, never cached
