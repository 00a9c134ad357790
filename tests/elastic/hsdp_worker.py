"""HSDP (FSDP2 over the shard dimension of a 2×2 mesh, Adasum across the replicas) in elastic training,
launched by tests/elastic/test_paths.py under Open MPI with ULFM::

    mpiexec --with-ft ulfm -n 4 python tests/elastic/hsdp_worker.py --form hook --kill 3@3 --out result.json

``--form hook`` reduces with ``adasum_replicas`` (a plain SGD), ``--form deltas`` with ``ReplicaDeltas``.
``--kill R@S``: the rank ``R`` SIGKILLs itself at step ``S``, after its forward, while the others are
inside backward (FSDP's reduce-scatter over gloo, the replicas' reduction over MPI). Elastic training does
not go on with a sharded model: every survivor must raise ``adasum.torch.elastic.ShardsLost`` from
``run``, within seconds. Each process writes ``--out``.rank{R} with what it raised and when (or that it
finished, where nobody died).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
from mpi4py import MPI

import adasum
import adasum.torch as at
from adasum.torch import elastic
from adasum.torch.fsdp import ReplicaDeltas, adasum_replicas

STEPS, COMMIT_EVERY = 6, 2
ME = MPI.COMM_WORLD.Get_rank()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + ME)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def build(form: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.a, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if form == "hook":
        adasum_replicas(model, mesh)
        return model, opt, opt
    return model, ReplicaDeltas(opt, model, mesh), opt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--form", choices=["hook", "deltas"], default="hook")
    p.add_argument("--kill", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    who, at_step = (int(x) for x in args.kill.split("@")) if args.kill else (None, None)
    adasum.configure(stall_timeout=60.0)
    at.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, opt, inner = build(args.form)
    state = elastic.State(model, opt, step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            x, y = batch(state.step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if ME == who and state.step == at_step:
                time.sleep(0.5)  # the others are inside backward by now
                with open(f"{args.out}.killed.{ME}", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    outcome = {"rank": ME, "raised": None, "message": None, "at": None}
    try:
        train(state)
    except Exception as exc:  # noqa: BLE001 - what the test checks
        outcome.update(raised=type(exc).__name__, message=str(exc), at=time.time(),
                       size=elastic.world().Get_size())
    outcome["steps"] = state.step
    with open(f"{args.out}.rank{ME}", "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main()
