"""The one compiled part of adasum: the float32/float64 kernels in ``adasum/_kernels.c``.

Everything else is in pyproject.toml. The extension is optional: without a C compiler the package still
installs and falls back to numpy kernels (slower; ``adasum.kernels_backend()`` says which is in use).
"""

from setuptools import Extension, setup

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
