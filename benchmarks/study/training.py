"""One configuration's training on the ranks of a communicator (its curve, its divergence, its record), and
the loop's stand-in for a DDP model with the gradient hook."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from model import shard_batches
from mpi4py import MPI

import adasum.torch as at

from .schedules import SCHEDULES, Config, learning_rate
from .tasks import TASKS


def train(cfg: Config, data, comm: MPI.Intracomm, s: dict) -> dict:
    """Train ``cfg`` on the ranks of ``comm`` (collective); returns its record (the same on every rank). The
    curve starts at epoch 0, the untrained model."""
    run = Run(cfg, data, comm, s)
    run.best = run.measure(0, 0.0, 0)["metric"]
    started = time.perf_counter()
    for epoch in range(1, s["epochs"] + 1):
        run.epoch(epoch)
        if run.reason is not None:
            break
    if run.reason is None and run.task.ended_at_chance(run.history[-1]["metric"], run.best):
        run.reason = "ended at chance"
    return run.record(started)


class Run:
    """The state of one configuration's training: the model, its optimizer, the rate's schedule, the curve
    (one entry per evaluation), the best metric so far and why the run stopped (None while it goes on)."""

    def __init__(self, cfg: Config, data, comm: MPI.Intracomm, s: dict):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if self.size != cfg.world_size:
            raise ValueError(f"configuration {cfg.name} needs {cfg.world_size} ranks, the communicator has "
                             f"{self.size}")
        self.cfg, self.data, self.comm, self.s = cfg, data, comm, s
        self.task, self.schedule = TASKS[cfg.task], SCHEDULES[cfg.schedule]
        self.lr = cfg.base_lr * self.schedule.factor(self.size)
        self.model = self.task.build(cfg.seed, s)
        self.inner = self.task.optimizer(self.model, self.lr, s)
        if self.schedule.op == "adasum-grad":
            self.optimizer = GradientAdasum(self.inner, accumulation_steps=cfg.accumulation, comm=comm)
        else:
            self.optimizer = at.DistributedOptimizer(self.inner, op=self.schedule.op,
                                                     accumulation_steps=cfg.accumulation, comm=comm,
                                                     local_steps=self.schedule.local_steps,
                                                     outer_lr=self.schedule.outer[0],
                                                     outer_momentum=self.schedule.outer[1],
                                                     delay=self.schedule.delay)
        self.n = self.task.train_count(data, s)
        self.micro = len(shard_batches(self.n, s["batch_size"], self.rank, self.size, 0, cfg.seed))
        self.per_epoch = math.ceil(self.micro / cfg.accumulation)
        self.warmup = max(1, round(s["warmup_epochs"] * self.per_epoch)) if self.schedule.warmup else 0
        evals = max(1, int(s["evals_per_epoch"]))
        self.eval_after = {max(0, round(j * self.micro / evals) - 1) for j in range(1, evals + 1)}
        self.history: list[dict] = []
        self.reason: str | None = None
        self.best = math.nan

    def measure(self, epoch: float, loss_sum: float, seen: int) -> dict:
        """Evaluate on the group's shards of the test data (collective); appends to the curve and returns
        the entry. ``loss_sum`` and ``seen``: the training loss summed over the ``seen`` samples since the
        last evaluation, on this rank."""
        sums = np.array([*self.task.evaluate(self.model, self.data, self.rank, self.size, self.s), loss_sum, seen],
                        dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        value, test_loss = self.task.measure(sums)
        h = {"epoch": round(epoch, 4), "updates": self.optimizer.boundaries, "metric": float(value),
             "test_loss": float(test_loss), "train_loss": float(sums[3] / sums[4]) if sums[4] else None}
        self.history.append(h)
        return h

    def epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 1), evaluating where the settings say; stops early when the run diverges
        (``reason`` set)."""
        cfg, s, optimizer = self.cfg, self.s, self.optimizer
        batches = shard_batches(self.n, s["batch_size"], self.rank, self.size, epoch - 1, cfg.seed)
        loss_sum, seen = 0.0, 0
        for i, idx in enumerate(batches):
            for group in self.inner.param_groups:
                group["lr"] = learning_rate(self.lr, optimizer.boundaries, self.warmup)
            loss = self.task.loss(self.model, self.data, idx, s)
            loss.backward()
            if i == len(batches) - 1:
                optimizer.force_boundary()  # every epoch ends with an update, its window averaged by its count
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += float(loss.detach()) * len(idx)
            seen += len(idx)
            # The skip is decided on the reduced values, so every rank of the group stops at the same step.
            if optimizer.step_was_skipped:
                self.reason = "non-finite update"
            if self.reason is None and i not in self.eval_after:
                continue
            self.judge(self.measure(epoch - 1 + (i + 1) / self.micro, loss_sum, seen))
            loss_sum, seen = 0.0, 0
            if self.reason is not None:
                return

    def judge(self, h: dict) -> None:
        """The divergence tests on evaluation ``h`` (the first reason found stays), then the best metric."""
        if self.reason is None:
            if not math.isfinite(h["train_loss"]):
                self.reason = "non-finite loss"
            elif h["train_loss"] > 1.1 * self.task.uniform_loss:
                self.reason = "loss above a uniform guess"
            elif self.task.collapsed(h["metric"], self.best):
                self.reason = "collapsed to chance"
        better = max if self.task.higher else min
        self.best = better(self.best, h["metric"]) if math.isfinite(h["metric"]) else self.best

    def first(self, level: float) -> dict | None:
        """The first evaluation at ``level`` or better."""
        higher = self.task.higher
        return next((h for h in self.history if (h["metric"] >= level if higher else h["metric"] <= level)), None)

    def record(self, started: float) -> dict:
        """The run's record; ``started``: its training's start on ``time.perf_counter``."""
        cfg, s, last, optimizer = self.cfg, self.s, self.history[-1], self.optimizer
        levels = sorted({*s["levels"], s["target"]})
        reached = self.first(s["target"])
        return {
            "name": cfg.name, "task": cfg.task, "world_size": self.size, "schedule": cfg.schedule,
            "op": self.schedule.op, "accumulation": cfg.accumulation, "seed": cfg.seed, "base_lr": cfg.base_lr,
            "lr": self.lr, "warmup_updates": self.warmup,
            "global_batch": self.size * s["batch_size"] * cfg.accumulation,
            "updates_per_epoch": self.per_epoch, "final": last["metric"], "best": self.best,
            "epochs_to_target": reached["epoch"] if reached else None,
            "updates_to_target": reached["updates"] if reached else None,
            "epochs_to": {f"{v:g}": (self.first(v) or {}).get("epoch") for v in levels},
            "diverged": self.reason is not None, "divergence": self.reason,
            "diverged_epoch": last["epoch"] if self.reason else None, "epochs_run": last["epoch"],
            "updates": optimizer.boundaries, "skipped_updates": optimizer.skipped_updates,
            "seconds": time.perf_counter() - started, "history": self.history,
        }


