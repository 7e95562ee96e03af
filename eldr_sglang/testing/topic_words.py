"""Two word topics of the tiny model's tokenizer and a calibration artifact whose
predictor knows them: a text prompt of topic k has predicted region k. Used by the
integration tests and benchmark of :mod:`eldr_sglang.integrations`."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from eldr_sglang.core import CalibrationArtifact, ModelSpec
from eldr_sglang.core.predictor import SignaturePredictor
from eldr_sglang.prompts import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = str(ROOT / "models" / "eldr-tiny-moe")
E = 8
TOPIC_WORDS = [
    "apple banana cherry grape lemon mango orange peach pear plum melon berry".split(),
    "python java rust golang kotlin swift compiler kernel socket thread buffer pointer".split(),
]


@functools.lru_cache(maxsize=1)
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


def topic_prompt(k: int, seed: int = 0, n: int = 12) -> str:
    rng = np.random.default_rng(1000 * k + seed)
    return " ".join(rng.choice(TOPIC_WORDS[k], n))


@functools.lru_cache(maxsize=1)
def topic_artifact(tau: float = 0.1) -> CalibrationArtifact:
    """Two regions: the tokens of topic k's words route to experts 2k, 2k+1 (both layers);
    tokens shared by both topics route to expert 7."""
    tok = tokenizer()
    owner: dict[int, set[int]] = {}
    for k, words in enumerate(TOPIC_WORDS):
        for w in words:
            for t in tok.encode(" " + w):
                owner.setdefault(t, set()).add(k)

    def counts(ids):
        c = np.zeros((2, E))
        for t in ids:
            ks = owner.get(t, set())
            if len(ks) == 1:
                k = next(iter(ks))
                c[:, 2 * k:2 * k + 2] += 1.0
            else:
                c[:, 7] += 1.0
        return c

    rng = np.random.default_rng(3)
    prompts, y = [], []
    for i in range(200):
        k = int(rng.integers(2))
        ids = tok.encode(topic_prompt(k, seed=10_000 + i))
        prompts.append(ids)
        y.append(counts(ids))
    pred = SignaturePredictor(alpha=1e-3).fit(prompts, np.stack(y))
    cents = np.stack([sum(counts(tok.encode(topic_prompt(k, seed=s))) for s in range(20)).ravel()
                      for k in range(2)]).astype(np.float32)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    return CalibrationArtifact(model=ModelSpec("toy-moe", 4, E, 2), variant="idf", layers=[0, 1],
                               idf=np.ones((2, E), np.float32), centroids=cents, tau=tau, predictor=pred)
