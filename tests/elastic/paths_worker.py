"""Every training path in elastic training, launched by tests/elastic/test_paths.py under Open MPI with ULFM::

    mpiexec --with-ft ulfm -n 4 python tests/elastic/paths_worker.py --kill 3@3 --kill 1@5 --kill 0@3 --out r.json

Three phases in one job (the elastic stage's time), each an ``adasum.torch.elastic.run``, and one death in
each. ``--kill R@S`` (one per phase, in order): the rank of ``MPI.COMM_WORLD`` ``R`` SIGKILLs itself at
step ``S`` of that phase, after its forward, while the others are inside backward.

1. HSDP on a 2×2 mesh (FSDP2 over the shard dimension, ``adasum_replicas``) at the launch size: elastic
   training does not go on with a sharded model, and every survivor must raise ``ShardsLost`` from ``run``
   within seconds; the survivors then start the process group again on their world and go on.
2. DDP with the gradient hook (``AdasumState``, ``adasum_hook``, SGD with momentum stepping on the reduced
   gradients) in an :class:`~adasum.torch.elastic.ElasticDDP` model on those survivors.
3. DDP with the delta hook (``DeltaState``, ``adasum_delta_hook``: the optimizer steps inside backward) on
   the survivors of 2.

Before the DDP phases every rank trains both phases' references with nobody dying: torch.distributed groups
(``new_group``) and MPI communicators (``Split``) of each phase's ranks, the dead rank leaving at the commit
its death rolls back to, the others going on with rank 0's model and optimizer state (what ``State.sync()``
gives), a new DDP model and hook state. Each DDP phase must end bitwise where its reference ends. Rank 0 of
the final world writes ``--out``: what each survivor of phase 1 raised and when, and each DDP phase's
outcome. The processes' exit after three deaths waits for ``MPI_Finalize`` at most 2 s (Open MPI's
finalize fence may not end after several deaths; what that patience is for, tests/elastic/test_no_hang.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import adasum
import adasum.torch as at
from adasum.runtime import exchange
from adasum.torch import elastic
from adasum.runtime import membership
from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook
from adasum.torch.fsdp import adasum_replicas

STEPS, COMMIT_EVERY, DIM = 8, 2, 16
FORMS = ("grad", "delta")
TIMEOUT = timedelta(seconds=30)  # every gloo wait of the job bounded
ME = MPI.COMM_WORLD.Get_rank()
OUT = [""]


def data(ident: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ident + step)
    x = torch.randn(32, DIM, generator=g)
    return x, x @ torch.linspace(-1.0, 1.0, DIM)[:, None] + 0.01 * torch.randn(32, 1, generator=g)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return net, torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.5)


def hook(form: str, opt, comm=None):
    """(hook state, hook) of ``form`` on ``comm`` (None: the current world)."""
    if form == "grad":
        return AdasumState(comm=comm), adasum_hook
    return DeltaState(opt, comm=comm), adasum_delta_hook


def evaluate(net) -> float:
    x, y = data(999, 0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), y))


def die() -> None:
    with open(f"{OUT[0]}.killed.{ME}", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def one_step(model, opt, form: str, step: int, dies: bool, batch=None) -> None:
    x, y = data(ME, step) if batch is None else batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    if dies:
        time.sleep(0.5)  # the others are inside backward's reduction by now
        die()
    loss.backward()
    if form == "grad":
        opt.step()
    opt.zero_grad()  # after the step: a reset must drop what a backward cut short left


def kills(specs: list[str]) -> list[tuple[int, int]]:
    """(rank, step) of each phase's death."""
    return [tuple(int(x) for x in spec.split("@")) for spec in specs]


def params_bytes(net) -> bytes:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().tobytes()


def sync(net, opt, comm) -> None:
    """What ``State.sync()`` gives: rank 0's model and optimizer state on every rank of ``comm``."""
    at.broadcast_parameters(net.state_dict(), root=0, comm=comm)
    at.broadcast_optimizer_state(opt, root=0, comm=comm)


