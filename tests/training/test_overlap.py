"""DistributedOptimizer(overlap=True) and compression under MPI, at any world size: overlapped results
against the same run without overlap (bitwise for adasum), buckets started during backward, backward
orders that differ between ranks, failures on the communication thread, the fall-backs, and 16-bit wires.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import adasum
from adasum.torch import DistributedOptimizer

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import inner


class Branches(torch.nn.Module):
    """Two branches summed; ``swap`` evaluates them in the other order, which reverses the order in which
    backward finishes their parameters."""

    def __init__(self, swap: bool = False):
        super().__init__()
        self.swap = swap
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.b(x) + self.a(x) if self.swap else self.a(x) + self.b(x)


def model_for(seed: int = 0, swap: bool = False) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Branches(swap)




def run(comm, *, overlap, op="adasum", opt_name="sgd", k=2, windows=4, swap=False, traffic=None, **kw):
    """Train; where ``traffic`` is given, add to it what the optimizer sent on ``comm`` and, with overlap,
    on the thread's communicator."""
    rank = comm.Get_rank()
    model = model_for(0, swap)
    opt = DistributedOptimizer(inner(opt_name, model.parameters()), op=op, accumulation_steps=k,
                               overlap=overlap, bucket_bytes=kw.pop("bucket_bytes", 256), **kw)
    g = torch.Generator().manual_seed(100 + rank)
    with contextlib.ExitStack() as stack:
        counters = [stack.enter_context(adasum.count_traffic(c)) for c in (comm, opt.overlap_comm) if c is not None]
        for _ in range(windows):
            for _ in range(k):
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    if traffic is not None:
        for t in counters:
            for field in ("sent_bytes", "allreduce_bytes", "scalar_bytes", "messages"):
                setattr(traffic, field, getattr(traffic, field) + getattr(t, field))
    return model, opt


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("start_copy", ["device", "host"])
@TRAINING_SIZES
@pytest.mark.smoke
def test_overlapped_adasum_is_bitwise_the_plain_run(comm, opt_name, k, start_copy):
    plain, _ = run(comm, overlap=False, opt_name=opt_name, k=k, start_copy=start_copy)
    over, opt = run(comm, overlap=True, opt_name=opt_name, k=k, start_copy=start_copy)
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(over.parameters()))
    if comm.Get_size() > 1:
        # The first boundary is observed; the others reduced buckets during backward, several of them
        # handed over before step() was called.
        assert opt.overlapped_boundaries == 3
        assert opt.buckets_started_in_backward >= 2


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_overlapped_hierarchical_adasum_is_bitwise_the_plain_run(comm):
    plain, _ = run(comm, overlap=False, hierarchical=True)
    over, _ = run(comm, overlap=True, hierarchical=True)
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how", ["force_boundary", "flush"])
@TRAINING_SIZES
def test_short_windows_with_overlap(comm, how):
    """force_boundary() before the closing backward overlaps that window too; flush() closes a window
    whose last backward has run already, without overlap. Both give the plain run's bits."""
    results = []
    for overlap in (False, True):
        model = model_for()
        opt = DistributedOptimizer(inner("sgd", model.parameters()), accumulation_steps=3, overlap=overlap,
                                   bucket_bytes=1)
        g = torch.Generator().manual_seed(comm.Get_rank())
        for i in range(8):  # windows of 3, 3 and a short one of 2
            if how == "force_boundary" and i == 7:
                opt.force_boundary()
            torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.ones(4, 4)).backward()
            opt.step()
            opt.zero_grad()
        if how == "flush":
            assert opt.flush()
            opt.zero_grad()
        assert opt.boundaries == 3
        if overlap and comm.Get_size() > 1:
            assert opt.overlapped_boundaries == (2 if how == "force_boundary" else 1)
        results.append([raw_bytes(p) for p in model.parameters()])
    assert results[0] == results[1]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("threshold", [0, 1 << 30])
