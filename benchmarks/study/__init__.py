"""The convergence study behind ``benchmarks/convergence.py`` (the command line), in parts:

- :mod:`study.schedules`: the schedules (op and learning-rate rule), the configurations, the warmup;
- :mod:`study.tasks`: the tasks (MNIST-1D with SGD or AdamW, the character transformer) and their settings;
- :mod:`study.training`: one configuration's training on a communicator, and the DDP gradient hook's loop;
- :mod:`study.runs`: which runs (the sweep, the grid, the base rate) and the groups of ranks that train them;
- :mod:`study.report`: the summary over seeds, the tables and the JSON;
- :mod:`study.figures`: the plots.

Importing the package puts ``benchmarks/`` (``charlm``) and ``examples/`` (``model``) on ``sys.path``.
"""

import os
import sys

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(os.path.dirname(_BENCHMARKS), "examples"), _BENCHMARKS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