class GradientAdasum:
    """What a DDP model with :func:`adasum.torch.ddp.adasum_hook` does, in the loop's terms: at the end of a
    window the averaged gradients go through the hook (Adasum per parameter, on a duplicate of ``comm``),
    then the wrapped optimizer steps on every rank. The same calls as DistributedOptimizer, so that one
    training loop runs both."""

    def __init__(self, inner, accumulation_steps: int, comm: MPI.Intracomm):
        from adasum.torch.ddp import AdasumState

        self.inner, self.state = inner, AdasumState(comm=comm)
        self.window = at.AccumulationWindow(accumulation_steps)
        self.boundaries = self.skipped_updates = 0
        self.step_was_skipped = False

    def force_boundary(self) -> None:
        self.window.force()

    def step(self) -> None:
        from adasum.torch.ddp import adasum_hook

        if not self.window.record():
            return
        count = self.window.close()
        params = [p for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        torch._foreach_div_(grads, float(count))
        adasum_hook(self.state, _Bucket(grads)).wait()  # the reduction completes on the hook's thread
        self.step_was_skipped = not all(bool(torch.isfinite(g).all()) for g in grads)
        if self.step_was_skipped:
            self.skipped_updates += 1
        else:
            self.inner.step()
        self.boundaries += 1

    def zero_grad(self) -> None:
        if not self.window.seen:
            self.inner.zero_grad()


class _Bucket:
    """The two calls of a DDP GradBucket that the hook makes, over a list of gradients."""

    def __init__(self, grads):
        self._grads = grads

    def gradients(self):
        return self._grads

    def buffer(self):
        return self._grads[0]
