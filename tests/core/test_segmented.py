"""The segmented device kernels (adasum.kernels.segmented): tile tables, and the Triton dot products and combine
against float64 numpy references over many layouts and dtypes.

They run on a CUDA device where one exists, else on CPU tensors under triton's interpreter
(``TRITON_INTERPRET=1``, set here before triton is first imported); without triton they are skipped, and
the tile tables (numpy) are checked all the same.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the kernels work on torch tensors

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Each kernel test skips without triton, not the module: a module skipped on import is reported by every
# run that collects it, whatever -k or -m selects.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

from adasum.kernels.segmented import TILE, SegmentedKernels, tile_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float16", "bfloat16", "float32", "float64"]
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def _layouts():
    """(buffer length, pieces): tiny and empty pieces, pieces ending on and next to tile edges, gaps."""
    t = TILE
    yield "one", 5, [(0, 5)]
    yield "tiny and empty", 40, [(0, 1), (1, 1), (1, 4), (4, 4), (4, 37), (37, 40)]
    yield "tile edges", 3 * t + 2, [(0, t), (t, 2 * t + 1), (2 * t + 1, 3 * t + 1), (3 * t + 1, 3 * t + 2)]
    yield "one element short of a tile", 2 * t, [(0, t - 1), (t - 1, 2 * t)]
    yield "gaps", 2 * t + 300, [(3, 10), (100, t + 50), (t + 60, t + 61), (2 * t, 2 * t + 299)]
    rng = np.random.default_rng(7)
    cuts = np.sort(rng.choice(np.arange(1, 30000), size=60, replace=False))
    edges = [0, *cuts.tolist(), 30000]
    yield "many", 30000, list(zip(edges[:-1], edges[1:]))


LAYOUTS = list(_layouts())


def _data(n, dtype, seed):
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.standard_normal(n) * 3).to(getattr(torch, dtype)).to(DEVICE)
    b = torch.from_numpy(rng.standard_normal(n)).to(getattr(torch, dtype)).to(DEVICE)
    return a, b


def _f64(t) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


@pytest.mark.parametrize("name,n,pieces", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_tile_table_covers_each_piece_in_order(name, n, pieces):
    tiles, first = tile_table(pieces)
    assert tiles.dtype == np.int64 and tiles.shape[1] == 3
    assert len(first) == len(pieces)
    bounds = [*first.tolist(), len(tiles)]
    for i, (s, e) in enumerate(pieces):
        mine = tiles[bounds[i]:bounds[i + 1]]
        assert len(mine) >= 1 and (mine[:, 2] == i).all()
        assert (mine[:, 1] - mine[:, 0] <= TILE).all() and (mine[:, 1] >= mine[:, 0]).all()
        # back to back from s to e
        assert mine[0, 0] == s and mine[-1, 1] == e and (mine[1:, 0] == mine[:-1, 1]).all()
        assert len(mine) == max(1, -(-(e - s) // TILE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,n,pieces", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@needs_triton
def test_dot_products_match_float64_reference(name, n, pieces, dtype):
    a, b = _data(n, dtype, 1)
    got = SegmentedKernels(torch).dots(a, b, pieces)
    x, y = _f64(a), _f64(b)
    want = np.array([[x[s:e] @ y[s:e], x[s:e] @ x[s:e], y[s:e] @ y[s:e]] for s, e in pieces]).reshape(-1, 3)
    # the products are exact in float64; only the order of the additions differs
    scale = np.array([[np.abs(x[s:e]) @ np.abs(y[s:e]), x[s:e] @ x[s:e], y[s:e] @ y[s:e]]
                      for s, e in pieces]).reshape(-1, 3)
    assert got.shape == (len(pieces), 3)
    assert (np.abs(got - want) <= 1e-13 * scale + 1e-300).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,n,pieces", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("into", ["a", "b", "other"])
@needs_triton
def test_combine_matches_float64_reference(name, n, pieces, dtype, into):
    a, b = _data(n, dtype, 2)
    x, y = _f64(a), _f64(b)
    rng = np.random.default_rng(3)
    ca, cb = rng.uniform(-2, 2, len(pieces)), rng.uniform(-2, 2, len(pieces))
    dst = {"a": a, "b": b, "other": torch.full_like(a, 7.0)}[into]
    before = _f64(dst)
    SegmentedKernels(torch).combine(a, b, dst, pieces, ca, cb)
    got = _f64(dst)
    covered = np.zeros(n, dtype=bool)
    for (s, e), p, q in zip(pieces, ca, cb):
        covered[s:e] = True
        exact = p * x[s:e] + q * y[s:e]
        # computed in float64 (float32 for 16-bit data) and rounded once to the dtype
        bound = (2 * EPS[dtype] if dtype in ("float16", "bfloat16") else EPS[dtype]) * np.abs(exact) \
            + 4 * 2.0 ** -23 * (np.abs(p * x[s:e]) + np.abs(q * y[s:e])) * (dtype in ("float16", "bfloat16"))
        assert (np.abs(got[s:e] - exact) <= bound + 1e-300).all(), (s, e)
    np.testing.assert_array_equal(got[~covered], before[~covered])  # outside the pieces nothing changes


@needs_triton
def test_tables_are_kept_per_pieces_list_and_bounded():
    kernels = SegmentedKernels(torch)
    a, b = _data(100, "float32", 4)
    pieces = [(0, 60), (60, 100)]
    first = kernels.dots(a, b, pieces)
    assert kernels.kept_tables() == 1
    for _ in range(3):
        np.testing.assert_array_equal(kernels.dots(a, b, pieces), first)  # deterministic
        kernels.combine(a, b, a, pieces, np.ones(2), np.zeros(2))
    assert kernels.kept_tables() == 1, "the same pieces list must reuse its tile table"
    kernels.dots(a, b, [(0, 100)])
    assert kernels.kept_tables() == 2
    kernels.clear()
    assert kernels.kept_tables() == 0
