"""benchmarks/kernels.py: every dtype, pass and coefficient pair timed under each instruction set the CPU has,
on the operands it says it uses."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from adasum.rule.sixteen import widen

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "kernels.py")
_spec = importlib.util.spec_from_file_location("benchmark_kernels", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytest.importorskip("adasum.kernels._kernels")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_operands_are_normal_values_rounded_to_the_dtype(dtype):
    a, b = bench.operands(dtype, 1000, seed=3)
    rng = np.random.default_rng(3)
    want_a = rng.standard_normal(1000)
    values = a.astype(np.float64) if dtype == "float32" else widen(a)
    step = 2.0 ** -23 if dtype == "float32" else (2.0 ** -10 if dtype == "float16" else 2.0 ** -7)
    assert np.all(np.abs(values - want_a) <= np.abs(want_a) * step + 2.0 ** -24)  # float16 subnormals: 2^-24 apart
    assert a.dtype == {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype] and b.shape == (1000,)


def test_every_cell_is_measured(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench.main(["--elements", "4099", "--repeats", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    isas = [run["isa"] for run in data["runs"]]
    assert "portable" in isas and len(isas) == len(set(isas))
    for run in data["runs"]:
        assert set(run["dtypes"]) == {"float32", "bfloat16", "float16"}
        for row in run["dtypes"].values():
            assert set(row) == {"dots", "combine/adasum", "combine/mean", "combine/short"}
            assert all(np.isfinite(v) and v > 0 for v in row.values())
    printed = capsys.readouterr().out
    assert printed.count("bfloat16") == len(isas)


def test_refuses_an_unknown_dtype():
    with pytest.raises(SystemExit):
        bench.main(["--dtypes", "float8"])
