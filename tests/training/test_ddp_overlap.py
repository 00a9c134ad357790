"""The DDP hooks overlap with backward: each returns at once a future that the state's communication thread
completes, bitwise the results of the hooks reducing inside the call (``overlap=False``); errors and stalls
reach ``backward()`` on every rank through the futures; the thread ends with the state."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import GradBucket
from test_ddp import batches, ddp_windows, loss_of

SMALL = 0.0005  # bucket_cap_mb: a bucket per parameter or two


class Net(torch.nn.Module):
    """Three layers; ``frozen``: the first does not train; ``unused``: a fourth that forward never uses."""

    def __init__(self, frozen: bool, unused: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)
        if unused:
            self.unused = torch.nn.Linear(4, 4)
        if frozen:
            self.a.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def net(frozen: bool = False, unused: bool = False) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net(frozen, unused).double()


@pytest.fixture(autouse=True)
def collected():
    """The models and hook states of the tests before are collected (DDP's objects hold cycles), so their
    threads have ended."""
    gc.collect()
    yield


def hook_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("adasum-ddp-hook")]


def threads_once_collected() -> list[str]:
    """The hook threads left once the collector ran, after an error: the buckets DDP handed over after the
    one that failed still hold their state until the thread has run them (at once, on every rank)."""
    deadline = time.monotonic() + 10.0
    while True:
        gc.collect()
        left = hook_threads()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# kind: (gradients or deltas, op, micro-batches per update, optimizer)
KINDS = {
    "grad-adasum-momentum": ("grad", "adasum", 1, "sgd"),
    "grad-mean-no_sync": ("grad", "mean", 2, "adamw"),
    "delta-adamw": ("delta", "adasum", 1, "adamw"),
    "delta-momentum-no_sync": ("delta", "adasum", 2, "sgd"),
}
OPTIONS = {
    "buckets": {"bucket_cap_mb": SMALL},
    "buckets-view": {"bucket_cap_mb": SMALL, "gradient_as_bucket_view": True},
    "frozen-view": {"bucket_cap_mb": SMALL, "gradient_as_bucket_view": True, "frozen": True},
    "unused": {"bucket_cap_mb": SMALL, "find_unused_parameters": True},
}


def train(comm, kind: str, options: dict, overlap: bool, steps: int = 4):
    """``steps`` updates of DDP with the hook of ``kind``, a StepLR on its optimizer; returns the model and
    the hook's state."""
    what, op, k, opt_name = KINDS[kind]
    options = dict(options)
    model = net(options.pop("frozen", False), options.get("find_unused_parameters", False))
    ddp = torch.nn.parallel.DistributedDataParallel(model, **options)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=0.01, weight_decay=0.1) if opt_name == "adamw"
           else torch.optim.SGD(params, lr=0.1, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    if what == "grad":
        state = AdasumState(op=op, overlap=overlap)
        ddp.register_comm_hook(state, adasum_hook)
    else:
        state = DeltaState(opt, accumulation_steps=k, overlap=overlap)
        ddp.register_comm_hook(state, adasum_delta_hook)
    def window():
        if what == "grad":
            opt.step()
        opt.zero_grad()
        sched.step()

    ddp_windows(comm, ddp, steps, k, window)
    return model, ddp, state


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("kind", list(KINDS))
@TRAINING_SIZES
def test_overlapped_hooks_are_bitwise_the_hooks_inside_the_call(comm, pg, kind, options):
    model, _, state = train(comm, kind, OPTIONS[options], overlap=True)
    assert hook_threads() == [f"adasum-ddp-hook-{comm.Get_rank()}"]  # it did run on the thread
    if KINDS[kind][0] == "delta":
        assert state.updates == 4 and state.skipped_updates == 0
    plain, _, _ = train(comm, kind, OPTIONS[options], overlap=False)
    assert_identical_across_ranks(comm, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), net().parameters()))
    del model, plain, state
    gc.collect()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["grad", "delta"])
