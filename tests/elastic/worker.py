"""One elastic training job, launched by tests/elastic/test_elastic.py under Open MPI with ULFM::

    mpiexec --with-ft ulfm -n 4 python tests/elastic/worker.py --kill 1@1.2 --out result.json

``--kill R@E.B[:where]`` (repeatable): the rank of ``MPI.COMM_WORLD`` ``R`` SIGKILLs itself at epoch ``E``,
batch ``B``, ``where`` being ``before`` (between two steps, the default), ``step`` (after its backward,
while the others are already inside ``optimizer.step()``'s combine), ``commit`` (a few milliseconds
after it entered the commit that follows that batch, inside the optimizer's ``flush()``), ``reset``
(inside the reset callbacks of the first recovery, a failure during the recovery itself; ``E.B`` then
names the batch of the death that recovery is from, so that the reference run drops both at one commit),
``stop`` (SIGSTOP instead of SIGKILL, between two steps: the others' stall timeout, ``--stall-timeout``,
must end it), ``raise`` (a RuntimeError raised by the training function there: the job ends, or under
``--on-error leave`` that rank leaves it, a death for the reference run) or ``mpierror`` (half a second
into the batch, an ``MPI.Exception`` of class ``ERR_OTHER`` raised in place of the step, as Open MPI's
nonblocking collectives give when a round meets a rank that just died: not a death of this rank).
``--no-reference`` skips the reference run (for jobs that must end). ``--api hvd``
trains through ``adasum.horovod``; ``--local-steps 4`` with ``DistributedOptimizer(local_steps=4)`` (and ``--delay 1``),
``--overlap`` with ``overlap=True``; ``--plain`` also trains the same model without elastic first and
records whether both end bitwise alike.

Every job first trains a reference without elastic and without a failure (:func:`train_reference`): the
world changes where the elastic run's resets say it does, at the commit each death rolls back to, the ranks
that die there simply leaving. The elastic run must end bitwise where the reference ends.

Rank 0 of the final world writes ``--out``: the world's size, the resets of each survivor, whether the
survivors' parameters are bitwise equal, and equal to the reference's, the evaluation loss after each epoch
(and the reference's), the recovery times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
from mpi4py import MPI

import adasum
import adasum.horovod as hvd
from adasum.runtime import exchange
from adasum.runtime.membership import world
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
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--on-error", choices=["end", "leave"], default="end", help="run(on_error=...)")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--out", required=True)
    return p.parse_args()


def deaths(args) -> list[tuple[int, int, int, str]]:
    """(rank, epoch, batch, where) of every ``--kill``."""
    out = []
    for spec in args.kill:
        who, _, rest = spec.partition("@")
        at, _, where = rest.partition(":")
        epoch, batch = (int(x) for x in at.split("."))
        out.append((int(who), epoch, batch, where or "before"))
    return out


def kills(args) -> dict:
    """{(epoch, batch): where} of this rank's death, from ``--kill``."""
    me = MPI.COMM_WORLD.Get_rank()
    return {(epoch, batch): where for who, epoch, batch, where in deaths(args) if who == me}


