"""What the FSDP2 tests share (tests/training/test_fsdp.py, test_fsdp_deltas.py): a small model whose
parameters FSDP pads and flattens in a non-trivial order, its per-rank batches, the 2-D meshes, sharding,
a training loop and the comparison."""

from __future__ import annotations

import numpy as np
import torch

STEPS, LR = 8, 0.05
MESHES = [(2, 2), (4, 1)]


class Net(torch.nn.Module):
    """Two blocks (each its own FSDP module), row counts that 2 does not divide (padded shards), and the
    root's own parameters, a sub-module's before its own (the order in which FSDP flattens them)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.c = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x)))) * self.scale


def batch(step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


_MESHES: dict = {}


def make_mesh(shape):
    """The mesh of ``shape``, made once while the process group lives (every ``init_device_mesh`` makes new
    process groups, which live as long as the world's: a module's tests would make dozens)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.group.WORLD
    made = _MESHES.get(shape)
    if made is None or made[0] is not world:
        made = _MESHES[shape] = (world, init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    return made[1]


def shard(model: Net, mesh, **kw) -> Net:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.a, mesh=mesh, **kw)
    fully_shard(model.b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def train(model, opt, rank: int, steps: int = STEPS, micro: int = 1) -> None:
    for step in range(steps):
        for m in range(micro):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(m == micro - 1)
            x, y = batch(step, rank, m)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def full(model) -> list[np.ndarray]:
    out = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(t.detach().to(torch.float64).numpy().copy())
    return out


def assert_close(got, want, rtol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert err <= rtol, f"parameter {i}: relative error {err:.3g} > {rtol}"
