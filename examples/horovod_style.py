"""A Horovod training script with its import changed to ``adasum.horovod``, on MNIST-1D, under mpiexec::

    mpiexec -n 2 python -m mpi4py examples/horovod_style.py

Horovod's set-up (``DistributedOptimizer`` with Adasum, two backward passes per step, the fp16 wire,
broadcasts from rank 0) and its clipping pattern (``synchronize()``, clip, ``step()`` inside
``skip_synchronize()``). Every rank prints its final test accuracy (the same on every rank).
docs/horovod.md shows the middle of this script.

At 2 ranks it reaches 83.5 % test accuracy in seconds (AdamW): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adasum.horovod as hvd          # was: import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

hvd.init()
data = recipe_data()                             # every rank the same data set
dataset = TensorDataset(data.x, data.y)
sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), drop_last=True)
loader = DataLoader(dataset, batch_size=16, sampler=sampler)   # each rank trains on its own shard
model = build_model(seed=hvd.rank())             # different on every rank until the broadcast
loss_fn = torch.nn.functional.cross_entropy
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                               backward_passes_per_step=2, compression=hvd.Compression.fp16)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)

for epoch in range(4):
    sampler.set_epoch(epoch)
    batches = list(loader)
    for step in range(len(batches) // 2):
        window = batches[2 * step:2 * step + 2]
        for x, y in window:                      # backward_passes_per_step=2 passes: their gradients add up
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()

report(model, data, hvd.rank())
