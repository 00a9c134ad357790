"""The training layer's promises under MPI: an optimizer that is dropped leaves nothing behind and never
touches the model again; a rank that leaves or skips step() becomes a stall error naming it, with or
without overlap; parameters change only inside step(); step(closure) checks the gradients the closure
computed; the fp16 wire keeps the small deltas of fine-tuning rates."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
import torch
from mpi4py import MPI

import adasum
from adasum.runtime.context import Context
from adasum.torch import DistributedOptimizer

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes


def model_for(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def micro(model, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(6, 8, generator=g, dtype=next(model.parameters()).dtype)
    loss = model(x).pow(2).mean() * scale
    loss.backward()
    return loss


def train(model, opt, g, steps: int) -> None:
    for _ in range(steps):
        micro(model, g)
        opt.step()
        opt.zero_grad()


# --- 1. lifetime -------------------------------------------------------------------------------------------------


def _live_comms() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), MPI.Comm) and o != MPI.COMM_NULL)


def _hooks(model) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@ONE_SIZE
def test_dropped_overlapped_optimizers_leave_nothing_behind(comm):
    model = model_for()
    g = torch.Generator().manual_seed(comm.Get_rank())
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01)).step()  # the user comm's own context
    gc.collect()
    threads, comms = threading.active_count(), _live_comms()
    contexts = sum(1 for o in gc.get_objects() if type(o) is Context)
    opt = None
    for i in range(100):
        # rebinding drops the previous optimizer without close(), as a loop that rebuilds it would
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), overlap=True, bucket_bytes=64)
        if i % 10 == 0:
            train(model, opt, g, 2)  # an observed boundary, then an overlapped one
            assert opt.overlapped_boundaries == 1
    del opt
    gc.collect()
    assert threading.active_count() == threads
    assert _hooks(model) == 0
    assert _live_comms() == comms
    assert sum(1 for o in gc.get_objects() if type(o) is Context) == contexts


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("close", [False, True])
@ONE_SIZE
def test_a_new_optimizer_trains_as_if_the_old_one_were_closed(comm, close):
    """A new optimizer on the same model (another learning rate): the old one, dropped without close(),
    never steps the shared parameters again, so the run is bitwise the run that closed it."""

    def run(close_old: bool):
        model = model_for()
        g = torch.Generator().manual_seed(comm.Get_rank())
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), overlap=True,
                                   bucket_bytes=64)
        train(model, opt, g, 3)
        if close_old:
            opt.close()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), overlap=True,
                                   bucket_bytes=64)
        train(model, opt, g, 10)
        assert opt.overlapped_boundaries == 9
        return [raw_bytes(p) for p in model.parameters()]

    assert run(close) == run(True)


# --- 3. never hang, never blame the wrong thing ------------------------------------------------------------------


def trained_three_steps(comm, overlap: bool):
    model = model_for()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), overlap=overlap, bucket_bytes=64,
                               comm=comm)
    g = torch.Generator().manual_seed(comm.Get_rank())
    train(model, opt, g, 3)
    return model, opt, g


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_a_rank_leaving_early_is_named_on_every_waiting_rank(stall_comm, overlap):
    size, rank = stall_comm.Get_size(), stall_comm.Get_rank()
    model, opt, g = trained_three_steps(stall_comm, overlap)
    if rank == size - 1:
        return  # its shard ended: it leaves the loop
    start = time.monotonic()
    with pytest.raises(adasum.AdasumStallError, match=rf"for rank {size - 1}, which has not entered it"):
        train(model, opt, g, 1)
    assert time.monotonic() - start < 30


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_a_rank_skipping_step_is_named_not_the_graph(stall_comm, overlap):
    size, rank = stall_comm.Get_size(), stall_comm.Get_rank()
    model, opt, g = trained_three_steps(stall_comm, overlap)
    if rank == size - 1:
        micro(model, g)  # no step() after this backward
        if overlap:  # its buckets went to the thread: zero_grad() tells it, and the others, what it did
            with pytest.raises(RuntimeError, match="zero_grad\\(\\) after the backward that closes a window"):
                opt.zero_grad()
        return
    if overlap:  # the last rank's zero_grad() meets this boundary's decision with its error
        with pytest.raises(RuntimeError, match=rf"rank {size - 1}: zero_grad\(\) after the backward that closes"):
            train(model, opt, g, 2)
        return
    with pytest.raises(adasum.AdasumStallError, match=rf"for rank {size - 1}, which has not entered it"):
        train(model, opt, g, 2)


# --- 4. parameters change only inside step() ---------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_copy", ["device", "host"])
@ONE_SIZE
def test_parameters_change_only_inside_step_with_overlap(comm, start_copy):
    def run(overlap: bool):
        model = model_for()
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), overlap=overlap,
                                   bucket_bytes=64, start_copy=start_copy)
        g = torch.Generator().manual_seed(comm.Get_rank())
        train(model, opt, g, 2)  # observed, then overlapped: the traffic of one overlapped window is known
        with adasum.count_traffic(opt.overlap_comm or comm) as window:
            train(model, opt, g, 1)
        for _ in range(3):
            before = [raw_bytes(p) for p in model.parameters()]
            with adasum.count_traffic(opt.overlap_comm or comm) as t:
                micro(model, g)
                if overlap:  # wait until the thread has reduced every bucket: their local steps are done
                    deadline = time.monotonic() + 60
                    while t.sent_bytes < window.sent_bytes and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert t.sent_bytes == window.sent_bytes
                assert [raw_bytes(p) for p in model.parameters()] == before
                opt.step()
            assert [raw_bytes(p) for p in model.parameters()] != before
            opt.zero_grad()
        return model, opt

    over, opt = run(True)
    plain, _ = run(False)
    assert opt.overlapped_boundaries == 5
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]


# --- 5. closures ------------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_closure_with_nonfinite_gradients_skips_every_update(comm, op, overlap):
    size, rank = comm.Get_size(), comm.Get_rank()
    model = model_for()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), op=op, overlap=overlap,
                               bucket_bytes=64)
    g = torch.Generator().manual_seed(rank)
    for i in range(5):
        bad = i == 3 and rank == size - 1
        before = [raw_bytes(p) for p in model.parameters()]
        loss = opt.step(lambda: micro(model, g, float("nan") if bad else 1.0))
        assert torch.isnan(loss) == bad
        assert opt.is_boundary and opt.step_was_skipped == (i == 3)
        if i == 3:
            assert [raw_bytes(p) for p in model.parameters()] == before
        opt.zero_grad()
    assert opt.skipped_updates == 1
    for state in opt.state.values():  # the rank that saw NaN kept its optimizer state finite
        assert all(torch.isfinite(v).all() for v in state.values() if isinstance(v, torch.Tensor))
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "mean"])
@TRAINING_SIZES
def test_closure_with_reduced_gradients_matches_the_plain_loop(comm, op):
    def run(closure: bool):
        model = model_for()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op, accumulation_steps=2)
        g = torch.Generator().manual_seed(comm.Get_rank())
        for _ in range(4):
            if closure:
                opt.step(lambda: micro(model, g))
            else:
                micro(model, g)
                opt.step()
            opt.zero_grad()
        return [raw_bytes(p) for p in model.parameters()]

    assert run(True) == run(False)


# --- 6. 16-bit wires that keep small values ----------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lr", [1e-5, 1e-6, 1e-7, 1e-8])
@pytest.mark.parametrize("op", ["adasum", "mean"])
@TRAINING_SIZES
def test_fp16_wire_keeps_the_deltas_of_small_learning_rates(comm, lr, op):
    def update(compression):
        model = model_for(dtype=torch.float64)
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), op=op, compression=compression)
        g = torch.Generator().manual_seed(comm.Get_rank())
        train(model, opt, g, 2)
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, g, 1)
        return torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])

    full, half = update(None), update("fp16")
    assert full.norm() > 0
    assert ((half - full).norm() / full.norm()).item() < 1e-2


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_fp16_underflow_that_remains_is_logged_with_the_layer(comm, caplog):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    q = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = DistributedOptimizer(torch.optim.SGD([p, q], lr=1.0), compression="fp16")
    with caplog.at_level(logging.WARNING, logger="adasum"):
        for _ in range(2):
            p.grad = torch.full((4,), 1e-300, dtype=torch.float64)  # below any scaled float16
            q.grad = torch.full((4,), 1e-3, dtype=torch.float64)
            opt.step()
            opt.zero_grad()
    hits = [r.getMessage() for r in caplog.records if "underflows the fp16 wire" in r.getMessage()]
    assert len(hits) == 1 and "parameter 0 (shape (4,))" in hits[0]
    torch.testing.assert_close(q.detach(), torch.full((4,), -2e-3, dtype=torch.float64), rtol=1e-3, atol=0)
