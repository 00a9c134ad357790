"""adasum.horovod: a training loop written for Horovod's torch API, run through the compatibility module,
gives what the library's own API gives for the same loop, at any world size."""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

import adasum
import adasum.horovod as hvd
import adasum.torch as at
from adasum.rule.reference import reference_allreduce

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes


def horovod_style_training(dist_opt, passes: int = 2, steps: int = 3, seed_rank: bool = True):
    """Horovod's calling convention: zero_grad, ``passes`` backward passes, one step()."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234 + (hvd.rank() if seed_rank else 0))  # ranks start apart: broadcast fixes it
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    opt = dist_opt(opt, model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(passes):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("compression", [hvd.Compression.none, hvd.Compression.fp16])
@TRAINING_SIZES
@pytest.mark.smoke
def test_horovod_script_runs_and_matches_the_library(comm, passes, compression):
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (comm.Get_rank(), comm.Get_size())
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()

    def ported(opt, model):
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                        backward_passes_per_step=passes, compression=compression)

    def native(opt, model):
        return at.DistributedOptimizer(opt, op="adasum", compression=compression.wire, overlap=False)

    a = horovod_style_training(ported, passes)
    b = horovod_style_training(native, passes)
    assert [raw_bytes(p) for p in a.parameters()] == [raw_bytes(p) for p in b.parameters()]
    assert_identical_across_ranks(comm, list(a.parameters()))


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_allreduce_ops(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [torch.arange(6, dtype=torch.float64).reshape(2, 3) * (r + 1) - r for r in range(size)]
    mine = per_rank[rank]
    torch.testing.assert_close(hvd.allreduce(mine), sum(per_rank) / size)
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Sum), sum(per_rank))
    torch.testing.assert_close(hvd.allreduce(mine, average=True), sum(per_rank) / size)
    expected = reference_allreduce([[t.numpy()] for t in per_rank])[0]
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Adasum), torch.from_numpy(expected))
    half = hvd.allreduce(mine.float(), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, sum(per_rank).float(), rtol=2e-3, atol=2e-3)
    t = mine.clone()
    assert hvd.allreduce_(t, op=hvd.Sum) is t or torch.equal(t, sum(per_rank))
    torch.testing.assert_close(t, sum(per_rank))


def test_unsupported_horovod_arguments_raise():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(opt, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="named_parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight)])


# --- Horovod's common calls ------------------------------------------------------------------------------------

def _per_rank(size, shape=(2, 3), dtype=torch.float64):
    """Every rank's input, known to every rank: distinct values, signs and magnitudes per rank."""
    return [(torch.arange(6, dtype=torch.float64).reshape(shape) * (r + 1) - 2.5 * r).to(dtype)
            for r in range(size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.int64])
