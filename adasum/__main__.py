"""``python -m adasum``: print the environment report (:mod:`adasum.envreport`) and exit.

Under a launcher (``mpiexec -n 2 python -m mpi4py -m adasum``) every rank takes part and rank 0 prints.
"""

import sys

from .envreport import main

sys.exit(main())
