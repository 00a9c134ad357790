"""Local steps with a DDP model: DDP reduces nothing (every backward under ``no_sync()``), and
``DistributedOptimizer(local_steps=8)`` combines the ranks' weight deltas with Adasum every 8 local steps,
on MNIST-1D, under mpiexec::

    mpiexec -n 2 python -m mpi4py examples/ddp_local_steps.py

The model's buffers are kept alike by the optimizer (``module=model``), so DDP's own buffer broadcast is
off. Every rank prints its final test accuracy (the same on every rank). docs/frameworks.md shows the middle
of this script.

At 2 ranks it reaches 45.3 % test accuracy in seconds (AdamW, combined every 8 local steps): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adasum
import adasum.torch as at

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

data = recipe_data()                             # every rank the same data set
dataset = TensorDataset(data.x, data.y)
sampler = DistributedSampler(dataset, num_replicas=adasum.size(), rank=adasum.rank(), drop_last=True)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)   # each rank trains on its own shard
loss_fn = torch.nn.functional.cross_entropy
model = build_model(seed=0)                      # the same initial weights on every rank


def epochs(count: int):
    """The rank's batches, ``count`` passes over its shard."""
    for epoch in range(count):
        sampler.set_epoch(epoch)
        yield from loader


shard = epochs(4)
at.init_process_group()
model = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)  # torch < 2.13: broadcast_buffers=False
opt = at.DistributedOptimizer(torch.optim.AdamW(model.parameters()), local_steps=8, module=model)
for x, y in shard:
    with model.no_sync():
        loss_fn(model(x), y).backward()
    opt.step()        # a local step; every 8th combines the deltas with Adasum
    opt.zero_grad()
opt.flush()           # a last, shorter window is combined too

report(model.module, data, adasum.rank())
torch.distributed.destroy_process_group()
