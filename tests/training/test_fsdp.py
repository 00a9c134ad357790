"""FSDP2 with Adasum across replicas (``adasum.torch.fsdp.adasum_replicas``) at 4 ranks, meshes 2×2 and 4×1:
SGD against a serial reference (each replica's gradient the mean of its ranks' micro-batch gradients, the
tree over replicas on whole parameters), ``op="mean"`` against native HSDP, ``op="sum"``, bf16 reductions,
accumulation without sync, the schedule on its own (cut layers, three replicas, CUDA), and the errors every
rank raises. The delta form: test_fsdp_deltas.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.world_size(4), pytest.mark.fsdp]

fsdp = pytest.importorskip("torch.distributed.fsdp")

from adasum.rule.reference import tree_combine  # noqa: E402
from adasum.torch.fsdp import adasum_replicas, replica_comms  # noqa: E402

from helpers import assert_identical_across_ranks  # noqa: E402
from fsdp_helpers import (LR, MESHES, STEPS, assert_close, batch, fresh, full, make_mesh, shard,  # noqa: E402
                          train)


def reference(shape, op: str, micro: int = 1, dtype: str | None = "float32", model=None) -> list[np.ndarray]:
    """The serial reference: replica g's gradient is the mean over its ranks g·S … g·S+S-1 of their
    gradients (summed over the micro-batches), the replicas' gradients combined per whole parameter.
    ``model``: the unsharded start (default :func:`fresh`); its frozen parameters stay as they are."""
    replicas, shards = shape
    model = fresh() if model is None else model
    trained = [p for p in model.parameters() if p.requires_grad]
    for step in range(STEPS):
        per_replica = []
        for g in range(replicas):
            grads = []
            for rank in range(g * shards, (g + 1) * shards):
                model.zero_grad()
                for m in range(micro):
                    x, y = batch(step, rank, m)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.to(torch.float64).numpy().copy() for p in trained])
            per_replica.append([np.mean(layer, axis=0) for layer in zip(*grads)])
        with torch.no_grad():
            for i, p in enumerate(trained):
                layer = [r[i].astype(np.float32).astype(np.float64) for r in per_replica]
                if op == "adasum":
                    g = tree_combine(layer, dtype=dtype).reshape(p.shape)
                elif op == "sum":
                    g = np.sum(layer, axis=0)
                else:
                    g = np.mean(layer, axis=0)
                p -= LR * torch.from_numpy(g).to(p.dtype)
    return [p.detach().to(torch.float64).numpy() for p in model.parameters()]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ["adasum", "sum"])
def test_against_serial_reference(pg, comm, shape, op):
    mesh = make_mesh(shape)
    model = shard(fresh(), mesh["shard"])
    hooks = adasum_replicas(model, mesh, op=op)
    train(model, torch.optim.SGD(model.parameters(), lr=LR), comm.Get_rank())
    got = full(model)
    hooks.close()
    assert_close(got, reference(shape, op), 1e-5)
    assert_identical_across_ranks(comm, got)


@pytest.mark.world_size(2)
@pytest.mark.smoke
def test_two_replicas_of_one_shard_against_serial_reference(pg, comm):
    """The same on a mesh 2×1 at 2 ranks (each replica one unsharded rank): the smoke test of the hooks."""
    test_against_serial_reference(pg, comm, (2, 1), "adasum")


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_adasum_differs_from_mean(pg, comm, shape):
    """A property the reference alone would not show: the replicas' gradients are not collinear, so Adasum
    and the mean give different models (the test above could not pass with a mean)."""
    assert max(np.abs(a - b).max() for a, b in zip(reference(shape, "adasum"), reference(shape, "mean"))) > 1e-4


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mean_equals_native_hsdp(pg, comm, shape):
    mesh = make_mesh(shape)
    ours = shard(fresh(), mesh["shard"])
    hooks = adasum_replicas(ours, mesh, op="mean")
    train(ours, torch.optim.SGD(ours.parameters(), lr=LR), comm.Get_rank())
    native = shard(fresh(), mesh)
    train(native, torch.optim.SGD(native.parameters(), lr=LR), comm.Get_rank())
    assert_close(full(ours), full(native), 1e-6)
    hooks.close()


def test_accumulation_without_sync(pg, comm):
    """Two micro-batches, the first with ``set_requires_gradient_sync(False)``: the hook runs once per
    step, on the sum of both micro-batches' gradients."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    hooks = adasum_replicas(model, mesh)
    train(model, torch.optim.SGD(model.parameters(), lr=LR), comm.Get_rank(), micro=2)
    hooks.close()
    assert_close(full(model), reference((2, 2), "adasum", micro=2), 1e-5)


