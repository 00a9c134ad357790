"""The layer table: which layers a segment of a fused buffer overlaps."""

import numpy as np

from adasum.schedules.fusion import pieces


def test_pieces_straddling_and_empty_layers():
    bounds = np.array([0, 3, 3, 10, 11, 20])
    layers, spans = pieces(bounds, 2, 12)
    assert layers == [0, 2, 3, 4]
    assert spans == [(0, 1), (1, 8), (8, 9), (9, 10)]


def test_pieces_cover_segment_exactly():
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 9, size=30)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for lo in range(0, int(bounds[-1])):
        for hi in range(lo, int(bounds[-1]) + 1, 7):
            layers, spans = pieces(bounds, lo, hi)
            covered = sum(e - s for s, e in spans)
            assert covered == hi - lo
            assert all(sizes[i] > 0 for i in layers)


def test_pieces_of_empty_segment():
    assert pieces(np.array([0, 5]), 3, 3) == ([], [])
