"""MNIST-1D with torch's DistributedDataParallel and an Adasum communication hook, under mpiexec::

    mpiexec -n 4 python -m mpi4py examples/ddp.py                  # Adasum of the gradients (adasum_hook)
    mpiexec -n 4 python -m mpi4py examples/ddp.py --hook deltas    # Adasum of weight deltas inside DDP

``adasum.torch.init_process_group()`` starts torch.distributed on the MPI world; DDP then wraps the model
and the hook reduces over MPI. Each rank trains on its own shard; rank 0 prints the test accuracy after
every epoch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adasum  # noqa: E402
import adasum.torch as at  # noqa: E402
from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook  # noqa: E402
from model import build_model, evaluate, load_or_make_data, shard_batches  # noqa: E402


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", choices=["gradients", "deltas"], default="gradients")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--num-samples", type=int, default=5000)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, size = adasum.rank(), adasum.size()

    at.init_process_group()
    data = load_or_make_data(args.num_samples)
    model = build_model(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    if args.hook == "gradients":
        ddp.register_comm_hook(AdasumState(), adasum_hook)
    else:
        ddp.register_comm_hook(DeltaState(opt), adasum_delta_hook)
    accuracy = 0.0
    for epoch in range(args.epochs):
        for idx in shard_batches(len(data.y), args.batch_size, rank, size, epoch, seed=0):
            loss = torch.nn.functional.cross_entropy(ddp(data.x[idx]), data.y[idx])
            loss.backward()
            if args.hook == "gradients":
                opt.step()  # with the delta hook the step ran inside backward
            opt.zero_grad()
        with torch.no_grad():
            _, correct, n = evaluate(model, data.x_test, data.y_test)
        accuracy = correct / n
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {100 * accuracy:.1f} %", flush=True)
    torch.distributed.destroy_process_group()
    return accuracy


if __name__ == "__main__":
    main()
