"""One elastic training job, launched by tests/elastic/test_elastic.py under Open MPI with ULFM::

    mpiexec --with-ft ulfm -n 4 python tests/elastic/worker.py --kill 1@1.2 --out result.json

``--kill R@E.B[:where]`` (repeatable): the rank of ``MPI.COMM_WORLD`` ``R`` SIGKILLs itself at epoch ``E``,
batch ``B``, ``where`` being ``before`` (between two steps, the default) or ``step`` (after its backward,
while the others are already inside ``optimizer.step()``'s combine). ``--api hvd`` trains through
``adasum.horovod``; ``--local-steps 4`` with ``DistributedOptimizer(local_steps=4)`` (and ``--delay 1``),
``--overlap`` with ``overlap=True``; ``--plain`` also trains
the same model without elastic first and records whether both end bitwise alike.

Rank 0 of the final world writes ``--out``: the world's size, the resets of each survivor, whether the
survivors' parameters are bitwise equal, the evaluation loss after each epoch, the recovery times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from mpi4py import MPI

import adasum
import adasum.horovod as hvd
from adasum.runtime import exchange
from adasum.runtime.elastic import world
from adasum.torch import elastic

EPOCHS, BATCHES, COMMIT_EVERY, DIM = 4, 8, 4, 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--api", choices=["native", "hvd"], default="native")
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--overlap", action="store_true", help="DistributedOptimizer(overlap=True): a lane")
    p.add_argument("--delay", type=int, default=0, help="DistributedOptimizer(delay=...) with --local-steps")
    p.add_argument("--out", required=True)
    return p.parse_args()


def kills(args) -> dict:
    """{(epoch, batch): where} of this rank's death, from ``--kill``."""
    me, out = MPI.COMM_WORLD.Get_rank(), {}
    for spec in args.kill:
        who, _, rest = spec.partition("@")
        at, _, where = rest.partition(":")
        epoch, batch = (int(x) for x in at.split("."))
        if int(who) == me:
            out[(epoch, batch)] = where or "before"
    return out


def data(rank: int, epoch: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a fixed linear problem, its own for each original rank (the shard does not move when the
    world shrinks: a dead rank's shard is simply not seen any more)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * epoch + batch)
    x = torch.randn(32, DIM, generator=g)
    w = torch.linspace(-1.0, 1.0, DIM)
    return x, x @ w[:, None] + 0.01 * torch.randn(32, 1, generator=g)


def make(args):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.api == "hvd":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       local_steps=args.local_steps)
    else:
        opt = adasum.torch.DistributedOptimizer(inner, op="adasum", local_steps=args.local_steps,
                                                overlap=args.overlap, delay=args.delay)
    return model, opt


def evaluate(model) -> float:
    x, y = data(999, 0, 0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def die() -> None:
    """SIGKILL this process, its time written beside the result first."""
    with open(f"{OUT[0]}.killed.{MPI.COMM_WORLD.Get_rank()}", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


OUT = [""]


def one_batch(model, opt, epoch: int, batch: int, die_here: str | None) -> None:
    if die_here == "before":
        die()
    x, y = data(MPI.COMM_WORLD.Get_rank(), epoch, batch)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if die_here == "step":
        time.sleep(0.5)  # the others are inside step()'s combine by now
        die()
    opt.step()


def train_elastic(args, model, opt, losses: list) -> elastic.State:
    die_at = kills(args)
    make_state = hvd.elastic.TorchState if args.api == "hvd" else elastic.State
    state = make_state(model, opt, epoch=0, batch=0)
    sizes = []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size() if args.api == "hvd" else adasum.size())])
    runner = hvd.elastic.run if args.api == "hvd" else elastic.run

    @runner
    def train(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                one_batch(model, opt, state.epoch, state.batch, die_at.get((state.epoch, state.batch)))
                state.batch += 1
                if state.batch % COMMIT_EVERY == 0:
                    state.commit()
            state.batch = 0
            state.epoch += 1
            if len(losses) < state.epoch:
                losses.append(evaluate(model))
            state.commit()

    train(state)
    state.sizes_at_reset = sizes
    return state


def train_plain(args) -> bytes:
    model, opt = make(args)
    adasum.torch.broadcast_parameters(model.state_dict())
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            one_batch(model, opt, epoch, batch, None)
    opt.flush()
    return params_bytes(model)


def params_bytes(model) -> bytes:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()


def main() -> None:
    args = parse()
    OUT[0] = args.out
    adasum.configure(stall_timeout=60.0)
    if args.api == "hvd":
        hvd.init()
    plain = train_plain(args) if args.plain else None
    model, opt = make(args)
    losses: list = []
    start = time.time()
    state = train_elastic(args, model, opt, losses)
    mine = {"rank": MPI.COMM_WORLD.Get_rank(), "resets": state.resets, "params": params_bytes(model),
            "recovery_s": state.last_recovery_seconds, "seen_at": state.last_failure_seen_at,
            "sizes_at_reset": state.sizes_at_reset, "losses": losses,
            "object": hvd.allgather_object(hvd.rank()) if args.api == "hvd" else None}
    everyone = exchange.allgather(world(), mine)
    if world().Get_rank() == 0:
        result = {"size": world().Get_size(), "survivors": [m["rank"] for m in everyone],
                  "resets": [m["resets"] for m in everyone],
                  "equal": all(m["params"] == mine["params"] for m in everyone),
                  "plain_equal": None if plain is None else plain == mine["params"],
                  "losses": [m["losses"] for m in everyone], "recovery_s": [m["recovery_s"] for m in everyone],
                  "seen_at": [m["seen_at"] for m in everyone], "sizes_at_reset": everyone[0]["sizes_at_reset"],
                  "objects": everyone[0]["object"], "hvd_size": hvd.size(), "seconds": time.time() - start}
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
