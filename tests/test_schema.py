"""The index schema checker's two walks agree: ``ok`` never passes what ``check`` refuses.

Indexes of untrusted files are checked with a fast walk (``ok``) and, only where it
refuses, a second walk that names the bad field. A value the fast walk let through that
the naming walk would refuse is a hole in the check.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm_codec.checkpoint import exact_index, lossy_index, schema
from comm_codec.checkpoint.errors import CheckpointError
from comm_codec.checkpoint.schema import Anything, Int, ListOf, MapOf, Nullable, Num, OneOf, Record, Row, Str

pytestmark = pytest.mark.unit

_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.sampled_from(["frame", "stored", "a", "bb", 1, 2, 0, -1, True, 1.0]),
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "b", "c", "n"]), inner, max_size=4)
    ),
    max_leaves=12,
)

_SPECS = [
    Int(),
    Int(-1, 5),
    Num(),
    Num(finite=False),
    Num(lo=0.0),
    Str(),
    Str(2),
    Str(length=2),
    OneOf("frame", "stored"),
    OneOf(1, 2),
    OneOf(True),
    ListOf(Int(), 3),
    ListOf(Str()),
    Row(Int(), Str()),
    Row(Nullable(Int(0, 9)), OneOf("a", "bb")),
    MapOf(Str(1), Int()),
    Anything(dict),
    Anything(list),
    Record({"a": Int(), "b": Nullable(Str())}, optional=("b",)),
    Record({"a": ListOf(Row(Int(), Num())), "n": Record({"c": OneOf(1)})}, optional=("n",)),
    exact_index._INDEX,
    lossy_index._INDEX,
]


def _passes(spec, value) -> bool:
    try:
        schema.check(value, spec, "f")
    except CheckpointError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(value=_JSON, k=st.integers(0, len(_SPECS) - 1))
@pytest.mark.slow
def test_the_fast_walk_passes_nothing_the_naming_walk_refuses(value, k):
    spec = _SPECS[k]
    if spec.ok(value):
        spec.check(value, "index")  # must not raise


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (Int(0, 3), 3, True),
        (Int(0, 3), 3, 4),
        (Num(), 1.5, math.inf),
        (Num(), 2, "2"),
        (Str(length=2), "ab", "a"),
        (OneOf(1, 2), 2, 2.0),
        (OneOf("a"), "a", ["a"]),
        (ListOf(Int(), 2), [1, 2], [1, 2, 3]),
        (Row(Int(), Str()), [1, "x"], [1, "x", 2]),
        (Row(Int(), Str()), [1, "x"], ["x", 1]),
        (MapOf(Str(1), Int()), {"a": 1}, {"ab": 1}),
        (Nullable(Int()), None, -1),
        (Record({"a": Int()}, optional=("b",)), {"a": 1, "z": "ignored"}, {"b": 1}),
    ],
)
def test_good_values_take_the_fast_walk_and_bad_ones_are_named(spec, good, bad):
    assert spec.ok(good) and _passes(spec, good)
    assert not spec.ok(bad)
    with pytest.raises(CheckpointError, match="^f: index"):
        schema.check(bad, spec, "f")


def test_a_real_index_takes_the_fast_walk(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    import comm_codec.checkpoint as ck

    src, dst = tmp_path / "w.safetensors", tmp_path / "w.cc"
    save_file({"w": np.random.default_rng(0).standard_normal(20_000).astype(np.float32)}, str(src))
    ck.compress_file(src, dst, threads=1, progress=False)
    index = ck.read_index(dst)
    assert exact_index._INDEX.ok(index)