def test_bf16_reduce_dtype(pg, comm):
    """A mixed precision policy that reduces in bf16: the hook combines bf16 shards (float64 arithmetic,
    each level stored in bf16), close to the float32 reference at bf16's precision."""
    mesh = make_mesh((2, 2))
    policy = fsdp.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    model = shard(fresh(), mesh["shard"], mp_policy=policy)
    hooks = adasum_replicas(model, mesh)
    train(model, torch.optim.SGD(model.parameters(), lr=LR), comm.Get_rank())
    hooks.close()
    got = full(model)
    assert_close(got, reference((2, 2), "adasum"), 2e-2)
    assert_identical_across_ranks(comm, got)


def test_schedule_whole_layer_dots(comm):
    """The schedule alone, on a 2×2 layout: two layers of 7 elements cut 4 + 3 (+ 1 of padding) over each
    replica's two ranks give the whole-layer Adasum of the replicas' vectors; the padding stays zero."""
    from adasum.torch.fsdp.tree import ReplicaTree

    g, i = divmod(comm.Get_rank(), 2)
    shard, replicate = comm.Split(g, i), comm.Split(i, g)
    rng = np.random.default_rng(7)
    whole = rng.standard_normal((2, 2, 7))  # [replica][layer]

    def cut(v):
        return v[:4] if i == 0 else np.concatenate([v[4:], [0.0]])

    mine = torch.tensor(np.concatenate([cut(whole[g][0]), cut(whole[g][1])]))
    ReplicaTree(replicate, shard, "adasum").reduce_(mine, (4, 4))
    pieces = comm.allgather(mine.numpy())
    for layer in range(2):
        want = tree_combine([whole[0][layer], whole[1][layer]])
        for h in range(2):
            lo, hi = pieces[2 * h][4 * layer:4 * layer + 4], pieces[2 * h + 1][4 * layer:4 * layer + 4]
            np.testing.assert_allclose(np.concatenate([lo, hi[:3]]), want, rtol=1e-12)
            assert hi[3] == 0.0
    assert np.array_equal(pieces[0], pieces[2]) and np.array_equal(pieces[1], pieces[3])
    shard.Free()
    replicate.Free()


def test_native_hsdp_refused(pg, comm):
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh)
    with pytest.raises(ValueError, match=r'fully_shard\(module, mesh=mesh\["shard"\]\)') as info:
        adasum_replicas(model, mesh)
    assert "native HSDP" in str(info.value)


def test_bad_mesh_refused(pg, comm):
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    model = shard(fresh(), flat)
    with pytest.raises(ValueError, match="2-D"):
        adasum_replicas(model, flat)
    mesh = make_mesh((2, 2))
    with pytest.raises(ValueError, match=r"sharded over ranks \[0, 1, 2, 3\]"):
        adasum_replicas(model, mesh)  # sharded over 4 ranks, mesh["shard"] holds 2


def test_mismatch_between_ranks_raises_everywhere(pg, comm):
    """Rank 3 has an extra parameter: every rank raises, naming rank 3 and the parameter."""
    mesh = make_mesh((2, 2))
    model = fresh()
    if comm.Get_rank() == 3:
        model.b.extra = torch.nn.Parameter(torch.zeros(2))
    shard(model, mesh["shard"])
    with pytest.raises(ValueError, match="rank 3: FSDP module b with 3 parameters, rank 0 has b with 2"):
        adasum_replicas(model, mesh)
    m22, m41 = make_mesh((2, 2)), make_mesh((4, 1))  # every rank makes both (collectively)
    other = m41 if comm.Get_rank() == 1 else m22
    model = shard(fresh(), other["shard"])
    with pytest.raises(ValueError, match=r"rank 1: mesh .* with ranks \[\[0\], \[1\], \[2\], \[3\]\]"):
        adasum_replicas(model, other)


