"""LR schedulers and step hooks built on the wrapped optimizer, under MPI: overlap (each bucket's local step
on a shadow of its parameters) ends bitwise where the run without overlap ends, the hooks and the
scheduler see one step per window, the DDP delta hook matches DistributedOptimizer with the same
scheduler, and nothing read between the closing backward and ``step()`` sees a bucket's intermediate
values."""

from __future__ import annotations

import warnings

import pytest
import torch

from adasum.torch import DistributedOptimizer
from adasum.torch.ddp import DeltaState, adasum_delta_hook

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import inner

SCHEDULERS = ["steplr", "onecycle", "lambda", "plateau", "posthook"]
WINDOWS = 6


def deep(seed: int = 0, layers: int = 6, width: int = 16, dtype=torch.float32) -> torch.nn.Module:
    """Many small layers: with a small ``bucket_bytes``, many buckets."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        return torch.nn.Sequential(*mods, torch.nn.Linear(width, 4)).to(dtype)




def scheduler(kind: str, opt):
    if kind == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=WINDOWS + 1)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    if kind == "plateau":  # a loss that never improves: the rate halves at every window
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return None


class Counts:
    """A step pre-hook and post-hook: how often each fired, and the parameters each post-hook saw."""

    def __init__(self, opt, model):
        self.pre = self.post = 0
        self.seen: list[list[bytes]] = []
        self.model = model
        opt.register_step_pre_hook(self.on_pre)
        opt.register_step_post_hook(self.on_post)

    def on_pre(self, opt, args, kwargs):
        self.pre += 1

    def on_post(self, opt, args, kwargs):
        self.post += 1
        self.seen.append([raw_bytes(p) for p in self.model.parameters()])


def train(comm, kind: str, opt_name: str, *, overlap: bool, k: int = 1):
    """The usual order: the inner optimizer, its scheduler (or hooks), then the wrapper."""
    model = deep()
    opt_inner = inner(opt_name, model.parameters())
    sched = scheduler(kind, opt_inner)
    counts = Counts(opt_inner, model) if kind == "posthook" else None
    opt = DistributedOptimizer(opt_inner, accumulation_steps=k, overlap=overlap, bucket_bytes=300)
    g = torch.Generator().manual_seed(100 + comm.Get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w in range(WINDOWS):
            for _ in range(k):
                x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            if counts is not None:  # a post-hook sees the parameters the window ends with
                assert counts.seen[-1] == [raw_bytes(p) for p in model.parameters()]
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(float(w))
            elif sched is not None:
                sched.step()
    assert not [str(c.message) for c in caught if "lr_scheduler" in str(c.message)]
    if counts is not None:
        assert (counts.pre, counts.post) == (WINDOWS, WINDOWS)
    return model, opt


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", SCHEDULERS)
@TRAINING_SIZES
def test_overlap_with_a_scheduler_on_the_wrapped_optimizer_is_bitwise_the_plain_run(comm, opt_name, kind):
    plain, _ = train(comm, kind, opt_name, overlap=False)
    over, opt = train(comm, kind, opt_name, overlap=True)
    assert opt.overlapped_boundaries == WINDOWS - 1  # the first boundary is observed
    assert [raw_bytes(p) for p in over.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(over.parameters()))
    assert any(raw_bytes(a) != raw_bytes(b) for a, b in zip(over.parameters(), deep().parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_step_hooks_fire_once_per_window_with_accumulation(comm, overlap):
    """Two micro-batches per window: the hooks fire at the boundaries only, after the update."""
    plain, _ = train(comm, "posthook", "adamw", overlap=False, k=2)
    model, _ = train(comm, "posthook", "adamw", overlap=overlap, k=2)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in plain.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@TRAINING_SIZES
def test_delta_hook_with_steplr_is_bitwise_distributed_optimizer(comm, pg, opt_name):
    """DDP with adasum_delta_hook and a StepLR on the optimizer it steps, several DDP buckets, against
    DistributedOptimizer with the same scheduler; the post-hook fires once per update in both."""
    dtype = torch.float64
    g = torch.Generator().manual_seed(1000 + comm.Get_rank())
    data = [(torch.randn(5, 16, generator=g, dtype=dtype), torch.randn(5, 4, generator=g, dtype=dtype))
            for _ in range(WINDOWS)]

    model = deep(dtype=dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = inner(opt_name, ddp.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    counts = Counts(opt, model)
    state = DeltaState(opt)
    ddp.register_comm_hook(state, adasum_delta_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            assert counts.seen[-1] == [raw_bytes(p) for p in model.parameters()]
            opt.zero_grad()
            sched.step()
    assert not [str(c.message) for c in caught if "lr_scheduler" in str(c.message)]
    assert state.updates == WINDOWS and (counts.pre, counts.post) == (WINDOWS, WINDOWS)

    ref = deep(dtype=dtype)
    ref_inner = inner(opt_name, ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_inner, step_size=1, gamma=0.7)
    ref_counts = Counts(ref_inner, ref)
    ref_opt = DistributedOptimizer(ref_inner)
    for x, y in data:
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    assert (ref_counts.pre, ref_counts.post) == (WINDOWS, WINDOWS)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in ref.parameters()]
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@ONE_SIZE
def test_parameters_hold_the_windows_start_until_step(comm):
    """With overlap and many buckets, whatever reads the parameters during the closing backward (a module's
    backward hook) or right after it sees exactly the values the previous step() left: 30 boundaries."""
    model = deep(layers=12, width=256)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), overlap=True,
                               bucket_bytes=300_000)
    reads: list[list[torch.Tensor]] = []

    def snapshot(*_):
        reads.append([p.detach().clone() for p in model.parameters()])

    for layer in (model[0], model[6]):  # late in backward: buckets are on the threads by then
        layer.register_full_backward_hook(snapshot)
    g = torch.Generator().manual_seed(7 + comm.Get_rank())
    start = [p.detach().clone() for p in model.parameters()]
    bad = []
    for i in range(31):
        x, y = torch.randn(32, 256, generator=g).requires_grad_(), torch.randn(32, 4, generator=g)
        reads.clear()
        torch.nn.functional.mse_loss(model(x), y).backward()
        snapshot()
        for _ in range(5):  # a loop that reads while the threads work
            snapshot()
        if any(not torch.equal(a, b) for r in reads for a, b in zip(r, start)):
            bad.append(i)
        opt.step()
        opt.zero_grad()
        start = [p.detach().clone() for p in model.parameters()]
    assert opt.overlapped_boundaries == 30
    assert bad == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.frameworks
@ONE_SIZE
def test_lightning_scheduler_from_configure_optimizers_overlap_is_bitwise(comm):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from adasum.lightning import AdasumStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = deep()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(overlap: bool):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(48, 16, generator=g)
        data = TensorDataset(x, x[:, :4] * 2)
        module = Module()
        trainer = L.Trainer(strategy=AdasumStrategy(overlap=overlap, bucket_bytes=300), accelerator="cpu",
                            max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
            trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False))
        return module, trainer

    plain, _ = fit(False)
    over, trainer = fit(True)
    assert trainer.strategy.optimizers[0].overlapped_boundaries > 0
    assert [raw_bytes(p) for p in over.net.parameters()] == [raw_bytes(p) for p in plain.net.parameters()]
    assert_identical_across_ranks(comm, list(over.net.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_a_step_pre_hook_that_raises_on_one_rank_raises_on_every_rank(comm, overlap):
    model = deep()
    opt_inner = inner("adamw", model.parameters())
    windows = []

    def pre_hook(opt, args, kwargs):
        windows.append(1)
        if len(windows) == 3 and comm.Get_rank() == comm.Get_size() - 1:
            raise ValueError("the hook's own error")

    opt_inner.register_step_pre_hook(pre_hook)
    opt = DistributedOptimizer(opt_inner, overlap=overlap, bucket_bytes=300)
    g = torch.Generator().manual_seed(100 + comm.Get_rank())
    for w in range(3):
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if w < 2:
            opt.step()
            opt.zero_grad()
            continue
        before = [raw_bytes(p) for p in model.parameters()]
        with pytest.raises(RuntimeError, match=rf"rank {comm.Get_size() - 1}: a step pre-hook .* the hook's own"):
            opt.step()
        assert [raw_bytes(p) for p in model.parameters()] == before
    assert_identical_across_ranks(comm, list(model.parameters()))
