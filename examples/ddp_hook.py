"""torch's DistributedDataParallel with Adasum of the gradients (``adasum_hook``), on MNIST-1D, under mpiexec::

    mpiexec -n 2 python -m mpi4py examples/ddp_hook.py

``adasum.torch.init_process_group()`` starts torch.distributed on the MPI world; DDP wraps the model and
its communication hook combines the ranks' gradients with Adasum, one layer per parameter, over MPI. Each
rank trains on its own shard; every rank prints its final test accuracy (the same on every rank).
docs/frameworks.md shows the middle of this script.

At 2 ranks it reaches 44.3 % test accuracy in seconds (SGD): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adasum
import adasum.torch as at
from adasum.torch.ddp import AdasumState, adasum_hook

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
model.register_comm_hook(AdasumState(op="adasum", compression=None), adasum_hook)  # gradients
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()                          # DDP reduces the gradients through the hook
        optimizer.step()
        optimizer.zero_grad()

report(model.module, data, adasum.rank())
torch.distributed.destroy_process_group()