@ONE_SIZE
def test_backward_goes_on_while_the_buckets_are_reduced(comm, pg, what):
    """The last rank comes late to backward: on the others every hook returns a future that is not done
    yet, and DDP hands over every bucket before the first one's reduction completes; the results are the
    ones of the hooks inside the call."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hook = adasum_hook if what == "grad" else adasum_delta_hook
    seen: list[tuple[int, bool, list[bool]]] = []
    futures: list = []

    def watched(state, bucket):
        fut = hook(state, bucket)
        seen.append((bucket.index(), fut.done(), [f.done() for f in futures]))
        futures.append(fut)
        return fut

    def run(overlap: bool):
        model = net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        state = AdasumState(overlap=overlap) if what == "grad" else DeltaState(opt, overlap=overlap)
        ddp.register_comm_hook(state, watched)
        for step, (x, y) in enumerate(batches(comm, 3)):
            seen.clear()
            futures.clear()
            loss = loss_of(ddp, x, y)
            comm.Barrier()
            if rank == size - 1 and step == 2:
                time.sleep(1.0)
            loss.backward()
            if what == "grad":
                opt.step()
            opt.zero_grad()
        return model, list(seen)

    model, calls = run(True)
    plain, _ = run(False)
    assert len(calls) >= 3  # several buckets
    assert [i for i, _, _ in calls] == list(range(len(calls)))
    if rank != size - 1:
        assert not any(done for _, done, _ in calls), calls
        assert not any(any(before) for _, _, before in calls), calls
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in plain.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["grad", "delta"])
@ONE_SIZE
def test_the_thread_ends_with_the_model_or_close(comm, pg, what):
    def make():
        model = net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        state = AdasumState() if what == "grad" else DeltaState(opt)
        ddp.register_comm_hook(state, adasum_hook if what == "grad" else adasum_delta_hook)
        for x, y in batches(comm, 2):
            loss_of(ddp, x, y).backward()
            opt.zero_grad()
        return ddp, opt, state

    seen = [hook_threads()]
    ddp, opt, state = make()
    seen.append(hook_threads())
    del ddp, opt, state  # the model and its state collected: the thread ends, without any call
    gc.collect()
    seen.append(hook_threads())

    ddp, opt, state = make()
    seen.append(hook_threads())
    assert not state.closed
    state.close()
    seen.append(hook_threads())
    assert state.closed
    x, y = batches(comm, 1)[0]
    with pytest.raises(RuntimeError, match=rf"rank {comm.Get_rank()}: this {type(state).__name__} was closed"):
        loss_of(ddp, x, y).backward()
    state.close()  # again: nothing
    del ddp, opt, state
    gc.collect()
    seen.append(hook_threads())
    # every rank's observations, checked once every rank made them (a rank failing alone would leave the
    # others waiting in a collective)
    assert comm.allgather(seen) == [[[], [f"adasum-ddp-hook-{r}"], [], [f"adasum-ddp-hook-{r}"], [], []]
                                    for r in range(comm.Get_size())]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_a_mismatch_raises_in_backward_on_every_rank(comm, pg):
    """The last rank's state sums where the others' take Adasum: backward raises on every rank, naming
    the ranks and what they passed."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL)
    ddp.register_comm_hook(AdasumState(op="sum" if rank == size - 1 else "adasum"), adasum_hook)
    x, y = batches(comm, 1)[0]
    with pytest.raises(RuntimeError, match=rf"AdasumMismatchError: \(raised on rank {rank}\) ranks disagree on "
                                           rf"the op: (?=[^\n]*rank 0 has 'adasum')(?=[^\n]*rank {size - 1} has 'sum')"):
        loss_of(ddp, x, y).backward()
    del ddp
    assert threads_once_collected() == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_a_local_step_failing_on_one_rank_raises_in_backward_on_every_rank(comm, pg):
    """A step pre-hook of the optimizer raises on the last rank, on the second update: backward raises on
    every rank, naming that rank, and the parameters keep their values; the next update trains on."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    updates = []

    def pre_hook(optimizer, args, kwargs):
        updates.append(len(updates))
        if rank == size - 1 and len(updates) == 2:
            raise ValueError("the hook refuses this update")

    opt.register_step_pre_hook(pre_hook)
    state = DeltaState(opt)
    ddp.register_comm_hook(state, adasum_delta_hook)
    data = batches(comm, 3)
    loss_of(ddp, *data[0]).backward()
    before = [raw_bytes(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"a local step failed inside the DDP hook; the parameters keep their "
                                           rf"values: rank {size - 1}: a step pre-hook of the optimizer raised "
                                           r"ValueError: the hook refuses this update"):
        loss_of(ddp, *data[1]).backward()
    assert [raw_bytes(p) for p in model.parameters()] == before
    assert state.updates == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["grad", "delta"])
@ONE_SIZE
def test_a_rank_that_never_arrives_is_named_in_backward(comm, pg, stall_comm, what):
    rank, size = comm.Get_rank(), comm.Get_size()
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = AdasumState(stall_comm) if what == "grad" else DeltaState(opt, stall_comm)
    ddp.register_comm_hook(state, adasum_hook if what == "grad" else adasum_delta_hook)
    data = batches(comm, 2)
    loss_of(ddp, *data[0]).backward()
    loss = loss_of(ddp, *data[1])
    if rank == size - 1:
        return  # its backward never comes
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"AdasumStallError: .*for rank {size - 1}, which has not entered it"):
        loss.backward()
    assert time.monotonic() - start < 30
    del ddp, state, opt, loss
    assert threads_once_collected() == []


def test_one_process_reduces_inside_the_call_without_a_thread():
    from mpi4py import MPI

    state = AdasumState(MPI.COMM_SELF, op="mean")
    grads = [torch.arange(3.0), torch.ones(2)]
    fut = adasum_hook(state, GradBucket(grads))
    assert fut.done() and torch.equal(grads[0], torch.arange(3.0)) and hook_threads() == []
    state.close()
    with pytest.raises(RuntimeError, match="this AdasumState was closed"):
        adasum_hook(state, GradBucket(grads))
