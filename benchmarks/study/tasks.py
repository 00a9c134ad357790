"""The tasks (a data set, a model, an optimizer, a metric) and the study's settings for each."""

from __future__ import annotations

import math

import charlm  # benchmarks/ and examples/ are on sys.path (the package's __init__)
import torch
from model import build_model, evaluate, make_data

from .schedules import ALL, HEADLINE, NO_SUM

COLLAPSE_BELOW = 0.15      # accuracy that counts as back at chance (10 %: ten classes) ...
COLLAPSE_AFTER = 0.30      # ... once a run has reached this (it stops there), or
ENDED_FROM = 0.20          # ... at the end of a run that had reached this


class Mnist1d:
    """MNIST-1D and the example's 1-D CNN, SGD with Nesterov momentum; test accuracy (higher is better)."""

    name = "mnist1d"
    metric = "test accuracy"
    higher = True
    uniform_loss = math.log(10)

    def load(self, s):
        return make_data(s["num_samples"], s["data_seed"])

    def train_count(self, data, s) -> int:
        return len(data.y)

    def build(self, seed, s):
        return build_model(seed, s["channels"])

    def optimizer(self, model, lr, s):
        m = s["momentum"]
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=m, nesterov=m > 0)

    def loss(self, model, data, idx, s):
        return torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])

    def evaluate(self, model, data, rank, size, s) -> list[float]:
        part = slice(rank, None, size)
        loss, correct, count = evaluate(model, data.x_test[part], data.y_test[part])
        return [loss, correct, count]

    def measure(self, sums) -> tuple[float, float]:
        """(metric, test loss) from the evaluation sums over the group."""
        return sums[1] / sums[2], sums[0] / sums[2]

    def collapsed(self, value, best) -> bool:
        return value <= COLLAPSE_BELOW and best >= COLLAPSE_AFTER

    def ended_at_chance(self, value, best) -> bool:
        return value <= COLLAPSE_BELOW and best >= ENDED_FROM

    def cost(self, s) -> float:
        """Rough seconds per epoch on one core, for dealing configurations to groups."""
        return s["num_samples"] * 0.8 * 6e-5

    def describe(self, s) -> str:
        return (f"MNIST-1D, {int(s['num_samples'] * 0.8)} training and {s['num_samples'] - int(s['num_samples'] * 0.8)}"
                f" test signals; 1-D CNN with {s['channels']} channels; SGD, Nesterov momentum {s['momentum']}; "
                f"{s['batch_size']} signals per micro-batch and rank; {s['epochs']} epochs")

    def format(self, value) -> str:
        return f"{100 * value:.1f} %"


class Mnist1dAdamW(Mnist1d):
    """The same task with AdamW instead of SGD."""

    name = "mnist1d-adamw"

    def optimizer(self, model, lr, s):
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=s["weight_decay"])

    def describe(self, s) -> str:
        return super().describe(s).replace(f"SGD, Nesterov momentum {s['momentum']}",
                                           f"AdamW (weight decay {s['weight_decay']})")


class Chars:
    """Character-level transformer language model on the standard library's sources, AdamW; validation bits
    per character (lower is better)."""

    name = "chars"
    metric = "validation bits per character"
    higher = False
    uniform_loss = math.log(charlm.VOCAB)

    def load(self, s):
        return charlm.load_text(s["chars"])

    def train_count(self, data, s) -> int:
        return charlm.windows(len(data.train), s["context"])

    def build(self, seed, s):
        return charlm.build_model(seed, s["width"], s["layers"], s["heads"], s["context"])

    def optimizer(self, model, lr, s):
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=s["weight_decay"])

    def loss(self, model, data, idx, s):
        return charlm.loss(model, data.train, idx, s["context"])

    def evaluate(self, model, data, rank, size, s) -> list[float]:
        n = charlm.windows(min(len(data.valid), s["valid_chars"]), s["context"])
        nats, count = charlm.evaluate(model, data.valid, torch.arange(rank, n, size), s["context"])
        return [nats, 0.0, count]

    def measure(self, sums) -> tuple[float, float]:
        nats = sums[0] / sums[2]
        return charlm.bits_per_char(nats), nats

    def collapsed(self, value, best) -> bool:
        return False

    def ended_at_chance(self, value, best) -> bool:
        return False

    def cost(self, s) -> float:
        per_token = 1.7e-5 * (s["width"] / 64) ** 2 * s["layers"] / 2
        return s["chars"] * 0.9 * per_token

    def describe(self, s) -> str:
        return (f"character-level transformer ({s['layers']} layers, width {s['width']}, {s['heads']} heads, "
                f"context {s['context']}) on the first {s['chars']} characters of the standard library's "
                f"sources (90 % train, validated on {s['valid_chars']} of the rest); AdamW (weight decay "
                f"{s['weight_decay']}); {s['batch_size']} windows per micro-batch and rank; {s['epochs']} epochs")

    def format(self, value) -> str:
        return f"{value:.3f}"


