"""The random-weight GGUF maker's weights (benchmarks/gguf_models.py) look like a trained model's to the kernels.

A file whose weights lean one way makes every gate of a layer positive, and its activations blow up or sink into
the subnormal range: speed measured on it is no user's (a Q4_K_M-like file once decoded at a tenth of its speed
for that). Each format's blocks, dequantized by gguf-py, must have a mean near 0 and a spread near 0.02.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from benchmarks.gguf_models import SCALES, Q, random_tensor


@pytest.mark.parametrize("qtype", sorted(SCALES, key=lambda q: q.name), ids=lambda q: q.name)
def test_random_blocks_are_centred_with_a_trained_models_spread(qtype: Q) -> None:
    blocks = random_tensor((64, 2048), qtype, np.random.default_rng(0))
    weights = dequantize(blocks, qtype)
    assert weights.shape == (64, 2048)
    assert abs(float(weights.mean())) < 0.15 * float(weights.std())  # Q4_0's q - 8 leans by half a step
    assert 0.01 < float(weights.std()) < 0.04


def test_norms_are_ones() -> None:
    assert (random_tensor((2048,), Q.F32, np.random.default_rng(0)) == 1).all()
