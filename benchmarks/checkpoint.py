"""What the checkpoint's checksum costs: save_checkpoint against torch.save (flushed to disk, as
save_checkpoint flushes) and read_checkpoint against torch.load, on the same model, side by side.

    python benchmarks/checkpoint.py --mib 64 256 --repeats 7

One process (a world of one rank). Each repeat times the four in turn; the table gives the medians' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from adasum.torch import read_checkpoint, save_checkpoint


def _plain_save(state, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 256], help="model sizes in MiB")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        plain, checked = os.path.join(d, "plain.pt"), os.path.join(d, "checked.pt")
        print(f"{'MiB':>6} {'save/torch.save':>16} {'read/torch.load':>16}")
        for mib in args.mib:
            model = torch.nn.Linear(mib << 10, 256, bias=False)  # (mib·1024)·256 float32 = mib MiB
            times: dict[str, list[float]] = {"save": [], "plain save": [], "load": [], "plain load": []}
            for _ in range(args.repeats):
                for name, run in (("plain save", lambda: _plain_save({"model": model.state_dict()}, plain)),
                                  ("save", lambda: save_checkpoint(checked, model=model)),
                                  ("plain load", lambda: torch.load(plain, map_location="cpu", weights_only=True)),
                                  ("load", lambda: read_checkpoint(checked))):
                    t = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t)
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"{mib:>6} {m['save'] / m['plain save']:>16.2f} {m['load'] / m['plain load']:>16.2f}")


if __name__ == "__main__":
    main()