def data(rank: int, epoch: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a fixed linear problem, its own for each original rank (the shard does not move when the
    world shrinks: a dead rank's shard is simply not seen any more)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * epoch + batch)
    x = torch.randn(32, DIM, generator=g)
    w = torch.linspace(-1.0, 1.0, DIM)
    return x, x @ w[:, None] + 0.01 * torch.randn(32, 1, generator=g)


def make(args, api: str | None = None, comm=None):
    """The model and its optimizer, the same on every rank; ``api`` overrides ``--api``."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if (api or args.api) == "hvd":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       local_steps=args.local_steps)
    else:
        opt = wrap(args, inner, comm)
    return model, opt


def wrap(args, inner, comm=None):
    return adasum.torch.DistributedOptimizer(inner, op="adasum", local_steps=args.local_steps, comm=comm,
                                            overlap=args.overlap, delay=args.delay)


def evaluate(model) -> float:
    x, y = data(999, 0, 0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def die(how: signal.Signals = signal.SIGKILL) -> None:
    """SIGKILL (or SIGSTOP) this process, its time written beside the result first."""
    with open(f"{OUT[0]}.killed.{MPI.COMM_WORLD.Get_rank()}", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), how)


OUT = [""]
MET = [False]  # --kill R@E.B:mpierror has raised its error


def one_batch(model, opt, epoch: int, batch: int, die_here: str | None) -> None:
    if die_here == "before":
        die()
    if die_here == "stop":
        die(signal.SIGSTOP)
    if die_here == "mpierror" and not MET[0]:  # once: the replay after the reset trains the batch again
        MET[0] = True
        time.sleep(0.5)  # the rank that dies at this batch is dead by now
        raise MPI.Exception(MPI.ERR_OTHER)
    if die_here == "raise":
        with open(f"{OUT[0]}.killed.{MPI.COMM_WORLD.Get_rank()}", "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: a bug in the training function at epoch {epoch} "
                           f"batch {batch}")
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
    if "reset" in die_at.values():  # this rank dies inside the first recovery's callbacks
        state.register_reset_callbacks([lambda: (time.sleep(0.2), die())])
    runner = hvd.elastic.run if args.api == "hvd" else elastic.run
    runner = runner(on_error=args.on_error)

    @runner
    def train(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                one_batch(model, opt, state.epoch, state.batch, die_at.get((state.epoch, state.batch)))
                state.batch += 1
                if state.batch % COMMIT_EVERY == 0:
                    if die_at.get((state.epoch, state.batch - 1)) == "commit":
                        threading.Timer(0.002, die).start()
                    state.commit()
            state.batch = 0
            state.epoch += 1
            if len(losses) < state.epoch:
                losses.append(evaluate(model))
            state.commit()

    train(state)
    state.sizes_at_reset = sizes
    return state


def sync(model, opt, comm) -> None:
    """What ``State.sync()`` does at the start of every attempt: rank 0's model and optimizer everywhere."""
    adasum.torch.broadcast_parameters(model.state_dict(), root=0, comm=comm)
    adasum.torch.broadcast_optimizer_state(opt, root=0, comm=comm)


def train_reference(args) -> tuple[bytes | None, list[float]]:
    """The elastic run's training with nobody dying: at the commit that a death rolls back to (the last
    one before it), the ranks that die leave and the others go on over a communicator of their own, with a
    new optimizer of the same settings loaded with the state of that point and synced from its rank 0, as
    a reset does. Returns this rank's final parameters (None where it left) and the losses after each
    epoch."""
    me = MPI.COMM_WORLD.Get_rank()
    leave = {}  # (epoch, batch) of a commit: the ranks that leave there
    for who, epoch, batch, where in deaths(args):
        if where == "mpierror":
            continue
        leave.setdefault((epoch, batch - batch % COMMIT_EVERY), set()).add(who)
    comm = MPI.COMM_WORLD.Dup()
    model, opt = make(args, api="native", comm=comm)
    sync(model, opt, comm)
    losses = []
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            gone = leave.get((epoch, batch), set())
            if gone:
                saved = opt.state_dict()
                opt.close(combine=False)  # nothing is open at a commit
                old, comm = comm, comm.Split(MPI.UNDEFINED if me in gone else 0, me)
                old.Free()
                if comm == MPI.COMM_NULL:
                    return None, losses
                opt = wrap(args, opt.optimizer, comm)
                opt.load_state_dict(saved)
                sync(model, opt, comm)
            one_batch(model, opt, epoch, batch, None)
            if (batch + 1) % COMMIT_EVERY == 0:
                opt.flush()
        losses.append(evaluate(model))
    opt.close()
    comm.Free()
    return params_bytes(model), losses


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
    adasum.configure(stall_timeout=args.stall_timeout)
    if args.api == "hvd":
        hvd.init()
    plain = train_plain(args) if args.plain else None
    reference, reference_losses = (None, []) if args.no_reference else train_reference(args)
    model, opt = make(args)
    losses: list = []
    start = time.time()
    state = train_elastic(args, model, opt, losses)
    mine = {"rank": MPI.COMM_WORLD.Get_rank(), "resets": state.resets, "params": params_bytes(model),
            "recovery_s": state.last_recovery_seconds, "seen_at": state.last_failure_seen_at,
            "sizes_at_reset": state.sizes_at_reset, "losses": losses,
            "object": hvd.allgather_object(hvd.rank()) if args.api == "hvd" else None,
            "reference_equal": reference == params_bytes(model), "reference_losses": reference_losses}
    everyone = exchange.allgather(world(), mine)
    if world().Get_rank() == 0:
        result = {"size": world().Get_size(), "survivors": [m["rank"] for m in everyone],
                  "resets": [m["resets"] for m in everyone],
                  "equal": all(m["params"] == mine["params"] for m in everyone),
                  "plain_equal": None if plain is None else plain == mine["params"],
                  "reference_equal": [m["reference_equal"] for m in everyone],
                  "reference_losses": [m["reference_losses"] for m in everyone],
                  "losses": [m["losses"] for m in everyone], "recovery_s": [m["recovery_s"] for m in everyone],
                  "seen_at": [m["seen_at"] for m in everyone], "sizes_at_reset": everyone[0]["sizes_at_reset"],
                  "objects": everyone[0]["object"], "hvd_size": hvd.size(), "seconds": time.time() - start}
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