@TRAINING_SIZES
def test_bucketed_adasum_is_bitwise_under_both_schedules(comm, threshold):
    """Buckets reduced alone give per layer the bits of one call on all parameters, whether each call
    takes recursive halving (threshold 0) or recursive doubling."""
    before = adasum.get_small_message_bytes()
    adasum.set_small_message_bytes(threshold)
    try:
        plain, _ = run(comm, overlap=False, windows=3)
        over, _ = run(comm, overlap=True, windows=3, bucket_bytes=1)
    finally:
        adasum.set_small_message_bytes(before)
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "mean"])
@TRAINING_SIZES
def test_overlapped_sum_mean_match_the_plain_run(comm, op):
    plain, _ = run(comm, overlap=False, op=op, opt_name="adamw")
    over, _ = run(comm, overlap=True, op=op, opt_name="adamw")
    for a, b in zip(over.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_identical_across_ranks(comm, list(over.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@TRAINING_SIZES
def test_backward_order_that_differs_between_ranks(comm, op):
    """Odd ranks finish the branches in the other order: the buckets still follow rank 0's order, so
    nothing hangs and adasum gives the bits of the run without overlap."""
    swap = comm.Get_rank() % 2 == 1
    plain, _ = run(comm, overlap=False, op=op, swap=swap)
    over, opt = run(comm, overlap=True, op=op, swap=swap)
    assert opt.overlapped_boundaries == 3
    if op == "adasum":
        assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(over.parameters()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_users_own_collectives_during_backward(comm):
    """The thread works on its own duplicate of comm: the user's collectives on comm in the middle of
    backward never meet the optimizer's messages."""
    model = model_for()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), overlap=True, bucket_bytes=1)
    seen = []
    for layer in (model.a[0], model.b[0]):
        layer.weight.register_hook(lambda g: seen.append(comm.allreduce(1)) or g)
    g = torch.Generator().manual_seed(comm.Get_rank())
    for _ in range(3):
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()
        opt.step()
        opt.zero_grad()
    assert seen == [comm.Get_size()] * 6 and opt.overlapped_boundaries == 2
    assert_identical_across_ranks(comm, list(model.parameters()))


class FailingSGD(torch.optim.SGD):
    """SGD whose step raises on one rank at one boundary."""

    def __init__(self, params, fail: bool = False):
        super().__init__(params, lr=0.1)
        self.fail = fail

    def step(self, closure=None):
        if self.fail:
            raise ValueError("injected failure in the local step")
        return super().step(closure)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@ONE_SIZE
def test_failure_on_the_thread_raises_in_step_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    model = model_for()
    inner_opt = FailingSGD(model.parameters(), fail=False)
    opt = DistributedOptimizer(inner_opt, overlap=True, bucket_bytes=1)
    g = torch.Generator().manual_seed(rank)

    def micro():
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()

    micro()
    opt.step()  # observed boundary
    opt.zero_grad()
    before = [raw_bytes(p) for p in model.parameters()]
    inner_opt.fail = rank == size - 1
    micro()
    with pytest.raises(RuntimeError, match=f"rank {size - 1}: ValueError: injected failure"):
        opt.step()
    assert [raw_bytes(p) for p in model.parameters()] == before  # left at the window's start
    inner_opt.fail = False
    opt.zero_grad()
    micro()
    opt.step()  # training can go on
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
@TRAINING_SIZES
def test_clipping_with_overlap(comm, op):
    """Clipping each rank's gradient by its global norm needs all gradients before the local step: with
    adasum the optimizer then never overlaps, and the result is the plain run's bitwise. With sum/mean the
    reduced gradient is clipped after the buckets were reduced during backward, so it still overlaps, and
    the result is the plain run's within float rounding."""
    results = []
    for overlap in (False, True):
        model = model_for()
        opt = DistributedOptimizer(inner("sgd", model.parameters()), op=op, overlap=overlap, bucket_bytes=1)
        g = torch.Generator().manual_seed(comm.Get_rank())
        for _ in range(3):
            torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.ones(4, 4)).backward()
            opt.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        assert opt.overlapped_boundaries == (2 if overlap and op != "adasum" and comm.Get_size() > 1 else 0)
        results.append(list(model.parameters()))
    if op == "adasum":
        assert [raw_bytes(p) for p in results[1]] == [raw_bytes(p) for p in results[0]]
    else:
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_clipping_started_late_with_adasum_raises_and_restores(comm):
    """A loop that first clips at a boundary whose local steps already ran during backward gets an error
    on every rank and the window's starting parameters, never a silently different update."""
    model = model_for()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), overlap=True, bucket_bytes=1)
    g = torch.Generator().manual_seed(comm.Get_rank())

    def micro():
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.ones(4, 4)).backward()

    micro()
    opt.step()
    opt.zero_grad()
    before = [raw_bytes(p) for p in model.parameters()]
    micro()
    with pytest.raises(RuntimeError, match="overlap=False"):
        opt.clip_grad_norm_(0.05)
    assert [raw_bytes(p) for p in model.parameters()] == before


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["adasum", "mean", "sum"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
def test_compression_halves_the_bytes_and_stays_close(comm, op, compression, overlap):
    size = comm.Get_size()
    full, half = adasum.Traffic(), adasum.Traffic()

    plain, _ = run(comm, overlap=overlap, op=op, windows=3, traffic=full)
    packed, _ = run(comm, overlap=overlap, op=op, windows=3, compression=compression, traffic=half)
    assert_identical_across_ranks(comm, list(packed.parameters()))
    eps = 2.0 ** -10 if compression == "fp16" else 2.0 ** -7
    for a, b in zip(packed.parameters(), plain.parameters()):
        err = (a - b).norm() / b.norm()
        assert err < 30 * eps, (err, eps)
        if size > 1:
            assert err > 0  # the 16-bit wire changed something
    if size > 1:
        field = "sent_bytes" if op == "adasum" else "allreduce_bytes"
        f, h = getattr(full, field), getattr(half, field)
        assert f > 0
        if op == "adasum":
            assert h == f // 2
        else:  # plus the small "which ranks had a gradient" layer, which travels alike
            assert abs(h - f / 2) <= 64 * 3


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_compressed_adasum_overlap_is_bitwise_the_plain_compressed_run(comm):
    plain, _ = run(comm, overlap=False, compression="bf16")
    over, _ = run(comm, overlap=True, compression="bf16")
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]


