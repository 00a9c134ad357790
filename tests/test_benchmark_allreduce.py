"""benchmarks/allreduce.py's data: the ten-layer model in each layout and page backing holds the values it
was built from, and ``--pages huge`` gives every array memory that starts on a 2 MiB boundary."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "allreduce.py")
_spec = importlib.util.spec_from_file_location("benchmark_allreduce", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("pages", ["default", "small", "huge"])
@pytest.mark.parametrize("layout", ["separate", "views"])
def test_model_holds_its_layers_in_every_backing(layout, pages):
    nbytes = 3 << 20
    layers, flat, work, refill = bench.model(1, nbytes, layout, pages)
    assert sum(x.nbytes for x in layers) == nbytes and len(layers) == 10
    refill()
    for w, x in zip(work, layers):
        assert w.dtype == np.float32 and w.tobytes() == x.tobytes()
        assert w.flags.writeable and w.flags.c_contiguous
    assert flat.nbytes == nbytes and np.all(flat == 0.5)
    if pages == "huge":
        arrays = [flat, work[0]] if layout == "views" else [flat, *work]
        assert all(a.ctypes.data % bench.HUGE_PAGE == 0 for a in arrays)
    if layout == "views":
        base = work[0].ctypes.data
        assert [w.ctypes.data - base for w in work] == list(np.cumsum([0] + [x.nbytes for x in layers])[:-1])


def test_huge_page_arrays_stay_valid_after_their_builder_returns():
    values = np.arange(1 << 19, dtype=np.float32)
    a = bench._array(values, "huge")
    b = bench._array(values[::-1].copy(), "huge")  # a second mapping must not disturb the first
    assert a.ctypes.data % bench.HUGE_PAGE == 0 and np.array_equal(a, values)
    assert np.array_equal(b, values[::-1])
