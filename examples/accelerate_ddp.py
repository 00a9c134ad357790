"""Hugging Face Accelerate with the Adasum DDP communication hook on MNIST-1D, under mpiexec::

    mpiexec -n 2 python -m mpi4py examples/accelerate_ddp.py

``adasum.torch.init_process_group()`` starts torch.distributed on the MPI world; Accelerate then finds the
world, wraps the model in DDP and deals the batches to the ranks, and the hook goes on the prepared model.
On a host without GPUs, ``Accelerator()`` starts no distributed mode (each rank would train alone): pass
``cpu=True``. Every rank prints its final test accuracy (the same on every rank). docs/frameworks.md shows
the middle of this script.

At 2 ranks it reaches 43.5 % test accuracy in seconds (SGD): like every recipe it trains 4 epochs on
1600 signals, to show the calls, where examples/train.py trains 20 epochs on 4000 with a cosine
schedule for its 96-97 %.
"""

import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import adasum
import adasum.torch as at
from adasum.torch.ddp import AdasumState, adasum_hook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

data = recipe_data()                             # every rank the same data set
loader = DataLoader(TensorDataset(data.x, data.y), batch_size=32, shuffle=True)  # Accelerate shards it
model = build_model(seed=0)                      # the same initial weights on every rank
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = torch.nn.functional.cross_entropy

at.init_process_group()
accelerator = Accelerator(cpu=True)              # cpu=True on a host without GPUs: else no distributed mode there
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
model.register_comm_hook(AdasumState(), adasum_hook)
for epoch in range(4):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

report(accelerator.unwrap_model(model), data, adasum.rank())
torch.distributed.destroy_process_group()
