"""Every recipe script under examples/ that the docs show an excerpt of, run as a user runs it:
``mpiexec -n 2 python -m mpi4py examples/SCRIPT.py``, from a serial test. Each script trains the small CNN of
examples/model.py on MNIST-1D for a few seconds and prints, on every rank, its final test accuracy and a
checksum of its parameters: it must exit 0, every rank must print the same line (one model), and the
accuracy must be far above chance (ten classes: 10 %). tests/docs/test_readme.py checks that the docs'
blocks are excerpts of these scripts."""

from __future__ import annotations

import importlib.util
import re

import pytest

from helpers import run_recipe

# Each case trains under mpiexec -n 2 for some seconds (scripts/run_tests.py --fast leaves slow tests out;
# its smoke tests at 2 ranks run the Accelerate recipe of tests/integrations/test_hf.py)
pytestmark = pytest.mark.slow

# (script, the framework it needs)
RECIPES = [
    ("train_quickstart.py", None),
    ("distributed_optimizer.py", None),
    ("ddp_hook.py", None),
    ("ddp_delta_hook.py", None),
    ("ddp_local_steps.py", None),
    ("diloco.py", None),
    ("fsdp_hsdp.py", None),
    ("fsdp_deltas.py", None),
    ("horovod_style.py", None),
    ("lightning_mnist1d.py", "lightning"),
    ("accelerate_ddp.py", "accelerate"),
    ("hf_trainer.py", "transformers"),
]

# The launcher may join the ranks' lines (one rank's line right after the other's, without a newline).
_LINE = re.compile(r"rank (\d+): final test accuracy ([0-9]\.[0-9]{4}), parameter checksum (-?[0-9]+\.[0-9]+(?:e[-+][0-9]+)?)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, needs", [
    pytest.param(script, needs, id=script, marks=[pytest.mark.frameworks] if needs else [])
    for script, needs in RECIPES])
def test_recipe_script_trains_under_mpiexec(script, needs):
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{script} needs {needs} (the frameworks extra)")
    run = run_recipe(script)  # from a scratch directory; the docs' accuracy test checks the same run
    out = f"{run.stdout}\n{run.stderr}"
    assert run.returncode == 0, f"examples/{script} failed (exit {run.returncode}):\n{out[-6000:]}"
    lines = {int(m[1]): (float(m[2]), m[3]) for m in _LINE.finditer(run.stdout)}
    assert sorted(lines) == [0, 1], f"examples/{script}: want the final line of both ranks, got:\n{out[-6000:]}"
    assert lines[0] == lines[1], f"examples/{script}: the ranks ended with different models: {lines}"
    accuracy = lines[0][0]
    assert accuracy > 0.25, f"examples/{script}: final test accuracy {accuracy:.1%}; chance is 10 %"
