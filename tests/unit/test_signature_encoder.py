"""The router's signature encoder equals the core's signature for every count variant."""

import numpy as np
import pytest

from eldr_sglang.core.artifact import CalibrationArtifact
from eldr_sglang.core.counts_codec import pack_counts, unpack_counts
from eldr_sglang.core.traces import ModelSpec
from eldr_sglang.router.signals.signatures import SignatureEncoder, SignatureError, parse_message


@pytest.mark.parametrize("variant", ["idf", "raw", "sqrt", "binary"])
@pytest.mark.parametrize("top", [200, 60_000, 100_000])  # uint8, uint16, uint32 on the wire
def test_fast_encode_matches_the_core_signature(variant, top):
    rng = np.random.default_rng(0)
    layers, experts = [1, 4, 7], 64
    idf = rng.uniform(0.1, 3.0, (len(layers), experts)).astype(np.float32)
    centroids = rng.random((5, len(layers) * experts)).astype(np.float32)
    art = CalibrationArtifact(model=ModelSpec("m", 8, experts, 8), variant=variant, layers=layers,
                              idf=idf, centroids=centroids, tau=0.0)
    enc = SignatureEncoder(art)
    assert enc.tau == 0.0  # an artifact's tau 0 is kept
    counts = rng.integers(0, top, (len(layers), experts))
    counts[0, :5] = 0
    msg = parse_message({"bootstrap_room": 1, "layers": layers, "counts": pack_counts(counts)})
    assert unpack_counts(pack_counts(counts)).dtype.itemsize == (1 if top < 256 else 2 if top < 65536 else 4)
    got = enc.encode(msg)
    want = art.signature(counts)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    with pytest.raises(SignatureError, match="counts shape"):
        enc.encode(parse_message({"bootstrap_room": 2, "layers": layers,
                                  "counts": pack_counts(counts[:, :10])}))
    with pytest.raises(SignatureError) as e:
        enc.encode(parse_message({"bootstrap_room": 3, "layers": layers,
                                  "counts": pack_counts(np.zeros_like(counts))}))
    assert e.value.reason == "empty_signature"