def test_absent_rank_named(comm):
    """Rank 3 never enters the reduction: the ranks that wait for it raise AdasumStallError (after the
    setting ``stall_timeout``) instead of hanging; its replica partner names it."""
    import adasum
    from adasum.torch.fsdp.tree import ReplicaTree

    g, i = divmod(comm.Get_rank(), 2)
    replicate, shard = replica_comms(comm, [[0, 1], [2, 3]], g, i)
    old = adasum.configure(stall_timeout=2.0, stall_warning=None)
    try:
        if comm.Get_rank() != 3:
            with pytest.raises(adasum.AdasumStallError) as info:
                ReplicaTree(replicate, shard, "adasum").reduce_(torch.ones(4), (4,))
            if comm.Get_rank() == 1:
                assert "communicator 'replicate group 1, world ranks [1, 3]'" in str(info.value)
                assert "for rank 1, which has not entered it" in str(info.value)
    finally:
        adasum.configure(old)
    comm.Barrier()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_schedule_on_cuda_tensors_is_the_host_result(comm):
    """CUDA shards travel through host memory: the result on the device is the host schedule's, bitwise."""
    from adasum.torch.fsdp.tree import ReplicaTree

    g, i = divmod(comm.Get_rank(), 2)
    replicate, shard = replica_comms(comm, [[0, 1], [2, 3]], g, i)
    x = torch.randn(10, generator=torch.Generator().manual_seed(comm.Get_rank()))
    on_host, on_device = x.clone(), x.cuda()
    tree = ReplicaTree(replicate, shard, "adasum")
    tree.reduce_(on_host, (6, 4))
    tree.reduce_(on_device, (6, 4))
    assert torch.equal(on_device.cpu(), on_host)
    replicate.Free()
    shard.Free()


def test_schedule_three_replicas(comm):
    """Replicas that are not a power of two (3 of one rank each; rank 3 stays out): the fold of §3, weighted
    subtrees, every replica the serial tree's result, bitwise alike."""
    from mpi4py import MPI

    from adasum.torch.fsdp.tree import ReplicaTree

    rank = comm.Get_rank()
    replicate = comm.Split(0 if rank < 3 else MPI.UNDEFINED, rank)
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((3, 9))
    if replicate != MPI.COMM_NULL:
        mine = torch.tensor(vectors[rank], dtype=torch.float32)
        ReplicaTree(replicate, MPI.COMM_SELF, "adasum").reduce_(mine, (5, 4))
        rounded = [v.astype(np.float32).astype(np.float64) for v in vectors]
        want = np.concatenate([tree_combine([v[:5] for v in rounded], dtype="float32"),
                               tree_combine([v[5:] for v in rounded], dtype="float32")])
        np.testing.assert_allclose(mine.numpy(), want, rtol=1e-6)
        got = replicate.allgather(mine.numpy().tobytes())
        assert got == [got[0]] * 3
        replicate.Free()


def test_frozen_parameter(pg, comm):
    """A frozen parameter (``requires_grad=False``) has no gradient, so FSDP leaves it out of the buffer the
    hook gets: the others are still combined per layer, against the reference that never moves it."""
    mesh = make_mesh((2, 2))
    model = fresh()
    model.b.weight.requires_grad_(False)
    shard(model, mesh["shard"])
    hooks = adasum_replicas(model, mesh)
    train(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR), comm.Get_rank())
    hooks.close()
    want_model = fresh()
    want_model.b.weight.requires_grad_(False)
    assert_close(full(model), reference((2, 2), "adasum", model=want_model), 1e-5)


def test_unused_parameter_is_a_clear_error(pg, comm):
    """A parameter forward does not use has no gradient and cannot be told apart from its neighbours: every
    rank raises, naming the module and the element counts."""
    mesh = make_mesh((2, 2))
    model = fresh()
    model.b.spare = torch.nn.Linear(2, 2)  # never used in forward
    shard(model, mesh["shard"])
    hooks = adasum_replicas(model, mesh)
    x, y = batch(0, comm.Get_rank())
    with pytest.raises(RuntimeError, match="FSDP module b handed its hook shape .* use every parameter, or freeze"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    hooks.close()


def test_a_second_hook_is_refused_until_the_first_is_closed(pg, comm):
    """Two hooks on one model would leave the first handle's close() removing the second's hook: the second
    call raises on every rank; after close() the model takes a new one, which trains as the first would."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    first = adasum_replicas(model, mesh)
    with pytest.raises(ValueError, match=r"FSDP module \(root\) already runs the hook of adasum_replicas: close\(\)"):
        adasum_replicas(model, mesh)
    first.close()
    second = adasum_replicas(model, mesh)
    first.close()  # closed already: leaves the second's hooks in place
    train(model, torch.optim.SGD(model.parameters(), lr=LR), comm.Get_rank())
    second.close()
    assert_close(full(model), reference((2, 2), "adasum"), 1e-5)


def test_modules_sharded_together_are_refused(pg, comm):
    """``fully_shard([a, b])`` hands the hook one buffer for both modules: refused at the call, on every
    rank, saying what to do instead."""
    from torch.distributed.fsdp import fully_shard

    mesh = make_mesh((2, 2))
    model = fresh()
    fully_shard([model.a, model.b], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    with pytest.raises(ValueError, match=r"sharded together with 1 other module\(s\) .* or use ReplicaDeltas"):
        adasum_replicas(model, mesh)