class Reference:
    """One phase trained with nobody dying: over the ranks ``members`` (of MPI.COMM_WORLD, in order), the
    rank ``gone`` leaving before step ``leave`` (the commit its death rolls back to). Collective over the
    current world and torch's default group (every process takes part in making the groups)."""

    def __init__(self, form: str, members: list[int], gone: int, leave: int):
        self.form, self.members, self.gone, self.leave = form, members, gone, leave
        self.net, self.opt = make()
        self.model = self.state = self.comm = None
        self.losses: list[float] = []

    def regroup(self, members: list[int]) -> None:
        if self.state is not None:
            self.state.abandon("the reference's world changed")
            self.model.__dict__.pop("logger", None)
            self.model.__dict__.pop("reducer", None)
        group = dist.new_group(members)  # every process of the default group takes part
        comm = elastic.world().Split(0 if ME in members else MPI.UNDEFINED, members.index(ME) if ME in members else 0)
        self.comm = None if comm == MPI.COMM_NULL else comm
        self.model = self.state = None
        if self.comm is None:
            return
        sync(self.net, self.opt, self.comm)
        self.model = torch.nn.parallel.DistributedDataParallel(self.net, process_group=group)
        self.state, fn = hook(self.form, self.opt, self.comm)
        self.model.register_comm_hook(self.state, fn)

    def train(self) -> bytes | None:
        self.regroup(self.members)
        for step in range(STEPS):
            if step == self.leave:
                self.regroup([r for r in self.members if r != self.gone])
            if self.comm is None:
                continue
            one_step(self.model, self.opt, self.form, step, False)
            if (step + 1) % COMMIT_EVERY == 0:
                self.losses.append(evaluate(self.net))
        if self.comm is None:
            return None
        self.state.close()
        return params_bytes(self.net)


class Sharded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def hsdp_phase(die_at: int | None) -> dict:
    """Phase 1 (the module docstring): what ``run`` raised on this rank, and when."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Sharded()
    fully_shard(model.a, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    adasum_replicas(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = elastic.State(model, opt, step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            g = torch.Generator().manual_seed(1000 * state.step + ME)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            one_step(model, opt, "grad", state.step, state.step == die_at, batch=(x, y))
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    try:
        train(state)
    except elastic.ShardsLost as exc:
        return {"rank": ME, "raised": type(exc).__name__, "message": str(exc), "at": time.time(),
                "size": elastic.world().Get_size()}
    return {"rank": ME, "raised": None, "size": elastic.world().Get_size()}


def train_elastic(form: str, die_at: int | None) -> tuple[elastic.State, elastic.ElasticDDP]:
    net, opt = make()
    model = elastic.ElasticDDP(net, lambda: hook(form, opt), timeout=TIMEOUT)
    state = elastic.State(model, opt, step=0, losses=[])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            one_step(model, opt, form, state.step, state.step == die_at)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.losses.append(evaluate(net))
                state.commit()

    train(state)
    return state, model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    adasum.configure(stall_timeout=60.0)
    run_paths(args.kill, args.out)


def run_paths(kill: list[str], out: str) -> None:
    """The three phases (the module docstring), ``kill`` the ``--kill`` of each, the result in ``out``;
    collective over MPI.COMM_WORLD, nobody dead yet (tests/elastic/worker.py calls it after its own run)."""
    OUT[0] = out
    membership.FINALIZE_PATIENCE = 2.0  # the module docstring
    at.init_process_group("gloo", timeout=TIMEOUT)
    (hsdp_gone, hsdp_step), *ddp_kills = kills(kill)
    mine = hsdp_phase(hsdp_step if ME == hsdp_gone else None)
    sharded = exchange.allgather(elastic.world(), mine)  # the survivors' world
    elastic.restart_process_group(timeout=TIMEOUT)  # the survivors' own (run destroyed the old one)
    members, references = [r for r in range(MPI.COMM_WORLD.Get_size()) if r != hsdp_gone], []
    for form, (gone, step) in zip(FORMS, ddp_kills):
        ref = Reference(form, members, gone, step - step % COMMIT_EVERY)
        references.append((ref.train(), ref.losses))
        members = [r for r in members if r != gone]
    phases = []
    for (form, (gone, step)), (ref, ref_losses) in zip(zip(FORMS, ddp_kills), references):
        state, model = train_elastic(form, step if ME == gone else None)
        params = params_bytes(model.module)
        mine = {"rank": ME, "resets": state.resets, "params": params, "losses": state.losses,
                "reference_equal": params == ref, "reference_losses": ref_losses,
                "recovery_s": state.last_recovery_seconds, "size": elastic.world().Get_size(),
                "torch_size": dist.get_world_size()}
        phases.append(exchange.allgather(elastic.world(), mine))
        model.close()
    if elastic.world().Get_rank() == 0:
        write(out, sharded, phases)


def write(out: str, sharded: list, phases: list) -> None:
    result = {"hsdp": sharded, "ddp": []}
    for everyone in phases:
        first = everyone[0]
        result["ddp"].append({"size": first["size"], "torch_size": first["torch_size"],
                       "survivors": [m["rank"] for m in everyone], "resets": [m["resets"] for m in everyone],
                       "equal": all(m["params"] == first["params"] for m in everyone),
                       "reference_equal": [m["reference_equal"] for m in everyone],
                       "losses": [m["losses"] for m in everyone], "reference_losses": first["reference_losses"],
                       "recovery_s": [m["recovery_s"] for m in everyone]})
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
