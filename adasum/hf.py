"""``adasum.hf``: the Hugging Face Trainer callback. The code lives in :mod:`adasum.integrations.hf`; this name is the
same module object, so ``import adasum.hf`` and ``from adasum.hf import ...`` see one module."""

import sys

from .integrations import hf as _module

sys.modules[__name__] = _module
