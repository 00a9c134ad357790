"""Horovod's elastic state semantics at 2 ranks, through ``adasum.horovod``: ``sync()`` gives every rank
rank 0's model, optimizer, attributes and sampler, and a ``restore()`` after it returns to rank 0's state
(not to this rank's own from before the sync); a commit then a restore keeps what was committed. Each rank
prints ``rank R: ok``.

    mpiexec -n 2 python tests/elastic/state_job.py
"""

import torch

import adasum.horovod as hvd

hvd.init()
me = hvd.rank()
v = 1.0 if me == 0 else 2.0
model = torch.nn.Linear(2, 2)
with torch.no_grad():
    model.weight.fill_(v)
    model.bias.fill_(v)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
sampler = hvd.elastic.ElasticSampler(list(range(16)), shuffle=True, seed=3)
sampler.set_epoch(me)
sampler.record_batch(0, 2 + me)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, batch=20 + me, epoch=10 + me)
state.sync()
assert all(bool((p == 1.0).all()) for p in model.parameters())
assert (state.batch, state.epoch) == (20, 10), (state.batch, state.epoch)
assert sampler.state_dict() == {"epoch": 0, "processed_num": 2 * hvd.size()}, sampler.state_dict()
assert len(sampler) == (16 - 2 * hvd.size()) // hvd.size()

with torch.no_grad():
    model.weight.fill_(5.0)
state.batch, state.epoch = 21, 11
sampler.record_batch(1, 2)
state.restore()  # back to what sync gave: rank 0's
assert all(bool((p == 1.0).all()) for p in model.parameters())
assert (state.batch, state.epoch) == (20, 10), (state.batch, state.epoch)
assert sampler.processed_num == 2 * hvd.size()

state.batch = 22
sampler.record_batch(1, 2)
state.commit()
state.batch = 23
state.restore()
assert state.batch == 22 and sampler.processed_num == 4 * hvd.size()
shards = hvd.allgather_object(list(sampler))
assert sorted(i for shard in shards for i in shard) == sorted(list(sampler.remaining_indices)), shards
print(f"rank {me}: ok", flush=True)
