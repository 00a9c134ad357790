"""The window's rules on every path that closes a window through ``step()``, as one matrix (path × rule):

- a NaN on one rank's loss skips that update on every rank (counted; the parameters stay at the window's
  start), or with local steps that rank's local step (the window combines what it holds), and training
  goes on alike and finite on every rank;
- a rank that skips one ``step()`` makes every rank raise, naming the counts, at the latest at ``flush()``;
- the wrapped optimizer's step failing on one rank raises on every rank.

The FSDP2 paths have the same rules in tests/training/test_fsdp_rules.py (4 ranks), the DDP delta hook's
non-finite skip in test_ddp.py, a bad option on one rank in test_options.py, the Lightning strategy's in
tests/integrations/test_lightning.py."""

from __future__ import annotations

import math

import pytest
import torch

import adasum.horovod as hvd
from adasum.torch import DistributedOptimizer

from helpers import TRAINING_SIZES, assert_identical_across_ranks

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(300)]

# Each path: the DistributedOptimizer settings (or the Horovod wrapper) and how many step() calls a
# window of combines holds (local steps × accumulation).
PATHS = {
    "adasum": ({}, 1),
    "mean": ({"op": "mean"}, 1),
    "sum": ({"op": "sum"}, 1),
    "accumulation": ({"accumulation_steps": 2}, 2),
    "mean-accumulation": ({"op": "mean", "accumulation_steps": 2}, 2),
    "overlap": ({"overlap": True}, 1),
    "mean-overlap": ({"op": "mean", "overlap": True}, 1),
    "bf16-wire": ({"compression": "bf16"}, 1),
    "mean-fp16-wire": ({"op": "mean", "compression": "fp16"}, 1),
    "hierarchical": ({"hierarchical": True}, 1),
    "local-steps": ({"local_steps": 2}, 2),
    "mean-local-steps": ({"op": "mean", "local_steps": 2}, 2),
    "outer": ({"local_steps": 2, "outer_lr": 0.7, "outer_momentum": 0.5}, 2),
    "delay": ({"local_steps": 2, "delay": 1}, 2),
    "outer-optimizer": ({"local_steps": 2, "outer_optimizer": "nesterov"}, 2),
    "horovod-adasum": ({"horovod": hvd.Adasum}, 1),
    "horovod-average": ({"horovod": hvd.Average}, 1),
}


def net() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


class Flaky(torch.optim.SGD):
    """SGD with momentum whose step raises while ``fail`` is set."""

    fail = False

    def step(self, closure=None):
        if self.fail:
            raise FloatingPointError("the wrapped step failed")
        return super().step(closure)


def make(path: str, model: torch.nn.Module, comm):
    settings, per_window = PATHS[path]
    inner = Flaky(model.parameters(), lr=0.05, momentum=0.5)
    if "horovod" in settings:
        if not hvd.is_initialized():
            hvd.init()
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=settings["horovod"])
    else:
        if settings.get("outer_optimizer") == "nesterov":  # the user's torch optimizer as the outer one
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
            settings = dict(settings, outer_optimizer=outer)
        opt = DistributedOptimizer(inner, comm=comm, **settings)
    return opt, inner, per_window


def micro(model, rank: int, step: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * float("nan") if poison else loss).backward()


def values(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("path", list(PATHS))
@TRAINING_SIZES
def test_nan_on_one_rank_skips_the_update_on_every_rank(comm, path):
    model = net()
    opt, _, per = make(path, model, comm)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    step = 0
    for _ in range(2 * per):  # two windows
        micro(model, rank, step)
        opt.step()
        opt.zero_grad()
        step += 1
    local = "local_steps" in PATHS[path][0]
    start = values(model)
    for i in range(per):  # the third window: the last rank's last micro-batch is NaN
        micro(model, rank, step, poison=rank == last and i == per - 1)
        opt.step()
        opt.zero_grad()
        step += 1
    if not local:
        assert opt.step_was_skipped, f"rank {rank}: the update with a NaN on rank {last} was not skipped"
        assert all(torch.equal(a, b) for a, b in zip(values(model), start)), "the parameters moved"
    else:
        assert not opt.step_was_skipped
    for _ in range(2 * per):
        micro(model, rank, step)
        opt.step()
        opt.zero_grad()
        step += 1
    opt.flush()
    assert opt.skipped_updates == (0 if local else 1)
    got = values(model)
    assert all(bool(torch.isfinite(t).all()) for t in got)
    assert_identical_across_ranks(comm, got)
    opt.close()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.world_size(2)
def test_a_skipped_step_raises_on_every_rank(comm, path):
    model = net()
    opt, _, per = make(path, model, comm)
    rank = comm.Get_rank()
    # (with overlap, rank 0's zero_grad() before the step() of a closing backward is refused there)
    with pytest.raises(RuntimeError, match=r"the ranks' windows differ|the ranks are in different calls|"
                                           r"zero_grad\(\) after the backward that closes a window"):
        for step in range(6 * per):
            micro(model, rank, step)
            if not (rank == 0 and step == per + 1):  # rank 0 skips one step() in the second window
                opt.step()
            opt.zero_grad()
        opt.flush()
    opt.close(combine=False)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.world_size(2)
def test_a_failed_step_on_one_rank_raises_on_every_rank(comm, path):
    """The wrapped optimizer's step raises on rank 1. Adasum (the local step comes before the combine) and
    local steps: every rank raises it at that boundary's vote. sum/mean (the step comes after the
    reduction): rank 1 raises it there, and the other rank at its next collective with rank 1, which then
    stands in another call (here: flush()); nobody waits."""
    model = net()
    opt, inner, per = make(path, model, comm)
    rank = comm.Get_rank()
    for step in range(per):
        micro(model, rank, step)
        opt.step()
        opt.zero_grad()
    opt.flush()
    inner.fail = rank == 1
    raised = []  # as a loop that catches its errors and goes on: every rank makes the same calls
    for step in range(per, 4 * per):
        try:
            micro(model, rank, step)
            opt.step()
        except Exception as e:  # noqa: BLE001 - every rank must raise
            raised.append(str(e))
        opt.zero_grad()
    try:
        opt.flush()
    except Exception as e:  # noqa: BLE001
        raised.append(str(e))
    assert raised, f"rank {rank} raised nothing"
    settings = PATHS[path][0]
    gradients_first = (settings.get("op") in ("mean", "sum") and "local_steps" not in settings
                       or settings.get("horovod") is hvd.Average)
    assert "the wrapped step failed" in raised[0], raised[0]
    if rank != 1 and gradients_first:  # the others stepped: from the next boundary on, every rank says why
        assert "rank 1: its update" in raised[0] and "differ from the other ranks'" in raised[0], raised[0]
    inner.fail = False
    assert all(math.isfinite(float(t.sum())) for t in values(model))
    opt.close(combine=False)
