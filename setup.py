"""The one compiled part of adasum: the float32/float64 kernels in ``adasum/_kernels.c``.

Everything else is in pyproject.toml. The extension is optional: without a C compiler the package still
installs and falls back to numpy kernels (slower; ``adasum.kernels_backend()`` says which is in use).
"""

import warnings

from setuptools import Extension, setup

# An editable install (pip install -e ., as scripts/setup.sh does) makes setuptools print a notice about
# folders named like the package; this repository has only the one, adasum/.
warnings.filterwarnings("ignore", message="Editable installation")

setup(
    ext_modules=[
        Extension(
            "adasum._kernels",
            ["adasum/_kernels.c"],
            # No FMA contraction: every rank computes bitwise the same results whatever its CPU.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
