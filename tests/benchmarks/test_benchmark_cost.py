"""benchmarks/cost.py on a tiny grid: each row's counts say where a call's time goes, and they are what the
call path makes (the agreement, one collective per direct tensor and one per packed dtype, the copies)."""

from __future__ import annotations

import importlib.util
import os

import pytest

import adasum
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("benchmark_cost", os.path.join(_ROOT, "benchmarks", "cost.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.world_size(1, 2)  # one process, and the counts of a call between ranks (the same at any size)
def test_rows_show_collectives_copies_and_python_calls(comm, capsys):
    rows = bench.main(["--sizes", "16KiB,1MiB", "--repeats", "3", "--warmup", "1", "--kinds", "numpy,torch"])
    assert {(r["kind"], r["bytes"], r["op"]) for r in rows} == {
        (k, n, op) for k in ("numpy", "torch") for n in (16 << 10, 1 << 20) for op in ("sum", "mean", "adasum")}
    for r in rows:
        assert r["x raw"] > 0 and r["x numpy"] > 0 and r["py calls"] > 0 and r["c calls"] > 0
        if r["kind"] == "numpy":
            assert r["x numpy"] == 1.0  # numpy against itself
    if comm.Get_rank() == 0:
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].split()[:5] == ["P", "kind", "bytes", "op", "x"] and len(printed) == 1 + len(rows)
    if comm.Get_size() == 1:
        return
    by = {(r["kind"], r["bytes"], r["op"]): r for r in rows}
    layer_bytes = 4 * bench.np.array(bench.layer_sizes(1 << 20))  # the model's float32 layers
    limit = adasum.current_settings().plain_direct_bytes
    for kind in ("numpy", "torch"):
        small = by[(kind, 16 << 10, "sum")]
        assert small["coll"] == 2 and small["copied"] == pytest.approx(2.0)  # agreement + one packed message
        big = by[(kind, 1 << 20, "sum")]
        direct = layer_bytes >= limit
        assert big["coll"] == 1 + int(direct.sum()) + 1
        assert big["copied"] == 2 * layer_bytes[~direct].sum() / (1 << 20)
    for key, r in by.items():  # torch tensors take the path numpy arrays take
        other = by[("numpy",) + key[1:]]
        assert (r["coll"], r["msgs"], r["copied"]) == (other["coll"], other["msgs"], other["copied"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2)
def test_the_direct_threshold_can_be_set(comm):
    """--plain-direct-bytes: with a threshold above every layer, a 1 MiB sum is one packed message (the
    compiled small plain call, where it runs), and the setting is the library's again afterwards."""
    before = adasum.current_settings().plain_direct_bytes
    rows = bench.main(["--sizes", "1MiB", "--repeats", "2", "--warmup", "1", "--kinds", "numpy", "--ops", "sum",
                       "--plain-direct-bytes", "2MiB"])
    assert adasum.current_settings().plain_direct_bytes == before
    assert rows[0]["coll"] == 2 and rows[0]["copied"] == pytest.approx(2.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2, 3)  # a power of two and one that folds a pair out first
@pytest.mark.parametrize("layout", ["separate", "views"])
def test_steps_of_a_halving_call_add_up_and_leave_the_schedule_as_it_was(comm, layout):
    """--steps: the halving schedule's steps of one Adasum call, each positive on rank 0, together no
    longer than the call (the rest is what they leave); below the halving threshold it says the call took another schedule; the functions it
    timed are the module's own again afterwards."""
    from adasum.runtime.transport import Transport
    from adasum.schedules import halving

    before = (halving._combine, halving._layer_partials, halving._allgather, Transport.exchange)
    old = adasum.configure(small_message_bytes=64 << 10)
    try:
        rows = bench.main(["--sizes", "16KiB,1MiB", "--repeats", "3", "--warmup", "1", "--kinds", "numpy,torch",
                           "--ops", "adasum", "--steps", "--layout", layout])
    finally:
        adasum.configure(old)
    assert (halving._combine, halving._layer_partials, halving._allgather, Transport.exchange) == before
    steps = {(r["kind"], r["bytes"]): r["steps_ms"] for r in rows if "steps_ms" in r}
    assert set(steps) == {(k, n) for k in ("numpy", "torch") for n in (16 << 10, 1 << 20)}
    for kind in ("numpy", "torch"):
        assert steps[(kind, 16 << 10)] == {}  # the doubling schedule of a small call
        big = steps[(kind, 1 << 20)]
        assert set(big) == set(bench.STEPS)
        assert big["total"] > 0
        if comm.Get_rank() == 0:  # what the benchmark prints; a rank folded out of the tree does none of them
            assert all(big[k] > 0 for k in ("reduce exchanges", "dot products", "combine", "allgather"))
        assert big["rest"] >= -1e-6  # the timed steps do not overlap: together no longer than the call
        assert sum(v for k, v in big.items() if k != "total") == pytest.approx(big["total"])
