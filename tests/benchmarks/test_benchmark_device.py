"""benchmarks/device.py on the cupy stand-in: the by-hand round trip is timed beside host and staged, for
every op, and the staged call's results are the host call's."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import adasum

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")

pytestmark = pytest.mark.mpi(min_size=1)


def _device():
    sys.path.insert(0, _BENCH)  # device.py imports allreduce.py from its folder
    spec = importlib.util.spec_from_file_location("benchmark_device", os.path.join(_BENCH, "device.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.world_size(1, 2)  # the harness; the staged call's results at every size: tests/core/test_gpu.py
def test_round_trip_is_timed_beside_host_and_staged_for_every_op(comm, capsys):
    device = _device()
    old = adasum.configure()
    try:
        assert device.main(["--kind", "cupy-standin", "--sizes", "16KiB", "--repeats", "3", "--warmup", "1"]) == 0
    finally:
        adasum.configure(old)
    if comm.Get_rank() != 0:
        return
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    for column in ("raw", "host", "staged", "roundtrip", "staged/host", "roundtrip/host"):
        assert column in head
    rows = [line.split() for line in lines[1:]]
    assert [r[2] for r in rows] == ["adasum", "sum", "mean"]
    for r in rows:  # P, bytes, op, four times, staged/host, roundtrip/host, host/raw: positive numbers
        assert len(r) == 10 and all(float(x) > 0 for x in r[3:])
