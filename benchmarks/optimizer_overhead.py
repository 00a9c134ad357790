"""Step time of DistributedOptimizer at one rank against the bare optimizer it wraps.

    OMP_NUM_THREADS=1 python benchmarks/optimizer_overhead.py            # wall clock
    CLOCK=cpu OMP_NUM_THREADS=1 python benchmarks/optimizer_overhead.py  # CPU time of this process

The example's model (examples/model.py) and AdamW, micro-batches of 32; every variant runs 40 iterations
per repeat, interleaved, and the table shows medians over 15 repeats, relative to the bare optimizer: the
whole iteration (forward, backward, step, zero_grad) and step + zero_grad alone.
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from model import build_model  # noqa: E402

import adasum.torch as at  # noqa: E402

CLOCK = time.process_time if os.environ.get("CLOCK") == "cpu" else time.perf_counter
KINDS = ["bare", "adasum-k1", "mean-k1", "adasum-k4"]


def make(kind):
    model = build_model(0, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind != "bare":
        op, k = kind.split("-k")
        opt = at.DistributedOptimizer(opt, op=op, accumulation_steps=int(k))
    return model, opt


def iterations(model, opt, x, y, n):
    full = step = 0.0
    for _ in range(n):
        t0 = CLOCK()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t1 = CLOCK()
        opt.step()
        opt.zero_grad()
        t2 = CLOCK()
        full += t2 - t0
        step += t2 - t1
    return full / n, step / n


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 40, generator=g), torch.randint(0, 10, (32,), generator=g)
    setups = {k: make(k) for k in KINDS}
    for k in KINDS:
        iterations(*setups[k], x, y, 20)  # warm-up
    res = {k: [] for k in KINDS}
    for _ in range(15):
        for k in KINDS:
            res[k].append(iterations(*setups[k], x, y, 40))
    base_full = statistics.median(r[0] for r in res["bare"])
    base_step = statistics.median(r[1] for r in res["bare"])
    for k in KINDS:
        f = statistics.median(r[0] for r in res[k])
        s = statistics.median(r[1] for r in res[k])
        print(f"{k:10s} iteration {1e3 * f:7.3f} ms ({100 * (f / base_full - 1):+5.1f}%)   "
              f"step+zero_grad {1e3 * s:6.3f} ms ({100 * (s / base_step - 1):+6.1f}%)")


if __name__ == "__main__":
    main()
