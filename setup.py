"""The one compiled part of adasum: the extension ``adasum.kernels._kernels``, one module built from the C files
``adasum/kernels/_kernels*.c`` (``adasum/kernels/_kernels.h`` says which file holds what).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the package still
installs and falls back to numpy kernels (slower; ``adasum.kernels_backend()`` says which is in use).
"""

import warnings

from setuptools import Extension, setup

# An editable install (pip install -e ., as scripts/setup.sh does) makes setuptools print a notice about
# folders named like the package; this repository has only the one, adasum/.
warnings.filterwarnings("ignore", message="Editable installation")

_SOURCES = ["_kernels.c", "_kernels_loops.c", "_kernels_operands.c", "_kernels_pair.c", "_kernels_mpi.c",
            "_kernels_small.c"]

setup(
    ext_modules=[
        Extension(
            "adasum.kernels._kernels",
            [f"adasum/kernels/{name}" for name in _SOURCES],
            depends=["adasum/kernels/_kernels.h"],
            # No FMA contraction: every rank computes bitwise the same results whatever its CPU.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
