"""``adasum.lightning``: the Lightning strategy. The code lives in :mod:`adasum.integrations.lightning`; this name is the
same module object, so ``import adasum.lightning`` and ``from adasum.lightning import ...`` see one module."""

import sys

from .integrations import lightning as _module

sys.modules[__name__] = _module
