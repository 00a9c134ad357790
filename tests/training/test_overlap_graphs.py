"""DistributedOptimizer(overlap=True) where the graph changes between windows, at any world size: a layer
frozen and unfrozen again, a parameter that gets no gradient on some rank (a branch not taken), a gradient
that comes after its bucket was reduced; and an optimizer dropped without close() while its ranks had handed
different buckets to the thread. Overlapped adasum stays bitwise the run without overlap.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import adasum
from adasum.torch import DistributedOptimizer

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import inner


@pytest.fixture
def stall_timeout(comm):
    """A rank left waiting raises instead of hanging the suite."""
    old = adasum.configure(stall_timeout=60.0)
    yield
    adasum.configure(old)
    comm.Barrier()




def stack() -> torch.nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))


class Heads(torch.nn.Module):
    """A body and a head, plus an extra head used only where ``forward`` is told to (a data-dependent
    branch): where it is not, its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 4)
            self.extra = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.body(x))
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def micro(model, g: torch.Generator, **kw) -> None:
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    torch.nn.functional.mse_loss(model(x, **kw), y).backward()


def overlap_threads() -> set[threading.Thread]:
    """The overlap's threads alive now, by identity: a thread of an earlier test may still be leaving."""
    return {t for t in threading.enumerate() if t.name.startswith(("adasum-overlap", "adasum-local"))}


# --- frozen and unfrozen layers -----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
@TRAINING_SIZES
def test_freezing_and_unfreezing_a_layer_is_bitwise_the_plain_run(comm, stall_timeout, opt_name, k, set_to_none):
    """Gradual unfreezing: a layer frozen after two windows is not trained and keeps its bits (also where
    zero_grad(set_to_none=False) leaves it a gradient of zeros, which the wrapped optimizer's momentum or
    weight decay would otherwise apply); unfrozen three windows later it trains again; with overlap exactly
    as without."""

    def run(overlap: bool):
        model = stack()
        opt = DistributedOptimizer(inner(opt_name, model.parameters()), accumulation_steps=k, overlap=overlap,
                                   bucket_bytes=256)
        g = torch.Generator().manual_seed(100 + comm.Get_rank())
        layer = model[2].weight
        for w in range(8):
            if w == 2:
                layer.requires_grad_(False)
                held = raw_bytes(layer)
            if w == 5:
                assert raw_bytes(layer) == held  # not trained while frozen
                layer.requires_grad_(True)
            for _ in range(k):
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        assert raw_bytes(layer) != held  # trained again
        return model, opt

    plain, _ = run(False)
    over, opt = run(True)
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(over.parameters()))
    # Windows 0, 2 and 5 see a new list of trained parameters and are observed; the others overlap.
    assert opt.overlapped_boundaries == 5


# --- parameters without a gradient on some rank -------------------------------------------------------------------

# Whether rank 1 uses the extra head in micro-batch i (every other rank always does).
PATTERNS = {
    "never": lambda i: False,
    "from_window_3": lambda i: i >= 6,  # not at the observed boundary, then always
    "sometimes": lambda i: i % 3 == 0,  # in some closing micro-batches, some other ones only
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@TRAINING_SIZES
def test_a_branch_not_taken_on_one_rank_is_bitwise_the_plain_run(comm, stall_timeout, pattern, opt_name):
    rank = comm.Get_rank()
    uses = PATTERNS[pattern]
    k, windows = 2, 7

    def run(overlap: bool):
        model = Heads()
        opt = DistributedOptimizer(inner(opt_name, model.parameters()), accumulation_steps=k, overlap=overlap,
                                   bucket_bytes=64)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(k * windows):
            micro(model, g, use_extra=rank != 1 or uses(i))
            opt.step()
            opt.zero_grad()
        return model, opt

    plain, _ = run(False)
    over, opt = run(True)
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(over.parameters()))
    assert opt.overlapped_boundaries == windows - 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("op", ["sum", "mean"])
@TRAINING_SIZES
def test_a_branch_not_taken_on_one_rank_with_sum_mean(comm, stall_timeout, op):
    rank = comm.Get_rank()

    def run(overlap: bool):
        model = Heads()
        opt = DistributedOptimizer(inner("sgd", model.parameters()), op=op, overlap=overlap, bucket_bytes=64)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(7):
            micro(model, g, use_extra=rank != 1 or i >= 3)
            opt.step()
            opt.zero_grad()
        return model, opt

    plain, _ = run(False)
    over, opt = run(True)
    for a, b in zip(over.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert_identical_across_ranks(comm, list(over.parameters()))
    assert opt.overlapped_boundaries == 6


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_a_gradient_after_its_bucket_was_reduced_fails_on_every_rank(comm, stall_timeout):
    """The last rank runs backward twice in one closing micro-batch: its buckets went to the thread after
    the first, so the second's gradients come too late. Every rank raises in step(), naming it; the
    parameters keep the window's start, and training goes on with a new plan."""
    size, rank = comm.Get_size(), comm.Get_rank()
    model = stack()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), overlap=True, bucket_bytes=256)
    g = torch.Generator().manual_seed(100 + rank)

    def window(twice: bool = False) -> None:
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if twice:
            time.sleep(0.2)  # the thread has the buckets
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        window()
    start = [raw_bytes(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"rank {size - 1}: parameter \d+ .*received 2 gradient accumulations"):
        window(twice=rank == size - 1)
    assert [raw_bytes(p) for p in model.parameters()] == start
    opt.zero_grad()
    done = opt.overlapped_boundaries
    for _ in range(3):
        window()
    assert opt.overlapped_boundaries == done + 2  # observed once more, then overlapped
    assert_identical_across_ranks(comm, list(model.parameters()))


# --- dropping an optimizer whose ranks diverged -------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("inspector", ["stall_timeout", "off"])
@ONE_SIZE
def test_dropping_an_optimizer_whose_ranks_diverged_returns_at_once(comm, inspector):
    """Rank 1 takes no branch in the last closing backward, so it holds the extra head's bucket and the ones
    after it, while the other ranks hand them to the thread, which waits in a collective rank 1 never
    enters. Dropped without close(), the optimizer gives that thread up: the drop returns at once, the
    user's communicator works, and the thread leaves (so nothing keeps the process from exiting)."""
    rank = comm.Get_rank()
    old = adasum.configure(stall_timeout=60.0) if inspector == "stall_timeout" else adasum.configure(
        stall_timeout=None, stall_warning=None)
    try:
        before = overlap_threads()
        model = Heads()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, bucket_bytes=64)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            micro(model, g, use_extra=True)
            opt.step()
            opt.zero_grad()
        assert opt.overlapped_boundaries == 1
        micro(model, g, use_extra=rank != 1)  # the last closing backward; no step() follows
        time.sleep(1.0)  # the other ranks' thread is in the extra head's collective by now
        t0 = time.monotonic()
        del opt
        gc.collect()
        elapsed = time.monotonic() - t0
        assert elapsed < 15, f"rank {rank}: dropping the optimizer took {elapsed:.1f} s"

        t = torch.arange(5, dtype=torch.float32)
        out = adasum.adasum_allreduce(t)  # the same vector on every rank: Adasum gives it back
        assert torch.equal(out, t)
        deadline = time.monotonic() + 10
        while overlap_threads() - before and time.monotonic() < deadline:
            time.sleep(0.05)
        left = overlap_threads() - before
        assert not left, f"rank {rank}: the dropped optimizer's threads are still alive: {sorted(t.name for t in left)}"
    finally:
        adasum.configure(old)
    comm.Barrier()
