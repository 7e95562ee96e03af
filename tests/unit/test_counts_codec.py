"""Packed counts on the wire: exact round trip, clear errors, accepted by the router."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from eldr_sglang.core.counts_codec import pack_counts, unpack_counts
from eldr_sglang.router.signals.signatures import parse_message


@pytest.mark.parametrize("high, dtype", [(255, "uint8"), (60_000, "uint16"), (70_000, "uint32")])
def test_round_trip_is_exact_and_picks_the_narrowest_dtype(high, dtype):
    counts = np.random.default_rng(0).integers(0, high, (24, 256))
    counts[3, 7] = high  # the largest value decides the dtype
    packed = orjson.loads(orjson.dumps(pack_counts(counts)))  # through JSON, as sent
    assert packed["dtype"] == dtype and packed["shape"] == [24, 256]
    back = unpack_counts(packed)
    assert back.shape == counts.shape and (back.astype(np.int64) == counts).all()


def test_pack_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="non-negative"):
        pack_counts([[1, -1]])
    with pytest.raises(ValueError, match="2-D"):
        pack_counts([1, 2, 3])
    with pytest.raises(ValueError, match="2\\*\\*32"):
        pack_counts([[2**33]])


def good() -> dict:
    return pack_counts(np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("change, field", [
    ({"dtype": "float64"}, "counts.dtype"),
    ({"shape": [2]}, "counts.shape"),
    ({"shape": [2, -3]}, "counts.shape"),
    ({"shape": [3, 3]}, "counts.data holds"),
    ({"data": "not base64!"}, "base64"),
    ({"data": 12}, "counts.data"),
])
def test_unpack_names_the_bad_field(change, field):
    with pytest.raises(ValueError, match=field):
        unpack_counts({**good(), **change})


def test_router_accepts_packed_and_list_counts_alike():
    rows = [[0, 1, 2], [3, 4, 5]]
    packed = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": good()})
    listed = parse_message({"bootstrap_room": 2, "layers": [0, 1], "counts": rows})
    assert (packed["counts"] == listed["counts"]).all()
    with pytest.raises(ValueError, match="len\\(layers\\)=3"):
        parse_message({"bootstrap_room": 3, "layers": [0, 1, 2], "counts": good()})
    with pytest.raises(ValueError, match="packed counts"):
        parse_message({"bootstrap_room": 4, "layers": [0], "counts": "AAAA"})
    raw = base64.b64decode(good()["data"])
    assert len(raw) == 6 and good()["dtype"] == "uint8"
    wide = pack_counts([[256, 0, 1]])
    assert wide["dtype"] == "uint16" and base64.b64decode(wide["data"]) == bytes([0, 1, 0, 0, 1, 0])
