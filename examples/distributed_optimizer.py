"""docs/training.md's DistributedOptimizer recipe, as a complete script: AdamW with Adasum, accumulation
windows, clipping and a cosine schedule stepped once per window, on MNIST-1D::

    mpiexec -n 2 python -m mpi4py examples/distributed_optimizer.py

Every rank prints its final test accuracy (the same on every rank). examples/train.py is the full example,
with its options.

At 2 ranks it reaches 41.8 % test accuracy in seconds (AdamW, but windows of 4 micro-batches: a quarter of the optimizer steps): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import math
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler
import adasum
import adasum.torch as at

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

data = recipe_data()                             # every rank the same data set
dataset = torch.utils.data.TensorDataset(data.x, data.y)
model = build_model(seed=0)                      # the same initial weights on every rank
loss_fn = torch.nn.functional.cross_entropy
epochs = 4

if torch.cuda.is_available():
    torch.cuda.set_device(adasum.local_rank())   # one GPU per rank of this node
sampler = DistributedSampler(dataset, num_replicas=adasum.size(), rank=adasum.rank(), drop_last=True)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)   # each rank trains on its own shard
total_steps = epochs * math.ceil(len(loader) / 4)  # optimizer steps: windows of 4 micro-batches

opt = at.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                              op="adasum", accumulation_steps=4)
at.broadcast_parameters(model, root=0)          # every rank starts from rank 0's weights and buffers
at.broadcast_optimizer_state(opt, root=0)        # and from its optimizer state and hyperparameters
sched = at.BoundaryScheduler(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps), opt)

for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)              # a mean over the micro-batch; do NOT divide by k
        loss.backward()
        if i == len(loader) - 1:
            opt.force_boundary()                 # end of the data: close the window early
        opt.clip_grad_norm_(1.0)                 # optional; does something only at a boundary
        opt.step()                               # reduces and updates only at a boundary
        sched.step()                             # steps the scheduler once per boundary
        opt.zero_grad()                          # does nothing while a window is open

report(model, data, adasum.rank())
