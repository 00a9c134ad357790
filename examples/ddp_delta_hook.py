"""torch's DistributedDataParallel with Adasum of weight deltas (``adasum_delta_hook``), on MNIST-1D, under
mpiexec::

    mpiexec -n 2 python -m mpi4py examples/ddp_delta_hook.py

The hook takes the optimizer's step inside backward, bucket by bucket, on shadows of the parameters, and
combines the ranks' weight deltas with Adasum (bitwise what ``DistributedOptimizer(op="adasum")`` does), so
the loop does not call ``optimizer.step()``. A model takes one communication hook: this one or
``adasum_hook`` (examples/ddp_hook.py). Every rank prints its final test accuracy (the same on every rank).
docs/frameworks.md shows the middle of this script.

At 2 ranks it reaches 80.3 % test accuracy in seconds (AdamW): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adasum
import adasum.torch as at
from adasum.torch.ddp import DeltaState, adasum_delta_hook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

data = recipe_data()                             # every rank the same data set
dataset = TensorDataset(data.x, data.y)
sampler = DistributedSampler(dataset, num_replicas=adasum.size(), rank=adasum.rank(), drop_last=True)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)   # each rank trains on its own shard
loss_fn = torch.nn.functional.cross_entropy
model = build_model(seed=0)                      # the same initial weights on every rank

at.init_process_group()
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = DeltaState(optimizer, accumulation_steps=1)
model.register_comm_hook(state, adasum_delta_hook)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()                          # reduces, steps and updates; do not call optimizer.step() (it raises)
        optimizer.zero_grad()

report(model.module, data, adasum.rank())
torch.distributed.destroy_process_group()
