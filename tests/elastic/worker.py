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
``--no-reference`` skips the reference run (for jobs that must end). With ``ADASUM_ELASTIC_REPLACE=1``
the world grows back: a process started in place of the dead (a newcomer) takes the place of the lowest
missing original rank (its data, and the ``--kill`` of that rank after it joined), and the reference has
that rank come back at the commit after the one the death rolled back to (``--rejoin later``: one commit
later still, ``--rejoin never``: not at all); ``--newcomer-fails-once`` has the first newcomer call a
collective before ``elastic.run`` (refused: it raises, and that newcomer ends before it joined). ``--api hvd``
trains through ``adasum.horovod``; ``--local-steps 4`` with ``DistributedOptimizer(local_steps=4)`` (and ``--delay 1``),
``--overlap`` with ``overlap=True``; ``--plain`` also trains the same model without elastic first and
records whether both end bitwise alike. ``--paths R@S`` (three times): then, in the same job,
tests/elastic/paths_worker.py's phases (HSDP and DDP with those deaths), its result in ``--out``.paths.

Every job first trains a reference without elastic and without a failure (:func:`train_reference`): the
world changes where the elastic run's resets say it does, at the commit each death rolls back to, the ranks
that die there simply leaving (and, where the world grows back, coming back at the next commit with rank
0's state). The elastic run must end bitwise where the reference ends. A newcomer runs neither the plain
run nor the reference.

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
REPLACE = adasum.current_settings().elastic_replace  # ADASUM_ELASTIC_REPLACE=1: the world grows back
# This process's original rank: MPI.COMM_WORLD's, or for a newcomer the one it stands in for once it joined.
IDENT: list = [None if elastic.is_newcomer() else MPI.COMM_WORLD.Get_rank()]


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
    p.add_argument("--rejoin", choices=["at", "later", "never"], default="at",
                   help="with ADASUM_ELASTIC_REPLACE=1: when the reference has a dead rank come back")
    p.add_argument("--newcomer-fails-once", action="store_true")
    p.add_argument("--paths", action="append", default=[],
                   help="then tests/elastic/paths_worker.py's phases with these kills (R@S, one per phase)")
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
    """{(epoch, batch): where} of this rank's death, from ``--kill`` (none for a newcomer not yet joined)."""
    return {(epoch, batch): where for who, epoch, batch, where in deaths(args) if who == IDENT[0]}


def take_identity() -> None:
    """A reset callback: a newcomer takes the lowest original rank that no process of the world holds
    (in the order of the newcomers' ranks), as the reference's rank that comes back does."""
    ids = exchange.allgather(world(), IDENT[0], what="the worker's identities")
    if IDENT[0] is None:
        missing = sorted(set(range(len(ids))) - set(ids))
        IDENT[0] = missing[[r for r, i in enumerate(ids) if i is None].index(world().Get_rank())]


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
    with open(f"{OUT[0]}.killed.{IDENT[0]}", "w") as f:
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
        with open(f"{OUT[0]}.killed.{IDENT[0]}", "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError(f"rank {IDENT[0]}: a bug in the training function at epoch {epoch} "
                           f"batch {batch}")
    x, y = data(IDENT[0], epoch, batch)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if die_here == "step":
        time.sleep(0.5)  # the others are inside step()'s combine by now
        die()
    opt.step()


def train_elastic(args, model, opt) -> elastic.State:
    make_state = hvd.elastic.TorchState if args.api == "hvd" else elastic.State
    state = make_state(model, opt, epoch=0, batch=0, losses=[])
    sizes = []
    state.register_reset_callbacks([take_identity] if REPLACE else [])
    state.register_reset_callbacks([lambda: sizes.append(hvd.size() if args.api == "hvd" else adasum.size())])
    if "reset" in kills(args).values():  # this rank dies inside the first recovery's callbacks
        state.register_reset_callbacks([lambda: (time.sleep(0.2), die())])
    runner = hvd.elastic.run if args.api == "hvd" else elastic.run
    runner = runner(on_error=args.on_error)

    @runner
    def train(state):
        die_at = kills(args)  # a newcomer's, once it joined
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
            if len(state.losses) < state.epoch:
                state.losses.append(evaluate(model))
            state.commit()

    if args.newcomer_fails_once and elastic.is_newcomer() and not os.path.exists(f"{args.out}.newcomer"):
        open(f"{args.out}.newcomer", "w").close()  # the first newcomer: a collective before run is refused
        adasum.torch.broadcast_parameters(model.state_dict())  # raises; the process ends, not joined
    train(state)
    state.sizes_at_reset = sizes
    return state


def sync(model, opt, comm) -> None:
    """What ``State.sync()`` does at the start of every attempt: rank 0's model and optimizer (its whole
    state dict) everywhere."""
    adasum.torch.broadcast_parameters(model.state_dict(), root=0, comm=comm)
    root = comm.Get_rank() == 0
    state = exchange.bcast(comm, opt.state_dict() if root else None, root=0, what="the reference's optimizer")
    if not root:
        opt.load_state_dict(state)


def changes(args) -> dict:
    """{(epoch, batch) of a commit: (the ranks that leave there, the ranks that come back there)}: a death
    rolls back to the last commit before it; where the world grows back, the rank comes back at the commit
    after that one (``--rejoin``)."""
    out: dict = {}
    later = {"at": 1, "later": 2, "never": None}[args.rejoin] if REPLACE else None
    for who, epoch, batch, where in deaths(args):
        if where == "mpierror":
            continue
        at = (epoch, batch - batch % COMMIT_EVERY)
        out.setdefault(at, (set(), set()))[0].add(who)
        if later is not None:
            back = at[1] + later * COMMIT_EVERY
            out.setdefault((at[0] + back // BATCHES, back % BATCHES), (set(), set()))[1].add(who)
    return out


def train_reference(args) -> tuple[bytes | None, list[float]]:
    """The elastic run's training with nobody dying: at the commit that a death rolls back to (the last
    one before it), the ranks that die leave and the others go on over a communicator of their own, in
    their order, with a new optimizer of the same settings loaded with the state of that point and synced
    from its rank 0, as a reset does; a rank that comes back (the world grown back) joins after them with
    rank 0's state. Returns this rank's final parameters (None where it is out at the end) and the losses
    after each epoch while it was in."""
    me = MPI.COMM_WORLD.Get_rank()
    plan, order = changes(args), list(range(MPI.COMM_WORLD.Get_size()))
    comm = MPI.COMM_WORLD.Dup()
    model, opt = make(args, api="native", comm=comm)
    inner = opt.optimizer
    sync(model, opt, comm)
    losses = []
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            if (epoch, batch) in plan:
                gone, back = plan[(epoch, batch)]
                comm, opt, order = regroup(args, model, inner, comm, opt, [i for i in order if i not in gone]
                                           + sorted(back))
            if comm is None:
                continue
            one_batch(model, opt, epoch, batch, None)
            if (batch + 1) % COMMIT_EVERY == 0:
                opt.flush()
        if comm is not None:
            losses.append(evaluate(model))
    if comm is None:
        return None, losses
    opt.close()
    comm.Free()
    return params_bytes(model), losses


def regroup(args, model, inner, comm, opt, order: list[int]):
    """The reference's world becomes the ranks of ``order``, in that order (collective over
    MPI.COMM_WORLD): (its communicator or None, the optimizer on it or None, ``order``)."""
    me = MPI.COMM_WORLD.Get_rank()
    saved = None
    if opt is not None:
        saved = opt.state_dict()
        opt.close(combine=False)  # nothing is open at a commit
    new = MPI.COMM_WORLD.Split(0 if me in order else MPI.UNDEFINED, order.index(me) if me in order else 0)
    if comm is not None:
        comm.Free()
    if new == MPI.COMM_NULL:
        return None, None, order
    opt = wrap(args, inner, new)
    if saved is not None:
        opt.load_state_dict(saved)
    sync(model, opt, new)
    return new, opt, order


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
    newcomer = elastic.is_newcomer()  # it runs neither the plain run nor the reference
    plain = train_plain(args) if args.plain and not newcomer else None
    reference, reference_losses = (None, []) if args.no_reference or newcomer else train_reference(args)
    model, opt = make(args)
    start = time.time()
    state = train_elastic(args, model, opt)
    mine = {"rank": IDENT[0], "newcomer": newcomer, "resets": state.resets, "grows": state.grows,
            "params": params_bytes(model), "recovery_s": state.last_recovery_seconds,
            "seen_at": state.last_failure_seen_at, "grown_at": state.last_grown_at,
            "sizes_at_reset": state.sizes_at_reset, "losses": state.losses,
            "object": hvd.allgather_object(hvd.rank()) if args.api == "hvd" else None,
            "reference": reference, "reference_losses": reference_losses}
    everyone = exchange.allgather(world(), mine)
    if world().Get_rank() == 0:
        write_result(args, everyone, plain, start)
    if args.paths:  # the same job goes on (one job for two tests: the elastic stage's time)
        import paths_worker

        paths_worker.run_paths(args.paths, f"{args.out}.paths")


def write_result(args, everyone: list[dict], plain: bytes | None, start: float) -> None:
    """Rank 0 of the final world writes what the tests check (the module docstring): each process's
    parameters are compared with its own reference's and with rank 0's reference."""
    first = everyone[0]
    result = {"size": world().Get_size(), "survivors": [m["rank"] for m in everyone],
              "newcomers": sum(m["newcomer"] for m in everyone), "resets": [m["resets"] for m in everyone],
              "grows": [m["grows"] for m in everyone],
              "equal": all(m["params"] == first["params"] for m in everyone),
              "plain_equal": None if plain is None else plain == first["params"],
              "reference_equal": [m["params"] == first["reference"] and m["reference"] in (None, m["params"])
                                  for m in everyone],
              "reference_losses": [m["reference_losses"] for m in everyone if not m["newcomer"]],
              "losses": [m["losses"] for m in everyone], "recovery_s": [m["recovery_s"] for m in everyone],
              "seen_at": [m["seen_at"] for m in everyone], "grown_at": [m["grown_at"] for m in everyone],
              "sizes_at_reset": first["sizes_at_reset"], "objects": first["object"], "hvd_size": hvd.size(),
              "seconds": time.time() - start}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
