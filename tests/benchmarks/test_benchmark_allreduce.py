"""benchmarks/allreduce.py's data: the ten-layer model in each layout and page backing holds the values it
was built from, and ``--pages huge`` gives every array memory that starts on a 2 MiB boundary."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "allreduce.py")
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


def _sweep():
    spec = importlib.util.spec_from_file_location("benchmark_sweep", os.path.join(os.path.dirname(_PATH), "sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plots_label_sizes_in_kib_and_mib_and_give_each_op_its_colour(tmp_path):
    sweep = _sweep()
    assert [sweep.human_bytes(n) for n in (512, 4096, 65536, 1 << 20, 16 << 20, 3 << 29)] == \
        ["512 B", "4 KiB", "64 KiB", "1 MiB", "16 MiB", "1.5 GiB"]
    ops = {"raw": 1.0, "adasum": 1.5, "sum": 2.0}
    results = [{"bytes": n, "world_size": 2, "results": {
        op: {"median_s": ratio * n * 1e-9, "ratio_to_raw": ratio, "algbw_GBps": 1.0, "busbw_GBps": 1.0,
             "sent_bytes_max_rank": n} for op, ratio in ops.items()}, "repeats": 3} for n in (4096, 1 << 20)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        ax = fig.axes[0]
        drawn[os.path.basename(str(path))] = ({ln.get_label(): ln.get_color() for ln in ax.get_lines()
                                               if not ln.get_label().startswith("_")},
                                              [t.get_text() for t in ax.get_xticklabels()])
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = keep
    try:
        sweep.plot(sweep.rows([{"results": results}]), tmp_path, "test")
    finally:
        plt.Figure.savefig = real_savefig
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busbw.png", "ratio.png", "time.png"]
    colours, ticks = drawn["time.png"]
    assert set(colours) == {"raw, P=2", "adasum, P=2", "sum, P=2"}
    assert len(set(colours.values())) == 3, f"ops share a colour: {colours}"
    assert ticks == ["4 KiB", "1 MiB"]


def test_dtype_axis_times_every_dtype_in_the_same_rounds():
    """``--dtypes``: the same values in each dtype (as many elements as the size holds in float32), each
    dtype's op timed in the same rounds and given its ratio to float32; ``--equal-layers``."""
    from mpi4py import MPI

    assert bench.layer_sizes(16 << 20, equal=8) == [1 << 19] * 8
    assert bench._methods(None, ["adasum"], False, ("float32", "bfloat16", "float16")) == \
        ["raw", "adasum", "adasum-bfloat16", "adasum-float16"]
    with pytest.raises(SystemExit, match="bfloat16 needs --kind torch"):
        bench._as(np.ones(3, np.float32), "numpy", "bfloat16")
    res = bench.run(MPI.COMM_SELF, 64 << 10, ["adasum"], 3, 0, False, "separate", "default", "torch",
                    ("float32", "bfloat16", "float16"), 8)
    assert res["dtypes"] == ["float32", "bfloat16", "float16"] and res["layers"] == 8
    for name in ("adasum-bfloat16", "adasum-float16"):
        assert res["results"][name]["ratio_to_float32"] > 0
    assert "ratio_to_float32" not in res["results"]["adasum"]
