"""Accelerate and the Hugging Face Trainer under mpiexec with the Adasum DDP hook: the recipes of docs/frameworks.md,
run as written, against DistributedOptimizer (plain SGD: Adasum of gradients is Adasum of deltas)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import adasum  # noqa: E402
import adasum.torch as at  # noqa: E402
from adasum.hf import AdasumCallback  # noqa: E402
from adasum.torch.ddp import AdasumState, adasum_hook  # noqa: E402

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks  # noqa: E402

pytestmark = pytest.mark.frameworks

N = 24


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    return TensorDataset(torch.arange(N), x, x @ torch.randn(8, 2, generator=g, dtype=torch.float64))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = torch.nn.Linear(8, 16).double()
            self.b = torch.nn.Linear(16, 2).double()

    def forward(self, x, labels=None, idx=None):
        out = self.b(torch.tanh(self.a(x)))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def reference(comm, steps: int, shuffle: bool):
    net = Net()
    opt = at.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    sampler = DistributedSampler(data(), comm.Get_size(), comm.Get_rank(), shuffle=shuffle, seed=0)
    for _, x, y in list(DataLoader(data(), batch_size=2, sampler=sampler))[:steps]:
        net(x, y)["loss"].backward()
        opt.step()
        opt.zero_grad()
    return net


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
@pytest.mark.smoke
def test_accelerate_recipe(comm, pg):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert (accelerator.num_processes, accelerator.process_index) == (comm.Get_size(), comm.Get_rank())
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(data(), batch_size=2)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    model.register_comm_hook(AdasumState(), adasum_hook)
    seen = []
    for idx, x, y in loader:
        seen += idx.tolist()
        accelerator.backward(model(x, y)["loss"])
        opt.step()
        opt.zero_grad()
    assert_identical_across_ranks(comm, list(net.parameters()))
    shards = comm.allgather(seen)
    assert sorted(i for s in shards for i in s) == list(range(N))  # each rank its own shard
    # Accelerate deals the batches round-robin; the reference loop takes the same batches
    ref = Net()
    ropt = at.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1))
    batches = list(DataLoader(data(), batch_size=2))
    for b in batches[comm.Get_rank()::comm.Get_size()][:len(seen) // 2]:
        ref(b[1], b[2])["loss"].backward()
        ropt.step()
        ropt.zero_grad()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_hf_trainer_recipe(comm, pg, shared_dir):
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            idx, x, y = data()[i]
            return {"idx": idx, "x": x, "labels": y}

    def train(op, **steps):
        net = Net()
        args = TrainingArguments(output_dir=shared_dir, per_device_train_batch_size=2,
                                 **(steps or {"max_steps": 4}),
                                 learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                                 use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, remove_unused_columns=False, seed=0,
                                 data_seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=net, args=args, train_dataset=Rows())
            callback = None
            if op is not None:
                callback = AdasumCallback(trainer, op=op)
                trainer.add_callback(callback)
            trainer.train()
        assert_identical_across_ranks(comm, list(net.parameters()))
        assert callback is None or (callback.state is not None and callback.state.op == op)
        return net

    # an epoch that ends inside an accumulation window (the Trainer steps there): every rank ends alike
    train("adasum", num_train_epochs=1, gradient_accumulation_steps=5)
    adasum_net, mean_net, ddp_net = train("adasum"), train("mean"), train(None)
    for a, b in zip(mean_net.parameters(), ddp_net.parameters()):  # the hook's mean is DDP's own average
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert any(not torch.equal(a, b) for a, b in zip(adasum_net.parameters(), mean_net.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
@ONE_SIZE
def test_hf_trainer_without_use_cpu_names_the_cause(comm, pg, shared_dir):
    """torch.distributed runs on every rank, but without use_cpu=True the Trainer on a host without a GPU
    starts no distributed mode: the callback's error on every rank says so, not to start torch.distributed."""
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            _, x, y = data()[i]
            return {"x": x, "labels": y}

    args = TrainingArguments(output_dir=shared_dir, per_device_train_batch_size=2, max_steps=2, ddp_backend="gloo",
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=Net(), args=args, train_dataset=Rows())
        trainer.add_callback(AdasumCallback(trainer))
        with pytest.raises(RuntimeError) as raised:
            trainer.train()
    message = str(raised.value)
    assert f"rank {comm.Get_rank()}" in message
    assert "the Trainer did not start distributed mode: pass use_cpu=True on a machine without a GPU" in message
    assert "init_process_group" not in message and "launch with mpiexec" not in message
    assert all(comm.allgather(True))  # every rank raised and goes on