def test_bad_compression_is_refused():
    model = model_for()
    with pytest.raises(ValueError, match="compression must be None, 'fp16' or 'bf16', got 'int8'"):
        DistributedOptimizer(inner("sgd", model.parameters()), compression="int8")
    with pytest.raises(ValueError, match="bucket_bytes"):
        DistributedOptimizer(inner("sgd", model.parameters()), bucket_bytes=0)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_the_timeline_shows_each_bucket_and_the_first_leaves_early(comm):
    """The first bucket is cut at 1 MiB (the last layer backward finishes), the others at bucket_bytes; the
    timeline of a boundary lists them in order with when each was handed over, began and ended."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(600, 600) for _ in range(3)])
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), overlap=True, comm=comm)
    try:
        x = torch.randn(4, 600, generator=torch.Generator().manual_seed(comm.Get_rank()))
        assert opt.timeline == []
        for _ in range(3):  # the first boundary observes backward's order; the later ones overlap
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        layer = 600 * 600 * 4 + 600 * 4
        tl = opt.timeline
        assert [e["bucket"] for e in tl] == [0, 1] and [e["bytes"] for e in tl] == [layer, 2 * layer]
        for e in tl:
            assert 0 <= e["ready"] <= e["began"] <= e["ended"], e
        assert tl[0]["ready"] <= tl[1]["ready"] <= tl[1]["step"] and tl[0]["ended"] <= tl[1]["began"]
    finally:
        opt.close()


class FlagAdam(torch.optim.Adam):
    """Adam that halves its learning rate while a flag the user sets on the instance is on."""

    @torch.no_grad()
    def step(self, closure=None):
        halve = getattr(self, "halve", False)
        if halve:
            for g in self.param_groups:
                g["lr"] /= 2
        try:
            return super().step(closure)
        finally:
            if halve:
                for g in self.param_groups:
                    g["lr"] *= 2


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps in an instance attribute (state kept outside ``self.state``)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@TRAINING_SIZES
def test_bucket_steps_follow_the_users_optimizer(comm):
    """Overlap steps the optimizer one bucket at a time through a copy of it: the copy sees the user's
    instance attributes as they are at each step (a flag set after construction), and an optimizer state
    loaded between windows (``load_state_dict`` rebinds ``state``) is the one the next buckets step with:
    bitwise the plain run's."""
    rank = comm.Get_rank()
    runs = {}
    for overlap in (False, True):
        model = model_for()
        inner_opt = FlagAdam(model.parameters(), lr=0.01)
        opt = DistributedOptimizer(inner_opt, overlap=overlap, bucket_bytes=1)
        g = torch.Generator().manual_seed(rank)
        saved = None
        for window in range(5):
            if window == 2:
                saved = opt.state_dict()
                inner_opt.halve = True
            if window == 4:
                opt.load_state_dict(saved)
            torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()
            opt.step()
            opt.zero_grad()
        runs[overlap] = ([raw_bytes(p) for p in model.parameters()], opt.overlapped_boundaries)
    (plain, _), (over, overlapped) = runs[False], runs[True]
    assert overlapped >= 3  # the windows after the first (observed) one ran on the thread, bucket by bucket
    assert over == plain
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_an_optimizer_that_counts_in_its_attributes_is_refused_bucket_by_bucket(comm):
    """A step that changes the optimizer's own instance attributes would count one step per bucket: the
    first overlapped boundary raises on every rank, saying what to do, the parameters at the window's start;
    without overlap it trains, one step per window."""
    rank = comm.Get_rank()
    model = model_for()
    opt = DistributedOptimizer(CountingSGD(model.parameters(), lr=0.1), overlap=True, bucket_bytes=1)
    g = torch.Generator().manual_seed(rank)

    def micro():
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()

    micro()
    opt.step()  # observed: the whole optimizer's own step
    opt.zero_grad()
    before = [raw_bytes(p) for p in model.parameters()]
    micro()
    with pytest.raises(RuntimeError, match=r"CountingSGD's step changes its instance attributes \['calls'\].*"
                                           r"overlap=False"):
        opt.step()
    assert [raw_bytes(p) for p in model.parameters()] == before
    opt.close()
    inner_opt = CountingSGD(model.parameters(), lr=0.1)
    plain = DistributedOptimizer(inner_opt, overlap=False)
    for _ in range(3):
        micro()
        plain.step()
        plain.zero_grad()
    assert inner_opt.calls == 3
    assert_identical_across_ranks(comm, list(model.parameters()))
