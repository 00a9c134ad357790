"""FSDP2 with HSDP's layout and Adasum across the replicas, on MNIST-1D, under mpiexec::

    mpiexec -n 4 python -m mpi4py examples/fsdp_hsdp.py      # 2 replicas of 2 shards each
    mpiexec -n 2 python -m mpi4py examples/fsdp_hsdp.py      # 2 replicas of 1 shard each

The ranks form a (replicate, shard) mesh of 2 replicas (one per rank at an odd world size); the model is
sharded with FSDP2 over each replica's ranks and ``adasum_replicas`` makes the reduction across replicas
Adasum per parameter (FSDP averages within the shard group first). Every rank prints its final test
accuracy and a checksum of the whole model (the same on every rank). docs/frameworks.md shows the middle of
this script.

At 2 ranks (2 replicas of 1 shard) it reaches 44.3 % test accuracy, the very model of examples/ddp_hook.py
(the same checksum: Adasum of the same gradients); at 4 ranks (2×2) 28.0 %, each rank's shard of the data
being half as long (SGD): like every recipe it trains 4 epochs on 1600 signals, to show the calls, where
examples/train.py trains 20 epochs on 4000 with a cosine schedule for its 96-97 %.
"""

import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adasum
import adasum.torch as at
from adasum.torch.fsdp import adasum_replicas

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build_model, recipe_data, report  # noqa: E402  (examples/model.py: MNIST-1D, a small CNN)

data = recipe_data()                             # every rank the same data set
dataset = TensorDataset(data.x, data.y)
sampler = DistributedSampler(dataset, num_replicas=adasum.size(), rank=adasum.rank(), drop_last=True)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)   # each rank trains on its own shard
loss_fn = torch.nn.functional.cross_entropy
model = build_model(seed=0)                      # the same initial weights on every rank
replicas = 2 if adasum.size() % 2 == 0 else adasum.size()

at.init_process_group()
mesh = init_device_mesh("cpu", (replicas, adasum.size() // replicas), mesh_dim_names=("replicate", "shard"))
for layer in model.features:
    if isinstance(layer, torch.nn.Conv1d):
        fully_shard(layer, mesh=mesh["shard"])   # the shard dimension only, not the 2-D mesh
fully_shard(model, mesh=mesh["shard"])
adasum_replicas(model, mesh)                     # the reduction across replicas: Adasum per parameter
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()                          # reduce-scatter in the shard group, then the hook
        optimizer.step()                         # each rank steps its shards
        optimizer.zero_grad()

whole = build_model(seed=0)                      # the model gathered, to evaluate it as the other recipes do
whole.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
report(whole, data, adasum.rank())
torch.distributed.destroy_process_group()
