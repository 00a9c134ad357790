"""The segmented device path: all layer pieces of a level in two Triton kernels, for torch and cupy alike.

The per-layer device path (:class:`adasum.adapters.TorchAdapter`, :class:`adasum.adapters.CupyAdapter`) runs a
few torch or cupy kernels per layer piece and block. Here a level's pieces are cut into a *tile table*
(:func:`tile_table`): rows ``(start, end, piece)`` of at most :data:`TILE` elements, never crossing a piece's
bounds, made once per plan and level and kept with the adapter (its context). Then:

- the partial dot products are one kernel (:func:`adasum.kernels._triton.tile_dots`) that reduces every tile to
  ``[a·b, a·a, b·b]`` in float64, reading the data in its own dtype (no float64 copy), one copy of the
  (tiles × 3) partials to the host, which adds each piece's tiles in order (``np.add.reduceat``): the
  stream is synchronised once, by that copy;
- the combine ``dst ← ca[piece]·a + cb[piece]·b`` is one kernel (:func:`adasum.kernels._triton.tile_combine`) that
  reads each tile's coefficients through its piece index, after one small copy of the coefficients to the
  device.

Operands are torch tensors; cupy arrays arrive as zero-copy torch views (DLPack). Results are
deterministic: a tile's sums and the order in which tiles are added depend on the tile table only, which
depends on the pieces only. The setting ``device_kernels`` chooses between this path and the per-layer one.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

__all__ = ["BLOCK", "TILE", "SegmentedKernels", "available", "tile_table", "wanted"]

# Elements one kernel program reads per step, and the most one tile holds (one program per tile).
BLOCK = 1 << 10
TILE = 1 << 14
# Tile tables kept per SegmentedKernels: one per plan, level and device a training loop comes back to.
KEPT_TABLES = 256


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether torch and triton import (the segmented path needs both)."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(setting: str, on_cuda: bool) -> bool:
    """Whether operands take the segmented path under the setting ``device_kernels``: ``"auto"`` on a
    CUDA device where triton imports, ``"triton"`` always (CPU tensors need ``TRITON_INTERPRET=1``),
    ``"per-layer"`` never."""
    if setting == "per-layer":
        return False
    if setting == "triton":
        if not available():
            raise ImportError("the setting device_kernels='triton' needs torch and triton to be installed")
        return True
    return on_cuda and available()


def tile_table(pieces, tile: int = TILE) -> tuple[np.ndarray, np.ndarray]:
    """The tiles of ``pieces`` (``(start, end)`` pairs): an int64 (tiles, 3) array of ``(start, end,
    piece)`` rows, each at most ``tile`` elements inside one piece, and the index of each piece's first tile.
    Every piece has at least one tile (an empty piece one empty tile), so each piece's partials are the sum
    of its tiles' rows ``first[i]`` up to ``first[i + 1]``."""
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
    counts = np.maximum(1, -(-(p[:, 1] - p[:, 0]) // tile))
    first = np.cumsum(counts) - counts
    piece = np.repeat(np.arange(len(p), dtype=np.int64), counts)
    start = p[piece, 0] + (np.arange(int(counts.sum()), dtype=np.int64) - first[piece]) * tile
    end = np.minimum(start + tile, p[piece, 1])
    return np.ascontiguousarray(np.stack([start, end, piece], axis=1)), first


class SegmentedKernels:
    """The segmented kernels on torch tensors, with what they keep between calls: the tile tables of the
    pieces lists they were given (on the device), and per device the partials and coefficient buffers.

    The pieces lists of a plan are kept with it and come back as the same objects every call
    (:func:`adasum.schedules.fusion.group_pieces`), so tables are found by the list's identity; an entry holds its
    list, so an identity cannot be reused while its table is kept.
    """

    def __init__(self, torch):
        self.torch = torch
        self._tables: collections.OrderedDict = collections.OrderedDict()
        self._scratch: dict = {}

    def clear(self) -> None:
        self._tables.clear()
        self._scratch.clear()

    def kept_tables(self) -> int:
        return len(self._tables)

    def _table(self, pieces, device):
        key = (id(pieces), str(device))
        entry = self._tables.get(key)
        if entry is not None and entry[0] is pieces:
            self._tables.move_to_end(key)
            return entry[1], entry[2]
        tiles, first = tile_table(pieces)
        on_device = self.torch.from_numpy(tiles.reshape(-1)).to(device)
        if len(self._tables) >= KEPT_TABLES:
            self._tables.popitem(last=False)
        self._tables[key] = (pieces, on_device, first)
        return on_device, first

    def _buffer(self, name: str, device, n: int):
        key = (name, str(device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            self._scratch.pop(key, None)  # free the smaller buffer before making the larger one
            buf = self._scratch[key] = self.torch.empty(max(n, 256), dtype=self.torch.float64, device=device)
        return buf[:n]

    def dots(self, a, b, pieces) -> np.ndarray:
        """``[a·b, a·a, b·b]`` per piece of the flat tensors ``a``, ``b``, as a host float64 (n, 3) array."""
        from . import _triton

        if not len(pieces):
            return np.zeros((0, 3))
        tiles, first = self._table(pieces, a.device)
        n = len(tiles) // 3
        out = self._buffer("partials", a.device, 3 * n)
        _triton.tile_dots[(n,)](a, b, tiles, out, BLOCK=BLOCK, STEPS=TILE // BLOCK)
        host = out.cpu().numpy().reshape(n, 3)  # the one copy to the host (and wait) of this level
        return np.add.reduceat(host, first, axis=0)

    def combine(self, a, b, dst, pieces, ca: np.ndarray, cb: np.ndarray) -> None:
        """``dst[s:e] ← ca[i]·a[s:e] + cb[i]·b[s:e]`` per piece ``(s, e)``; ``dst`` may be ``a`` or ``b``."""
        from . import _triton

        if not len(pieces):
            return
        torch = self.torch
        tiles, _ = self._table(pieces, a.device)
        coef = np.empty((len(pieces), 2))
        coef[:, 0] = ca
        coef[:, 1] = cb
        on_device = self._buffer("coefficients", a.device, coef.size)
        on_device.copy_(torch.from_numpy(coef.reshape(-1)), non_blocking=True)
        wide = a.dtype in (torch.float32, torch.float64)
        _triton.tile_combine[(len(tiles) // 3,)](a, b, dst, tiles, on_device, BLOCK=BLOCK, STEPS=TILE // BLOCK,
                                                   WIDE=wide)