TASKS = {t.name: t for t in (Mnist1d(), Chars(), Mnist1dAdamW())}
DEFAULT_TASKS = ("mnist1d", "chars")


def presets(quick: bool) -> dict:
    """The study's settings per task (``--set TASK.KEY=VALUE`` changes one). ``grid`` lists blocks of
    (accumulation, world sizes, schedules); every accumulation also gets its one-rank reference."""
    if not quick:
        return {
            "mnist1d": {"num_samples": 15000, "data_seed": 42, "channels": 32, "momentum": 0.9, "batch_size": 32,
                        "epochs": 15, "evals_per_epoch": 1, "warmup_epochs": 2,
                        "lrs": [0.01, 0.02, 0.03, 0.05, 0.07], "target": 0.85, "levels": [0.5, 0.7],
                        "grid": [[1, [2, 4, 6, 8, 16], ALL], [4, [8, 16], list(HEADLINE)]]},
            "chars": {"chars": 450000, "valid_chars": 25000, "context": 64, "width": 64, "layers": 2, "heads": 4,
                      "weight_decay": 0.01, "batch_size": 8, "epochs": 4, "evals_per_epoch": 2,
                      "warmup_epochs": 1, "lrs": [0.001, 0.002, 0.004, 0.008], "target": 2.8, "levels": [3.2, 2.5],
                      "grid": [[1, [8, 16], NO_SUM]]},
            "mnist1d-adamw": {"num_samples": 15000, "data_seed": 42, "channels": 32, "momentum": 0.0,
                              "weight_decay": 0.01, "batch_size": 32, "epochs": 15, "evals_per_epoch": 1,
                              "warmup_epochs": 2, "lrs": [0.002, 0.005, 0.01, 0.02], "target": 0.85,
                              "levels": [0.5, 0.7],
                              "grid": [[1, [8], ["adasum-x1", "adasum-grad-x1", "mean-sqrtP"]]]},
        }
    return {
        "mnist1d": {"num_samples": 3000, "data_seed": 42, "channels": 16, "momentum": 0.9, "batch_size": 32,
                    "epochs": 3, "evals_per_epoch": 1, "warmup_epochs": 1, "lrs": [0.02, 0.05], "target": 0.5,
                    "levels": [0.3], "grid": [[1, [2, 3, 6], ALL], [4, [3], list(HEADLINE)]]},
        "chars": {"chars": 30000, "valid_chars": 3000, "context": 32, "width": 32, "layers": 1, "heads": 2,
                  "weight_decay": 0.01, "batch_size": 8, "epochs": 1, "evals_per_epoch": 2, "warmup_epochs": 0.5,
                  "lrs": [0.002, 0.004], "target": 4.0, "levels": [4.5], "grid": [[1, [3, 6], NO_SUM]]},
        "mnist1d-adamw": {"num_samples": 3000, "data_seed": 42, "channels": 16, "momentum": 0.0,
                          "weight_decay": 0.01, "batch_size": 32, "epochs": 3, "evals_per_epoch": 1,
                          "warmup_epochs": 1, "lrs": [0.002, 0.004], "target": 0.5, "levels": [0.3],
                          "grid": [[1, [3], ["adasum-x1", "adasum-grad-x1", "mean-sqrtP"]]]},
    }