@TRAINING_SIZES
def test_min_max_product(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = _per_rank(size, dtype=dtype) if dtype.is_floating_point else \
        [torch.arange(6).reshape(2, 3) * (r + 1) - 3 * r for r in range(size)]
    stacked = torch.stack([t.to(torch.float64) for t in per_rank])
    mine = per_rank[rank]
    assert torch.equal(hvd.allreduce(mine, op=hvd.Min), stacked.min(0).values.to(dtype))
    assert torch.equal(hvd.allreduce(mine, op=hvd.Max), stacked.max(0).values.to(dtype))
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Product), stacked.prod(0).to(dtype))
    t = mine.clone()
    assert hvd.allreduce_(t, op=hvd.Max) is t
    assert torch.equal(t, stacked.max(0).values.to(dtype))
    scalar = torch.tensor(rank + 2, dtype=dtype)  # a metric: 0-d
    assert float(hvd.allreduce(scalar, op=hvd.Max)) == size + 1
    # the product in the tensor's own dtype (float16 overflows to inf from 8 ranks on, as the reference does)
    want = torch.tensor(float(torch.arange(2, size + 2).prod())).to(dtype)
    assert float(hvd.allreduce(scalar, op=hvd.Product)) == float(want)
    scaled = hvd.allreduce(mine, op=hvd.Max, prescale_factor=2, postscale_factor=3) if dtype.is_floating_point \
        else None
    if scaled is not None:
        torch.testing.assert_close(scaled, (stacked * 2).max(0).values.to(dtype) * 3)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_min_max_of_booleans(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [torch.tensor([True, r == 0, r % 2 == 1, False]) for r in range(size)]
    stacked = torch.stack(per_rank)
    assert torch.equal(hvd.allreduce(per_rank[rank], op=hvd.Min), stacked.all(0))
    assert torch.equal(hvd.allreduce(per_rank[rank], op=hvd.Max), stacked.any(0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@TRAINING_SIZES
def test_fp16_compression_halves_the_bytes(comm, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    g = torch.Generator().manual_seed(7)
    per_rank = [torch.randn(4096, generator=g) * 1e-3 for _ in range(size)]
    expected = sum(per_rank) / (size if op == hvd.Average else 1)
    with adasum.count_traffic(comm) as full:
        plain = hvd.allreduce(per_rank[rank], op=op)
    with adasum.count_traffic(comm) as half:
        packed = hvd.allreduce(per_rank[rank], op=op, compression=hvd.Compression.fp16)
    assert packed.dtype == torch.float32
    torch.testing.assert_close(plain, expected)
    # scaled by a power of two into float16's range: float16's relative precision, not its absolute one
    torch.testing.assert_close(packed, expected, rtol=0, atol=float(expected.abs().max()) * 2e-3)
    assert full.allreduce_bytes == 4096 * 4
    assert half.allreduce_bytes == 4096 * 2 == full.allreduce_bytes // 2
    assert_identical_across_ranks(comm, [packed])


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_fp16_compression_with_adasum(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = _per_rank(size, dtype=torch.float32)
    expected = torch.from_numpy(reference_allreduce([[t.double().numpy()] for t in per_rank])[0]).float()
    out = hvd.allreduce(per_rank[rank], op=hvd.Adasum, compression=hvd.Compression.fp16)
    torch.testing.assert_close(out, expected, rtol=0, atol=float(expected.abs().max()) * 4e-3)
    assert_identical_across_ranks(comm, [out])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@TRAINING_SIZES
def test_allreduce_backward(comm, op):
    """The gradient of the sum over the ranks of each rank's loss, checked against one computed from every
    rank's weights, and by torch's gradcheck (every rank perturbing in step)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    weights = [torch.arange(6, dtype=torch.float64).reshape(2, 3) - r for r in range(size)]
    x = _per_rank(size)[rank].clone().requires_grad_()
    y = hvd.allreduce(x, op=op, postscale_factor=0.5)
    (weights[rank] * y).sum().backward()
    expected = sum(weights) * 0.5 / (size if op == hvd.Average else 1)
    torch.testing.assert_close(x.grad, expected)
    x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: hvd.allreduce(t, op=op, prescale_factor=2.0), (x,))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Adasum, hvd.Min, hvd.Max, hvd.Product])
@ONE_SIZE
def test_allreduce_without_a_gradient_raises_on_every_rank(comm, op):
    x = torch.ones(3, dtype=torch.float64, requires_grad=comm.Get_rank() == 0)
    with pytest.raises(ValueError, match=f"rank 0: allreduce with op='{op}' has no gradient"):
        hvd.allreduce(x, op=op)
    with torch.no_grad():  # without gradients it reduces
        assert hvd.allreduce(x, op=op).shape == (3,)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_disagreements_raise_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    with pytest.raises(hvd.HorovodInternalError, match=rf"raised on rank {rank}\).*allreduce calls differ.*"
                                                      r"rank 1 passes op='max'"):
        hvd.allreduce(torch.ones(3), op=hvd.Max if rank == 1 else hvd.Min)
    with pytest.raises(ValueError, match=rf"raised on rank {rank}\).*calls differ.*rank 1 passes.*\(4,\)"):
        hvd.allreduce(torch.ones(4 if rank == 1 else 3), op=hvd.Sum)
    with pytest.raises(ValueError, match="rank 1: compression applies to floating tensors"):
        hvd.allreduce(torch.ones(3, dtype=torch.int64 if rank == 1 else torch.float32),
                      compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="rank 0: op must be one of"):
        hvd.allreduce(torch.ones(3), op="median" if rank == 0 else hvd.Sum)
    with pytest.raises(ValueError, match=r"allgather calls differ.*rank 1 passes tensors=\(\('torch.float32', \(4,\)"):
        hvd.allgather(torch.ones(2, 4 if rank == 1 else 3))
    with pytest.raises(ValueError, match="broadcast calls differ"):
        hvd.broadcast(torch.ones(2 if rank == 1 else 3), root_rank=0)
    with pytest.raises(ValueError, match=rf"root_rank must be a rank of the process set .*, got {size}"):
        hvd.broadcast(torch.ones(3), root_rank=size)
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(comm.Get_size())))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
@TRAINING_SIZES
def test_allgather_of_uneven_rows(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [(torch.arange((r + 1) * 3).reshape(r + 1, 3) * (r + 2)).to(dtype) for r in range(size)]
    out = hvd.allgather(per_rank[rank])
    assert out.dtype == dtype
    assert torch.equal(out, torch.cat(per_rank))
    assert torch.equal(hvd.allgather(torch.zeros(0, 3, dtype=dtype) if rank == 0 else per_rank[rank]),
                       torch.cat(per_rank[1:]))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_allgather_backward(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = [r + 1 for r in range(size)]
    weights = [torch.arange(sum(rows) * 2, dtype=torch.float64).reshape(-1, 2) * (r + 1) for r in range(size)]
    x = torch.ones(rows[rank], 2, dtype=torch.float64, requires_grad=True)
    (weights[rank] * hvd.allgather(x)).sum().backward()
    start = sum(rows[:rank])  # as in Horovod: the average over the ranks of the incoming gradients
    torch.testing.assert_close(x.grad, sum(weights)[start:start + rows[rank]] / size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int16, torch.bool])
@TRAINING_SIZES
def test_broadcast(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [(torch.arange(6).reshape(2, 3) + 10 * r).to(dtype) for r in range(size)]
    for root in range(size):
        out = hvd.broadcast(per_rank[rank], root_rank=root)
        assert torch.equal(out, per_rank[root])
        assert torch.equal(per_rank[rank], (torch.arange(6).reshape(2, 3) + 10 * rank).to(dtype))  # untouched
        t = per_rank[rank].clone()
        assert hvd.broadcast_(t, root_rank=root) is t
        assert torch.equal(t, per_rank[root])


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_broadcast_backward(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    weights = [torch.arange(3, dtype=torch.float64) * (r + 2) for r in range(size)]
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (weights[rank] * hvd.broadcast(x, root_rank=root)).sum().backward()
    # as in Horovod: the root's gradient is the average over the ranks of the incoming gradients
    torch.testing.assert_close(x.grad, sum(weights) / size if rank == root else torch.zeros(3, dtype=torch.float64))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_objects_barrier_join(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = {"rank": rank, "items": list(range(rank))}
    assert hvd.allgather_object(mine) == [{"rank": r, "items": list(range(r))} for r in range(size)]
    for root in range(size):
        assert hvd.broadcast_object(mine if rank == root else None, root_rank=root) == \
            {"rank": root, "items": list(range(root))}
    with pytest.raises(ValueError, match="root_rank must be a rank"):
        hvd.broadcast_object(1, root_rank=size)
    # barrier: no rank leaves before the last one has arrived (rank 1 arrives late)
    # (the ranks share this machine's monotonic clock: every rank leaves after rank 1 arrived)
    if rank == 1:
        time.sleep(0.3)
    arrived = time.monotonic()
    hvd.barrier()
    left = time.monotonic()
    times = comm.allgather((arrived, left))
    assert all(left >= times[1][0] for _, left in times), times
    if rank == size - 1:
        time.sleep(0.3)
    hvd.init()
    assert hvd.join() == size - 1


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_cross_rank_and_size(comm):
    nodes = comm.allgather(MPI.Get_processor_name())
    order = list(dict.fromkeys(nodes))
    assert hvd.cross_size() == len(order)
    assert hvd.cross_rank() == order.index(nodes[comm.Get_rank()])
    assert hvd.local_rank() == nodes[:comm.Get_rank()].count(nodes[comm.Get_rank()])


def test_built_and_enabled_checks():
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.nccl_built() or hvd.ddl_built() or hvd.ccl_built())
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.rocm_built() == (getattr(torch.version, "hip", None) is not None)
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)


@pytest.mark.parametrize("name", ["start_timeline", "stop_timeline", "SyncBatchNorm"])
def test_what_is_not_provided_raises(name):
    with pytest.raises(NotImplementedError, match=f"adasum.horovod.{name} is not provided: "):
        getattr(hvd, name)(torch.ones(2))


def test_elastic_without_ulfm_says_so_and_lets_errors_through(caplog):
    """Under an MPI without ULFM (this suite's MPICH) elastic.run warns once, naming what to install, and an
    error inside the function propagates as it would without it."""
    from adasum.runtime.membership import ulfm_problem
    from adasum.torch import elastic

    if ulfm_problem() is None:
        pytest.skip("this MPI has ULFM")
    elastic._told[0] = False
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.epoch)
        raise KeyError("not a failure")

    state = hvd.elastic.ObjectState(epoch=3)
    with caplog.at_level("WARNING", logger="adasum"):
        with pytest.raises(KeyError):
            train(state)
        with pytest.raises(KeyError):
            train(state)
    told = [r for r in caplog.records if "ULFM" in r.getMessage()]
    assert len(told) == 1 and "--with-ft ulfm" in told[0].getMessage()
    assert calls == [3, 3] and state.resets == 0


def test_a_process_set_argument_is_checked():
    with pytest.raises(ValueError, match="process_set must be an adasum.horovod.ProcessSet"):
        hvd.allgather(torch.ones(2), process_set=object())
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))


def _clipping_model(rank: int, op: str, horovod: bool):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if horovod:
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=op)
    else:
        opt = at.DistributedOptimizer(inner, op=op)
    g = torch.Generator().manual_seed(100 + rank)
    norms = []
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 4, generator=g) * 5
        torch.nn.functional.mse_loss(model(x), torch.randn(16, 2, generator=g) * 5).backward()
        if horovod:
            opt.synchronize()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            with opt.skip_synchronize():
                opt.step()
        else:
            norms.append(opt.clip_grad_norm_(0.05))
            opt.step()
    return model, norms


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Adasum, hvd.Average, hvd.Sum])
@TRAINING_SIZES
def test_synchronize_then_clip_then_skip_synchronize(comm, op):
    """Horovod's clipping pattern gives what the library's clip_grad_norm_ gives, bit for bit."""
    rank = comm.Get_rank()
    with adasum.count_traffic(comm) as traffic_a:
        a, norms_a = _clipping_model(rank, op, horovod=True)
    with adasum.count_traffic(comm) as traffic_b:
        b, norms_b = _clipping_model(rank, op, horovod=False)
    assert [raw_bytes(p) for p in a.parameters()] == [raw_bytes(p) for p in b.parameters()]
    assert torch.equal(torch.stack(norms_a), torch.stack(norms_b))
    assert all(n > 0.05 for n in norms_a)  # the clipping did something
    assert_identical_across_ranks(comm, list(a.parameters()))
    if op != hvd.Adasum:  # the gradients are reduced once per step: synchronize() and not again in step()
        gradients = 3 * sum(p.numel() for p in a.parameters()) * 4
        assert traffic_a.allreduce_bytes == traffic_b.allreduce_bytes
        assert gradients <= traffic_a.allreduce_bytes < 2 * gradients
        gathered = comm.allgather([float(x) for x in norms_a])
        assert all(g == gathered[0] for g in gathered)  # the reduced gradient's norm, the same on every rank


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_skip_synchronize_without_synchronize_still_reduces(comm):
    """step() inside skip_synchronize() without synchronize() reduces as usual: the ranks stay identical."""
    rank = comm.Get_rank()
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Average)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    grads = comm.allgather([p.grad.clone() for p in model.parameters()])
    before = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        mean = sum(g[i] for g in grads) / comm.Get_size()
        torch.testing.assert_close(p.detach(), b - 0.1 * mean)
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@TRAINING_SIZES
def test_integer_tensors_keep_their_dtype_when_scaled_and_averaged(comm, dtype):
    """As Horovod: integers scaled in float64 and cast back; Average = the sum / size, cast back."""
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [torch.randint(-100, 100, (4, 5), generator=torch.Generator().manual_seed(r), dtype=dtype)
                for r in range(size)]
    mine, total = per_rank[rank], sum(t.to(torch.float64) for t in per_rank)
    pre = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.37)
    assert pre.dtype == dtype
    assert torch.equal(pre, sum((t.to(torch.float64) * 0.37).to(dtype) for t in per_rank))
    post = hvd.allreduce(mine, op=hvd.Sum, postscale_factor=0.37)
    assert post.dtype == dtype and torch.equal(post, (total * 0.37).to(dtype))
    averaged = hvd.allreduce(mine)  # the default op, Average
    assert averaged.dtype == dtype and torch.equal(averaged, (total / size).to(dtype))
    assert torch.equal(hvd.allreduce(mine, average=True), averaged)
    both = hvd.allreduce(mine, op=hvd.Average, prescale_factor=3, postscale_factor=0.5)
    assert both.dtype == dtype
    assert torch.equal(both, (sum((t.to(torch.float64) * 3).to(dtype) for t in per_rank).to(torch.float64)
                              / size * 0.5).to(dtype))
    assert torch.equal(hvd.allreduce(per_rank[0], op=hvd.Average), per_rank[0])  # Horovod's own check
    t = mine.clone()
    assert hvd.allreduce_(t, prescale_factor=2) is t and torch.equal(
        t, (sum((p.to(torch.float64) * 2).to(dtype) for p in per_rank).to(torch.float64) / size).to(dtype))
    assert hvd.allreduce(mine, op=hvd.Max, prescale_factor=2).dtype == dtype
    # the library's own mean and Adasum still refuse integers (SPEC §4), on every rank
    with pytest.raises(TypeError, match="integer dtype"):
        adasum.adasum_allreduce(mine, op="mean")
    with pytest.raises(TypeError, match="integer dtype"):
        hvd.allreduce(mine, op=hvd.Adasum)




# --- sparse gradients (nn.Embedding(sparse=True)) in DistributedOptimizer -------------------------------------

class _Embeddings(torch.nn.Module):
    """Two embeddings and a linear layer; rank 1 does not use the second embedding (no gradient there).
    Every value is a multiple of 1/8 and small (float64), so are the gradients and updates: every sum is
    exact, whatever the order of its additions (a sparse gradient adds its rows in another order)."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.words = torch.nn.Embedding(10, 3, sparse=sparse)
        self.tags = torch.nn.Embedding(6, 3, sparse=sparse)
        self.out = torch.nn.Linear(3, 2)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-16, 17, p.shape, generator=g) / 8)

    def forward(self, words, tags):
        x = self.words(words).sum(1)
        if tags is not None:
            x = x + self.tags(tags).sum(1)
        return self.out(x)


def _sparse_batches(rank: int, steps: int):
    """Per step: word and tag indices (rank 1 has no tags), overlapping between the ranks, and integer
    weights for the loss, so that the gradients are exact sums whatever the order of the additions."""
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        words = torch.randint(0, 10, (4, 3), generator=g)
        tags = None if rank == 1 else torch.randint(0, 6, (4, 2), generator=g)
        weights = torch.randint(-3, 4, (4, 2), generator=g).double()
        yield words, tags, weights


def _train_embeddings(rank: int, sparse: bool, op, steps: int = 3, synchronize: bool = False, **kwargs):
    model = _Embeddings(sparse).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25),
                                   named_parameters=model.named_parameters(), op=op, **kwargs)
    grads = []
    for words, tags, weights in _sparse_batches(rank, steps):
        opt.zero_grad()
        (model(words, tags) * weights).sum().backward()
        if synchronize:
            opt.synchronize()
            grads.append([None if p.grad is None else p.grad.to_dense().clone() for p in model.parameters()])
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return model, opt, grads


def _exact_steps(op, size: int, steps: int) -> int:
    """``steps`` where every value stays a multiple of a power of two, so that every sum is exact in any
    order (Sum; Average at a power-of-two size); else 1 (Adasum; Average at another size): the first update
    is still the same (the same exact sums, divided or combined the same way), later sums would round."""
    return steps if op == hvd.Sum or (op == hvd.Average and size & (size - 1) == 0) else 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Adasum])
