"""The dtypes and ops the library knows, by name, with their sizes and codes: one table for every module.

Names are those numpy and torch print (``"float32"``, ``"bfloat16"``, …); codes are the small integers the
agreement's digest and the stall inspector's messages carry.
"""

from __future__ import annotations

__all__ = ["FLOAT_DTYPES", "INT_DTYPES", "OPS", "dtype_code", "itemsize", "op_code", "op_name"]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
             "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
INT_DTYPES = frozenset(_ITEMSIZE) - FLOAT_DTYPES
_DTYPE_CODES = {name: i for i, name in enumerate(sorted(_ITEMSIZE))}

# The ops, in the order of their codes (the stall inspector's messages also carry adasum.runtime.exchange's calls).
OPS = ("adasum", "sum", "mean", "exchange")


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype``."""
    return _ITEMSIZE[dtype]


def dtype_code(dtype: str) -> int:
    return _DTYPE_CODES[dtype]


def op_code(op: str) -> int:
    """The op's code, -1 for a name that is none of :data:`OPS`."""
    return OPS.index(op) if op in OPS else -1


def op_name(code: int) -> str | None:
    """The op of a code :func:`op_code` gave, None for any other number."""
    return OPS[code] if 0 <= code < len(OPS) else None
