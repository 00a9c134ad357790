"""PyTorch Lightning with AdasumStrategy under mpiexec: Trainer.fit against the same loop written with
DistributedOptimizer, shards, accumulation, mixed precision, metrics, checkpoints, mismatches."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

L = pytest.importorskip("lightning")

import adasum.torch as at  # noqa: E402
from adasum.lightning import AdasumStrategy  # noqa: E402

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes  # noqa: E402

pytestmark = pytest.mark.frameworks

N = 48  # samples; each rank's shard is N / P


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 8, generator=g)
    return TensorDataset(torch.arange(N), x, x @ torch.randn(8, 2, generator=g))


def model_init() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


class Module(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.net = model_init()
        self.lr = lr
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        if self.current_epoch == 0:
            self.seen += idx.tolist()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def fit(comm, *, epochs=2, accumulate=1, precision="32-true", **strategy):
    module = Module()
    plugins = []
    if precision == "16-mixed+scaler":  # Lightning gives CPU runs no scaler; a GradScaler on CPU, as on GPUs
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))], None
    trainer = L.Trainer(strategy=AdasumStrategy(**strategy), accelerator="cpu", max_epochs=epochs,
                        accumulate_grad_batches=accumulate, precision=precision, plugins=plugins, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False))
    return module, trainer


def manual(comm, *, epochs=2, accumulate=1):
    """The same training written by hand: this rank's shard, DistributedOptimizer."""
    net = model_init()
    opt = at.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                  accumulation_steps=accumulate)
    sampler = DistributedSampler(dataset(), comm.Get_size(), comm.Get_rank(), shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # as Lightning does for its training sampler
        for i, (_, x, y) in enumerate(loader):
            torch.nn.functional.mse_loss(net(x), y).backward()
            if i == len(loader) - 1:
                opt.force_boundary()
            opt.step()
            opt.zero_grad()
    return net


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
@pytest.mark.smoke
def test_fit_is_the_hand_written_loop(comm, accumulate, overlap):
    module, trainer = fit(comm, accumulate=accumulate, overlap=overlap)
    assert trainer.world_size == comm.Get_size() and trainer.global_rank == comm.Get_rank()
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    # each rank its own shard, every sample once in the first epoch
    shards = comm.allgather(sorted(set(module.seen)))
    assert sorted(i for s in shards for i in s) == list(range(N))
    reference = manual(comm, accumulate=accumulate)
    for a, b in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    opt = trainer.strategy.optimizers[0]
    if overlap and comm.Get_size() > 1:
        assert opt.overlapped_boundaries > 0
    # the synced metric is reduced over the ranks: every rank logs the same value
    logged = float(trainer.callback_metrics["train_loss"])
    assert comm.allgather(logged) == [logged] * comm.Get_size()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-mixed+scaler"])
@TRAINING_SIZES
def test_mixed_precision(comm, precision):
    module, trainer = fit(comm, epochs=1, precision=precision)
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    assert all(torch.isfinite(p).all() for p in module.net.parameters())
    moved = [raw_bytes(a) != raw_bytes(b) for a, b in zip(module.net.parameters(), model_init().parameters())]
    assert all(moved)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert (scaler is not None) == (precision == "16-mixed+scaler")
    if scaler is not None:  # the scaler was handed to the optimizer, which keeps it alike everywhere
        assert trainer.strategy.optimizers[0].grad_scaler is scaler
        assert len(set(comm.allgather(float(scaler.get_scale())))) == 1


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_checkpoint_is_written_by_rank_0_and_loads(comm, shared_dir):
    module, trainer = fit(comm, epochs=1)
    path = os.path.join(shared_dir, "lightning.ckpt")
    trainer.save_checkpoint(path)
    comm.Barrier()
    state = torch.load(path, weights_only=False)
    loaded = Module()
    loaded.load_state_dict(state["state_dict"])
    assert [raw_bytes(p) for p in loaded.net.parameters()] == [raw_bytes(p) for p in module.net.parameters()]


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_ranks_that_disagree_raise_on_every_rank(comm):
    op = "mean" if comm.Get_rank() == comm.Get_size() - 1 else "adasum"
    with pytest.raises(ValueError, match=rf"ranks disagree on op of DistributedOptimizer: rank {comm.Get_size() - 1}"):
        fit(comm, epochs=1, op=op)


class BNModule(Module):
    """With BatchNorm: its running statistics follow each rank's own shard unless kept alike."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
def test_buffers_are_alike_on_every_rank(comm, accumulate, overlap):
    module = BNModule()
    trainer = L.Trainer(strategy=AdasumStrategy(overlap=overlap), accelerator="cpu", max_epochs=2,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False))
    bn = module.net[1]
    assert int(bn.num_batches_tracked) == 2 * N // (4 * comm.Get_size())
    assert_identical_across_ranks(comm, list(module.net.parameters()) + list(module.net.buffers()))
    # the same validation on every rank: the whole data set, the module in eval mode (running statistics)
    module.eval()
    _, x, y = dataset().tensors
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(module.net(x), y)
    assert_identical_across_ranks(comm, [val])


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_local_steps_and_outer_optimizer_pass_through(comm):
    """Each of Lightning's optimizer steps is a local step; the ranks combine every ``local_steps``."""
    options = {"local_steps": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    module, trainer = fit(comm, **options)
    opt = trainer.strategy.optimizers[0]
    assert (opt.local_steps, opt.outer_lr, opt.outer_momentum, opt.delay) == (2, 0.7, 0.9, 0)
    steps = 2 * N // (4 * comm.Get_size())  # two epochs of this rank's shard, batches of 4
    assert opt.boundaries == steps // 2
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    net = model_init()
    hand = at.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), **options)
    sampler = DistributedSampler(dataset(), comm.Get_size(), comm.Get_rank(), shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _, x, y in loader:
            torch.nn.functional.mse_loss(net(x), y).backward()
            hand.step()
            hand.zero_grad()
    for a, b in zip(module.net.parameters(), net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class ValidatedBN(BNModule):
    """Records, at every validation, a checksum of its parameters and buffers."""

    def __init__(self):
        super().__init__()
        self.validated: list[float] = []

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append(float(sum(t.double().sum() for t in [*self.parameters(), *self.buffers()])))
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("options", [{"local_steps": 5}, {"local_steps": 5, "delay": 1}, {"local_steps": 2, "delay": 1}],
                         ids=["local5", "local5-delay", "local2-delay"])
@TRAINING_SIZES
def test_fit_with_local_steps_ends_and_validates_on_the_common_model(comm, options):
    """Windows of local steps that the epochs cut short: every validation during fit() and the end of fit()
    see one model on every rank (parameters and BatchNorm buffers), whatever window was open."""
    module = ValidatedBN()
    trainer = L.Trainer(strategy=AdasumStrategy(**options), accelerator="cpu", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False),
                    DataLoader(dataset(), batch_size=8, shuffle=False))
    assert_identical_across_ranks(comm, list(module.net.parameters()) + list(module.net.buffers()))
    # the sanity check and the two epochs' validations, each the same on every rank
    assert len(module.validated) == 3
    assert comm.allgather(module.validated) == [module.validated] * comm.Get_size()
    opt = trainer.strategy.optimizers[0]
    assert opt.closed and opt.boundaries >= 2


# --- gradient clipping: the reduced gradient for sum/mean (as DDP), each rank's own for adasum -------------


def clip_(params, clip: float, algorithm: str) -> None:
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        torch.nn.utils.clip_grad_value_(params, clip)


def farthest(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference between the two models' parameters."""
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def fit_clipped(comm, *, clip, algorithm, accumulate=1, epochs=2, **strategy):
    module = Module()
    trainer = L.Trainer(strategy=AdasumStrategy(**strategy), accelerator="cpu", max_epochs=epochs,
                        accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        gradient_clip_algorithm=algorithm, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False))
    return module, trainer


def clipped_serially(size, *, clip, algorithm, op, accumulate=1, epochs=2, per_rank=False):
    """The data-parallel training of ``fit_clipped`` on one process: every rank's gradient of its shard's
    window, their mean (or sum), clipped (or each rank's own clipped first: ``per_rank``), one SGD step."""
    net = model_init()
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    samplers = [DistributedSampler(dataset(), size, r, shuffle=True, seed=0) for r in range(size)]
    for epoch in range(epochs):
        shards = []
        for s in samplers:
            s.set_epoch(epoch)
            shards.append(list(DataLoader(dataset(), batch_size=4, sampler=s)))
        for w in range(len(shards[0]) // accumulate):
            grads = []
            for shard in shards:
                net.zero_grad()
                for _, x, y in shard[w * accumulate:(w + 1) * accumulate]:
                    (torch.nn.functional.mse_loss(net(x), y) / accumulate).backward()
                if per_rank:
                    clip_(params, clip, algorithm)
                grads.append([p.grad.clone() for p in params])
            for p, gs in zip(params, zip(*grads)):
                p.grad = torch.stack(gs).sum(0) / (size if op == "mean" else 1)
            if not per_rank:
                clip_(params, clip, algorithm)
            opt.step()
    return net


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, algorithm, accumulate, overlap",
                         [("mean", "norm", 1, False), ("mean", "value", 2, False), ("sum", "norm", 2, False),
                          ("mean", "norm", 1, True)])
@TRAINING_SIZES
def test_gradient_clipping_clips_the_reduced_gradient(comm, op, algorithm, accumulate, overlap):
    """Trainer(gradient_clip_val=...) with op='mean'/'sum' clips the reduced gradient, as DDPStrategy does:
    the training equals the serial one that clips the ranks' mean (sum) gradient, and differs from clipping
    each rank's own gradient before the reduction."""
    clip = 0.02 if algorithm == "norm" else 0.002  # small enough to clip at every step
    module, trainer = fit_clipped(comm, clip=clip, algorithm=algorithm, accumulate=accumulate, op=op,
                                  overlap=overlap)
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    size = comm.Get_size()
    steps = 2 * N // (4 * size * accumulate)
    assert trainer.strategy.optimizers[0].boundaries == steps
    if overlap:  # the reduction ahead of the clipping waits for the buckets reduced during backward
        assert trainer.strategy.optimizers[0].overlapped_boundaries > 0
    reduced = clipped_serially(size, clip=clip, algorithm=algorithm, op=op, accumulate=accumulate)
    own = clipped_serially(size, clip=clip, algorithm=algorithm, op=op, accumulate=accumulate, per_rank=True)
    for a, b in zip(module.net.parameters(), reduced.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    apart = farthest(reduced, own)
    assert apart > 1e-4, f"the test cannot tell the two clippings apart ({apart})"
    unclipped = clipped_serially(size, clip=1e9, algorithm="norm", op=op, accumulate=accumulate)
    apart = farthest(reduced, unclipped)
    assert apart > 1e-4, f"the clipping changed nothing ({apart})"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
def test_gradient_clipping_with_adasum_clips_each_ranks_own_gradient(comm, overlap):
    """op='adasum': each rank's own gradient is clipped before its local step, as
    DistributedOptimizer.clip_grad_norm_ does in a hand-written loop; with overlap the Trainer's clipping
    keeps the boundaries in step() (the overlap is turned off, and nothing raises)."""
    module, trainer = fit_clipped(comm, clip=0.02, algorithm="norm", overlap=overlap)
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    assert trainer.strategy.optimizers[0].overlapped_boundaries == 0
    net = model_init()
    opt = at.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    sampler = DistributedSampler(dataset(), comm.Get_size(), comm.Get_rank(), shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _, x, y in loader:
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.clip_grad_norm_(0.02)
            opt.step()
            opt.zero_grad()
    for a, b in zip(module.net.parameters(), net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_gradient_clipping_with_16_mixed_and_a_scaler_is_refused(comm):
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(strategy=AdasumStrategy(op="mean"), accelerator="cpu", max_epochs=1, plugins=[plugin],
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="does not clip gradients through the Trainer"):
        warnings.simplefilter("ignore")
        trainer.fit(Module(), DataLoader(dataset(), batch_size=4, shuffle=False))


# --- with local steps, callbacks and module hooks see the combined model ------------------------------------


def digest(module: torch.nn.Module) -> str:
    import hashlib

    tensors = [*module.parameters(), *module.buffers()]
    return hashlib.sha256(b"".join(raw_bytes(t) for t in tensors)).hexdigest()[:16]


class Recorder(L.Callback):
    """Records a digest of the module at on_validation_start and on_train_end."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def on_validation_start(self, trainer, pl_module):
        self.seen.append(("validation", digest(pl_module)))

    def on_train_end(self, trainer, pl_module):
        self.seen.append(("end", digest(pl_module)))


class HookedBN(BNModule):
    """Records the same digests in its own hooks, and one in its first validation step."""

    def __init__(self):
        super().__init__()
        self.hooked: list[tuple[str, str]] = []
        self.validated: list[str] = []

    def on_validation_start(self):
        self.hooked.append(("validation", digest(self)))

    def on_train_end(self):
        self.hooked.append(("end", digest(self)))

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append(digest(self))
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_callbacks_and_hooks_see_the_combined_model_with_local_steps(comm):
    """local_steps=5 and epochs of 6 (2 ranks) or 4 (3 ranks) steps, validation every second epoch: a window
    is open at the validation and at the end of fit(). A user callback and the module's own hooks at
    on_validation_start and on_train_end see the combined model, the same on every rank: the one validated,
    and at the end the one fit() leaves."""
    size = comm.Get_size()
    recorder, module = Recorder(), HookedBN()
    trainer = L.Trainer(strategy=AdasumStrategy(local_steps=5), accelerator="cpu", max_epochs=3,
                        check_val_every_n_epoch=2, callbacks=[recorder], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    per_epoch = math.ceil(N / size / 4)  # steps
    assert (2 * per_epoch) % 5 and per_epoch % 5  # open windows at the validation and at the end
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False),
                    DataLoader(dataset(), batch_size=8, shuffle=False))
    assert not any(type(c).__name__ == "_CombineFirst" for c in trainer.callbacks)
    final = digest(module)
    assert_identical_across_ranks(comm, list(module.net.parameters()) + list(module.net.buffers()))
    # the sanity check, the validation after epoch 2, the end of fit()
    assert [k for k, _ in recorder.seen] == ["validation", "validation", "end"]
    assert module.hooked == recorder.seen
    assert comm.allgather(recorder.seen) == [recorder.seen] * size
    assert [d for k, d in recorder.seen if k == "validation"] == module.validated
    assert recorder.seen[-1] == ("end", final)
    assert len({d for _, d in recorder.seen}) == 3  # the model moved between the points
    opt = trainer.strategy.optimizers[0]
    assert opt.closed and opt.boundaries == 2 * per_epoch // 5 + 1 + per_epoch // 5 + 1


class ClipsInHook(Module):
    """16-mixed with a scaler: clips in on_before_optimizer_step, as the refusal above advises."""

    def __init__(self):
        super().__init__()
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        norm = optimizer.clip_grad_norm_(0.02)
        self.norms.append(float(norm))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_clipping_in_the_hook_with_16_mixed_and_a_scaler(comm):
    """The gradients the hook clips are unscaled and reduced (op='mean'): the same norm on every rank."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = ClipsInHook()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(strategy=AdasumStrategy(op="mean"), accelerator="cpu", max_epochs=1, plugins=[plugin],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=False))
    assert len(module.norms) == N // (4 * comm.Get_size())
    norms = [repr(n) for n in module.norms]  # the first steps overflow at the scaler's first scales (skipped)
    assert comm.allgather(norms) == [norms] * comm.Get_size()
    # unscaled: of the order of the fp32 gradients' norms, not 2**16 times that
    finite = [n for n in module.norms if math.isfinite(n)]
    assert finite and all(0 < n < 100 for n in finite), module.norms
    assert_identical_across_ranks(comm, list(module.net.parameters()))
    assert all(torch.isfinite(p).all() for p in module.net.parameters())


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_fit_inside_elastic_run_is_refused(comm):
    """Lightning does not go on after a rank's death (its loop, optimizers and progress stay on the old
    world): ``fit()`` inside ``adasum.torch.elastic.run`` raises on every rank, before any training."""
    from adasum.torch import elastic

    @elastic.run
    def train(state):
        fit(comm, epochs=1)

    with pytest.raises(RuntimeError, match=r"rank \d: AdasumStrategy: Lightning's Trainer inside "
                                           r"adasum.torch.elastic.run \(or hvd.elastic.run\) is not supported"):
        train(elastic.State())
    assert not elastic.inside_run()
    module, _ = fit(comm, epochs=1)  # outside run, as before
    assert_identical_across_ranks(comm, list(module.net.parameters()))
