"""Every training path with a compiled model (``torch.compile(model)``, inductor on CPU) against the same run
uncompiled: DistributedOptimizer (with and without overlap, accumulation, local steps), the DDP gradient and
delta hooks, the Lightning strategy and FSDP2 across replicas (the gradient hook and the delta form). The
two runs agree within the compiler's rounding (inductor fuses and reorders float32 arithmetic), and every
rank ends with the same model.

One model class and one input shape throughout: dynamo compiles the class's graphs once per process and
reuses them for every instance (parameters are graph inputs), so compile time is paid once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import adasum.torch as at
from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook

from helpers import assert_identical_across_ranks

pytestmark = pytest.mark.mpi

RTOL = 2e-5  # the compiler's rounding, carried through a few steps


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def fresh() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def batches(rank: int, n: int):
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def assert_close(got: torch.nn.Module, want: torch.nn.Module, rtol: float = RTOL) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        a, b = _full(a), _full(b)
        err = float((a - b).norm() / b.norm())
        assert err <= rtol, f"{name}: relative difference {err:.3g} between compiled and eager > {rtol}"
    moved = [not torch.equal(_full(a), _full(b)) for a, b in zip(got.parameters(), fresh().parameters())]
    assert all(moved), "training did not change every parameter"


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(torch.float64)


def optimizer_run(comm, compiled: bool, **kw) -> tuple[torch.nn.Module, int]:
    """The trained model and how many boundaries reduced their buckets during backward."""
    model = fresh()
    run = torch.compile(model) if compiled else model
    k = kw.get("accumulation_steps", 1)
    opt = at.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  bucket_bytes=256, **kw)
    for x, y in batches(comm.Get_rank(), 4 * k * kw.get("local_steps", 1)):
        torch.nn.functional.mse_loss(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    overlapped = opt.overlapped_boundaries
    opt.close()
    return model, overlapped


@pytest.mark.world_size(2, 3)
@pytest.mark.parametrize("kw", [{}, {"overlap": True}, {"accumulation_steps": 2},
                                {"overlap": True, "accumulation_steps": 2}, {"local_steps": 2},
                                {"op": "mean"}],
                         ids=["plain", "overlap", "accumulation", "overlap+accumulation", "local-steps", "mean"])
def test_distributed_optimizer(comm, kw):
    compiled, overlapped = optimizer_run(comm, True, **kw)
    eager, eager_overlapped = optimizer_run(comm, False, **kw)
    assert_close(compiled, eager)
    assert_identical_across_ranks(comm, list(compiled.parameters()))
    # with overlap, the compiled backward's gradients still start their buckets during backward
    assert overlapped == eager_overlapped and (overlapped > 0) == bool(kw.get("overlap"))


def ddp_run(comm, compiled: bool, delta: bool) -> torch.nn.Module:
    model = fresh()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = DeltaState(opt) if delta else AdasumState()
    ddp.register_comm_hook(state, adasum_delta_hook if delta else adasum_hook)
    run = torch.compile(ddp) if compiled else ddp
    for x, y in batches(comm.Get_rank(), 4):
        torch.nn.functional.mse_loss(run(x), y).backward()
        if not delta:
            opt.step()
        opt.zero_grad()
    state.close()
    return model


@pytest.mark.world_size(2, 3)
@pytest.mark.parametrize("delta", [False, True], ids=["gradient-hook", "delta-hook"])
def test_ddp_hooks(comm, pg, delta):
    compiled = ddp_run(comm, True, delta)
    assert_close(compiled, ddp_run(comm, False, delta))
    assert_identical_across_ranks(comm, list(compiled.parameters()))


def fsdp_run(comm, compiled: bool, form: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from adasum.torch.fsdp import ReplicaDeltas, adasum_replicas

    mesh = init_device_mesh("cpu", (2, comm.Get_size() // 2), mesh_dim_names=("replicate", "shard"))
    model = fresh()
    fully_shard(model.a, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    run = torch.compile(model) if compiled else model
    if form == "hook":
        hooks, opt = adasum_replicas(model, mesh), torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        hooks = opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, mesh)
    for x, y in batches(comm.Get_rank(), 4):
        torch.nn.functional.mse_loss(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    hooks.close()
    return model


@pytest.mark.world_size(4)
@pytest.mark.fsdp
@pytest.mark.parametrize("form", ["hook", "deltas"])
def test_fsdp_replicas(comm, pg, form):
    compiled = fsdp_run(comm, True, form)
    assert_close(compiled, fsdp_run(comm, False, form))
    assert_identical_across_ranks(comm, [_full(p) for p in compiled.parameters()])


LIGHTNING_MODULE_REFUSED = (
    "Lightning refuses a compiled LightningModule (torch.compile(module) passed to fit) with any strategy "
    "that is not SingleDeviceStrategy, DDPStrategy or FSDPStrategy (lightning.pytorch.utilities.compile."
    "_verify_strategy_supports_compile, an isinstance check); AdasumStrategy is a ParallelStrategy. Compile "
    "the network inside the module instead (the 'inner' case)")


@pytest.mark.frameworks
@pytest.mark.world_size(2, 3)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", ["inner", pytest.param("module", marks=pytest.mark.xfail(
    strict=True, raises=RuntimeError, reason=LIGHTNING_MODULE_REFUSED))])
def test_lightning_strategy(comm, overlap, how):
    """``how="inner"``: the LightningModule holds ``torch.compile(net)``; ``"module"``: the compiled
    LightningModule goes to ``fit``."""
    L = pytest.importorskip("lightning")
    from adasum.lightning import AdasumStrategy

    class Module(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(compiled: bool) -> torch.nn.Module:
        net = fresh()
        module = Module(torch.compile(net) if compiled and how == "inner" else net)
        xs, ys = zip(*batches(comm.Get_rank(), 4))  # this rank's own batches (no distributed sampler)
        data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=6)
        trainer = L.Trainer(strategy=AdasumStrategy(overlap=overlap), accelerator="cpu", max_epochs=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(torch.compile(module) if compiled and how == "module" else module, data)
        return net

    compiled = fit(True)
    assert_close(compiled, fit(False))
    assert_identical_across_ranks(comm, list(compiled.parameters()))
