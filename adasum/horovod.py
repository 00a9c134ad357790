"""``adasum.horovod``: Horovod's torch API (`import adasum.horovod as hvd`). The code lives in :mod:`adasum.torch.horovod`; this name is the
same module object, so ``import adasum.horovod`` and ``from adasum.horovod import ...`` see one module."""

import sys

from .torch import horovod as _module

sys.modules[__name__] = _module
