"""The schedules (the op and the learning-rate rule of a run), the configurations the study trains, and
the warmup's rule."""

from __future__ import annotations

import math
from typing import NamedTuple


class Schedule(NamedTuple):
    name: str
    op: str        # the DistributedOptimizer's op
    scale: str     # "1", "2", "sqrt" (√P) or "linear" (P): the learning rate's multiple of the base
    warmup: bool
    local_steps: int = 1         # DistributedOptimizer(local_steps=): local steps per combine
    outer: tuple = (1.0, 0.0)    # (outer_lr, outer_momentum)
    delay: int = 0               # DistributedOptimizer(delay=)

    def factor(self, p: int) -> float:
        return {"1": 1.0, "2": 2.0, "sqrt": math.sqrt(p), "linear": float(p)}[self.scale]

    @property
    def label(self) -> str:
        scale = {"1": "×1", "2": "×2", "sqrt": "×√P", "linear": "×P"}[self.scale]
        if self.name == "single":
            return "1 rank"
        local = f" H{self.local_steps}" if self.local_steps > 1 else ""
        outer = f" outer {self.outer[0]:g}/{self.outer[1]:g}" if self.outer != (1.0, 0.0) else ""
        return f"{self.op} {scale}" + (" + warmup" if self.warmup else "") + local + outer + (
            " delay" if self.delay else "")


SINGLE = Schedule("single", "mean", "1", False)
SCHEDULES = {s.name: s for s in [
    Schedule("adasum-x1", "adasum", "1", False),
    Schedule("adasum-x1-warmup", "adasum", "1", True),
    Schedule("adasum-x2", "adasum", "2", False),
    Schedule("mean-x1", "mean", "1", False),
    Schedule("mean-sqrtP", "mean", "sqrt", False),
    Schedule("mean-linear-warmup", "mean", "linear", True),
    Schedule("sum-x1", "sum", "1", False),
    Schedule("adasum-grad-x1", "adasum-grad", "1", False),
    # local steps between combines (not in the default grids): H, and DiLoCo's outer Nesterov (0.7, 0.9)
    *[Schedule(f"{op}-x1-H{h}{'-diloco' if o else ''}", op, "1", False, h, (0.7, 0.9) if o else (1.0, 0.0))
      for op in ("adasum", "mean") for h in (4, 16) for o in (False, True)],
    *[Schedule(f"{op}-x1-H{h}-delay", op, "1", False, h, delay=1) for op in ("adasum", "mean") for h in (4, 16)],
    # gentler outer optimizers, for an inner optimizer that has momentum of its own: -o{outer_lr}m{momentum}
    *[Schedule(f"{op}-x1-H{h}-o{lr:g}m{mu:g}", op, "1", False, h, (lr, mu))
      for op in ("adasum", "mean") for h in (4, 16) for lr, mu in ((0.7, 0.5), (1.0, 0.5), (0.5, 0.0))],
    SINGLE,
]}
OPS = ("adasum", "adasum-grad", "mean", "sum")
# The four the closing comparison is about, in the order the tables show them.
HEADLINE = ("adasum-x1", "mean-x1", "mean-sqrtP", "mean-linear-warmup")

ALL = list(s for s in SCHEDULES if s not in ("single", "adasum-grad-x1") and SCHEDULES[s].local_steps == 1
           and SCHEDULES[s].outer == (1.0, 0.0))
NO_SUM = [s for s in ALL if s != "sum-x1"]


class Config(NamedTuple):
    task: str
    world_size: int
    schedule: str
    accumulation: int
    seed: int
    base_lr: float

    @property
    def name(self) -> str:
        return (f"{self.task}-P{self.world_size}-{self.schedule}-k{self.accumulation}-lr{self.base_lr:g}"
                f"-s{self.seed}")


def learning_rate(peak: float, update: int, warmup: int) -> float:
    """The rate of update ``update`` (from 0): ``peak``, reached linearly over the first ``warmup`` updates
    (``peak / warmup`` at the first) when ``warmup`` is above 0."""
    return peak * min(1.0, (update + 1) / warmup) if warmup else peak
