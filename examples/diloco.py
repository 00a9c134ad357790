"""Local steps with an outer optimizer of your choice (DiLoCo): each rank's AdamW takes 8 local steps, then
the ranks average their weight deltas and an outer Nesterov SGD steps every rank from the window's start on
the pseudo-gradient -(averaged delta), on MNIST-1D, under mpiexec::

    mpiexec -n 2 python -m mpi4py examples/diloco.py

Every rank prints its final test accuracy (the same on every rank). docs/training.md shows the middle of this
script. At 2 ranks it reaches 43.0 % test accuracy in seconds; like every recipe it trains 4 epochs on 1600 signals, to show the calls, where examples/train.py
trains 20 epochs on 4000 with a cosine schedule for its 96-97 %.
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

outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
opt = at.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), op="mean", local_steps=8,
                              outer_optimizer=outer)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()        # a local step; every 8th averages the deltas and steps the outer optimizer
        opt.zero_grad()
opt.flush()               # a last, shorter window is combined too

report(model, data, adasum.rank())