@TRAINING_SIZES
def test_sparse_embedding_gradients_train_as_dense_ones(comm, op, sparse_as_dense):
    """nn.Embedding(sparse=True) through DistributedOptimizer gives, bit for bit, what the same model with
    dense embeddings gives: the sparse gradients are gathered and summed (averaged) over the ranks, or reduced
    dense with sparse_as_dense; with Adasum each rank's local step takes its own sparse gradient. A rank that
    did not use an embedding (no gradient) still gets the reduced one."""
    rank = comm.Get_rank()
    steps = _exact_steps(op, comm.Get_size(), 3)
    sparse, opt, _ = _train_embeddings(rank, True, op, steps, sparse_as_dense=sparse_as_dense)
    dense, _, _ = _train_embeddings(rank, False, op, steps)
    assert sparse.words.weight.grad.is_sparse
    assert [raw_bytes(p) for p in sparse.parameters()] == [raw_bytes(p) for p in dense.parameters()]
    assert not torch.equal(sparse.tags.weight, _Embeddings(True).double().tags.weight)  # it trained
    assert opt.skipped_updates == 0
    assert_identical_across_ranks(comm, list(sparse.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@TRAINING_SIZES
def test_synchronize_reduces_sparse_gradients_once(comm, op):
    """Horovod's synchronize() / skip_synchronize() pattern with sparse gradients: after synchronize() every
    rank holds the reduced gradient (the dense reference's, bit for bit) and step() does not reduce it again."""
    rank = comm.Get_rank()
    steps = _exact_steps(op, comm.Get_size(), 2)
    with adasum.count_traffic(comm) as traffic:
        sparse, _, grads = _train_embeddings(rank, True, op, steps=steps, synchronize=True)
    dense, _, reference = _train_embeddings(rank, False, op, steps=steps, synchronize=True)
    assert [raw_bytes(p) for p in sparse.parameters()] == [raw_bytes(p) for p in dense.parameters()]
    for got, want in zip(grads, reference):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # per step: the dense allreduce of the linear layer's gradients (and the flags), never of the embeddings
    linear = sum(p.numel() for p in sparse.out.parameters()) * 8
    assert traffic.allreduce_bytes < steps * 2 * (linear + 8 * 3)


@pytest.fixture
def stall_timeout():
    old = adasum.configure(stall_timeout=20.0)
    yield
    adasum.configure(old)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_sparse_gradient_on_one_rank_and_dense_on_another_raises_everywhere(comm, stall_timeout):
    """Where a parameter's gradient is sparse on one rank and dense on another, every rank raises ValueError
    naming the parameter and the ranks (before anything is reduced), and the optimizer stays usable."""
    rank = comm.Get_rank()
    emb = torch.nn.Embedding(5, 2, sparse=rank != 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), op=hvd.Average)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=rf"\(raised on rank {rank}\) rank 1: parameter 'weight' \(shape \(5, 2\)\) "
                                         r"has a dense gradient here and a sparse one on rank 0"):
        opt.step()
    assert torch.equal(emb.weight, before)
    opt.zero_grad()
    emb.weight.grad = None
    opt.step()  # no gradient anywhere: nothing to reduce, and the calls still match
    assert torch.equal(emb.weight, before)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
@ONE_SIZE
def test_nonfinite_sparse_gradient_skips_the_update_everywhere(comm, sparse_as_dense):
    """A NaN in one rank's sparse gradient: the reduced gradient holds it on every rank, so every rank skips
    the update (parameters unchanged, skipped_updates counts it), as for a dense gradient."""
    rank = comm.Get_rank()
    model = _Embeddings(True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25), op=hvd.Average,
                                   sparse_as_dense=sparse_as_dense)
    before = [p.detach().clone() for p in model.parameters()]
    words, tags, weights = next(_sparse_batches(rank, 1))
    if rank == comm.Get_size() - 1:
        weights[0, 0] = float("nan")
    (model(words, tags) * weights).sum().backward()
    opt.step()
    assert opt.step_was_skipped and opt.skipped_updates == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
