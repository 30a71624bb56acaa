"""The codec fuzzed (issue 30): whatever bytes reach a stream, decode_group returns a group or
raises CodecError (which sends the entry to the dead letters with its reason), never another
exception that would stop the learner's loop. The inputs are a valid group's message with its
bytes flipped, cut or extended, and with any field of its map replaced by any msgpack value,
so that most of them get past msgpack and reach the checks behind it."""

from __future__ import annotations

import msgpack
import pytest

from common.messages import CodecError, decode_group, encode_group
from tests.unit.test_messages import make_group

hypothesis = pytest.importorskip("hypothesis", reason="the test extra is not installed (pip install -e .[test])")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VALID = encode_group(make_group())
OBJ = msgpack.unpackb(VALID, raw=False)
# Every path to a value in the message's map: ("samples", "lengths"), ("sampling", "temperature"), ...
PATHS = [(key,) for key in OBJ] + [(key, sub) for key, value in OBJ.items() if isinstance(value, dict) for sub in value]

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=20)

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decodes_or_says_why(data: bytes) -> None:
    try:
        group = decode_group(data)
    except CodecError as exc:
        assert exc.reason in {"undecodable", "oversize", "kind", "schema_version", "invalid"} and str(exc)
    else:
        assert group.samples


@FUZZ
@given(st.data())
def test_bytes_flipped_cut_or_added(data):
    blob = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    tail = data.draw(st.binary(max_size=16))
    _decodes_or_says_why(bytes(blob[:cut]) + tail if data.draw(st.booleans()) else bytes(blob))


@FUZZ
@given(st.sampled_from(PATHS), values, st.booleans())
def test_any_field_replaced_or_removed(path, value, remove):
    obj = msgpack.unpackb(VALID, raw=False)
    parent = obj if len(path) == 1 else obj[path[0]]
    if remove:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    _decodes_or_says_why(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(st.sampled_from([p for p in PATHS if p[0] == "samples" and len(p) == 2]), st.data())
def test_one_item_of_a_column_replaced(path, data):
    """A per-sample list with one item of another type or value, the rest valid."""
    obj = msgpack.unpackb(VALID, raw=False)
    column = obj[path[0]][path[1]]
    if isinstance(column, list) and column:
        column[data.draw(st.integers(0, len(column) - 1))] = data.draw(values)
    _decodes_or_says_why(msgpack.packb(obj, use_bin_type=True))
