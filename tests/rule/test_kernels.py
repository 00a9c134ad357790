"""The compiled kernels (adasum.kernels._kernels) against float64 numpy, across instruction sets and the fallback;
float32 and float64, and float16 and bfloat16 (as its uint16 bits)."""

from __future__ import annotations

import os
import platform
from fractions import Fraction

import numpy as np
import pytest

import adasum
from adasum import adapters
from adasum.kernels import native
from adasum.rule.combine import combine
from adasum.rule.sixteen import narrow, widen
from adasum.settings import from_environment

K = pytest.importorskip("adasum.kernels._kernels") if os.environ.get("ADASUM_ALLOW_NO_KERNELS") else None
if K is None:
    from adasum.kernels import _kernels as K  # the development and CI install must have built the extension


def _spans(n: int, rng) -> np.ndarray:
    """Consecutive spans over [0, n) of lengths 0 … 72 (around every step of the 32- and 8-lane loops) and
    larger."""
    cuts = [0]
    while cuts[-1] < n:
        cuts.append(min(n, cuts[-1] + int(rng.choice([0, 1, 7, 8, 9, 15, 31, 32, 33, 40, 63, 72, 1000]))))
    return np.array(list(zip(cuts[:-1], cuts[1:])), dtype=np.int64).reshape(-1, 2)


def _data(dtype, n=5000, seed=0):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * rng.uniform(0.1, 1e3)).astype(dtype)
    b = (rng.standard_normal(n) * rng.uniform(0.1, 1e3)).astype(dtype)
    return a, b, _spans(n, rng)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dots_match_float64(dtype):
    a, b, spans = _data(dtype)
    out = np.full((len(spans), 3), np.nan)
    K.dots(a, b, spans, out)
    x, y = a.astype(np.float64), b.astype(np.float64)
    for (s, e), got in zip(spans, out):
        want = [x[s:e] @ y[s:e], x[s:e] @ x[s:e], y[s:e] @ y[s:e]]
        scale = [np.abs(x[s:e]) @ np.abs(y[s:e]), want[1], want[2]]
        np.testing.assert_array_less(np.abs(got - want), 1e-14 * np.asarray(scale) + 1e-300)


def _dots_in_the_documented_order(x: np.ndarray, y: np.ndarray) -> list[float]:
    """[x·y, x·x, y·y] summed in the order _kernels_loops.c fixes, one float64 operation at a time."""
    x, y = x.astype(np.float64).tolist(), y.astype(np.float64).tolist()
    n, out = len(x), []
    for u, v in [(x, y), (x, x), (y, y)]:
        lanes, i = [0.0] * 32, 0
        while i + 32 <= n:  # 1. lane i mod 32
            for j in range(32):
                lanes[j] += u[i + j] * v[i + j]
            i += 32
        f = [(lanes[j] + lanes[j + 8]) + (lanes[j + 16] + lanes[j + 24]) for j in range(8)]  # 2. fold to 8
        while i + 8 <= n:  # 3. lane i mod 8
            for j in range(8):
                f[j] += u[i + j] * v[i + j]
            i += 8
        total = (((f[0] + f[4]) + (f[1] + f[5])) + (f[2] + f[6])) + (f[3] + f[7])  # 4. to one, then the tail
        for k in range(i, n):
            total += u[k] * v[k]
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dots_follow_the_fixed_summation_order(dtype):
    """Bit for bit the order the kernels document, whatever instruction set runs them: every rank of a job
    gets the same coefficients from the same data."""
    rng = np.random.default_rng(8)
    for n in [0, 1, 7, 8, 31, 32, 33, 39, 40, 63, 64, 65, 100, 1000, 4099]:
        a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(dtype)
        b = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(dtype)
        out = np.empty((1, 3))
        K.dots(a, b, np.array([[0, n]]), out)
        assert out[0].tolist() == _dots_in_the_documented_order(a, b), n


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scaled_add_rounds_once(dtype):
    a, b, spans = _data(dtype, seed=1)
    rng = np.random.default_rng(2)
    ca, cb = rng.uniform(-2, 2, len(spans)), rng.uniform(-2, 2, len(spans))
    want = a.copy()
    for (s, e), p, q in zip(spans, ca, cb):
        want[s:e] = (p * a[s:e].astype(np.float64) + q * b[s:e].astype(np.float64)).astype(dtype)
    dst = np.full_like(a, np.nan)
    K.scaled_add(dst, a, b, spans, ca, cb)
    np.testing.assert_array_equal(dst, want)
    K.scaled_add(a, a, b, spans, ca, cb)  # in place
    np.testing.assert_array_equal(a, want)


def test_bad_arguments_raise():
    a = np.ones(10, np.float32)
    out = np.empty((1, 3))
    with pytest.raises(TypeError, match="float32 or float64"):
        K.dots(np.ones(10, np.int32), np.ones(10, np.int32), np.array([[0, 10]]), out)
    with pytest.raises(ValueError, match="same dtype"):
        K.dots(a, np.ones(10), np.array([[0, 10]]), out)
    with pytest.raises(IndexError, match=r"span 0 = \(3, 2\) is not a range"):
        K.dots(a, a, np.array([[3, 2]]), out)
    with pytest.raises(IndexError, match=r"span 0 = \(0, 11\)"):
        K.dots(a, a, np.array([[0, 11]]), out)
    with pytest.raises(ValueError, match="expected 48 bytes"):
        K.dots(a, a, np.array([[0, 5], [5, 10]]), out)
    with pytest.raises(ValueError):  # read-only destination
        ro = np.ones(10, np.float32)
        ro.flags.writeable = False
        K.scaled_add(ro, a, a, np.array([[0, 10]]), np.ones(1), np.ones(1))
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        K.dots(np.ones(20, np.float32)[::2], a, np.array([[0, 10]]), out)


def _cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU as Linux reports them (none where the compiled kernels have no
    SIMD loops: they exist for x86-64 only)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_instruction_sets_agree_bitwise(dtype):
    """Ranks on CPUs with AVX-512, with AVX2 only and with neither must compute the same bits."""
    a0 = np.random.default_rng(3).standard_normal(10007).astype(dtype)
    b = np.random.default_rng(4).standard_normal(10007).astype(dtype)
    spans = np.array([[0, 3], [3, 5000], [5000, 10007]])
    runs = {}
    try:
        for cap in ("auto", "avx2", "portable"):
            isa = native.use_isa(cap)
            a, out = a0.copy(), np.empty((3, 3))
            K.dots(a, b, spans, out)
            K.scaled_add(a, a, b, spans, np.array([0.3, 0.7, 1.1]), np.array([0.9, -0.2, 0.5]))
            runs[cap] = isa, out.tobytes(), a.tobytes()
    finally:
        native.use_isa(adasum.current_settings().kernels_isa)
    flags = _cpu_flags()
    widest = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "portable"
    assert runs["portable"][0] == "portable"
    assert runs["avx2"][0] == ("avx2" if "avx2" in flags else "portable")  # capped at AVX2
    assert runs["auto"][0] == widest, f"the CPU has {widest}, the kernels use {runs['auto'][0]}"
    assert runs["auto"][1:] == runs["portable"][1:]
    assert runs["avx2"][1:] == runs["portable"][1:]


def test_instruction_set_setting():
    assert from_environment({"ADASUM_KERNELS_ISA": "avx2"}).kernels_isa == "avx2"
    assert from_environment({}).kernels_isa == "auto"
    with pytest.raises(ValueError, match="kernels_isa must be one of"):
        adasum.Settings(kernels_isa="sse")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_fallback_agrees(dtype):
    a, b, spans = _data(dtype, seed=5)
    pieces = [(int(s), int(e)) for s, e in spans if e > s]  # as fusion.pieces makes them: no empty layer
    ca, cb = np.linspace(0.1, 1.5, len(pieces)), np.linspace(1.2, -0.3, len(pieces))
    adapter = adapters.NumpyAdapter()
    results = {}
    for backend in ("c", "numpy"):
        settings = adasum.Settings(kernels=backend)
        x = a.copy()
        dots = adapter.partial_dots(x, b, pieces, s=settings)
        adapter.scaled_add(x, b.copy(), pieces, ca, cb, s=settings)
        results[backend] = dots, x
    np.testing.assert_allclose(results["c"][0], results["numpy"][0], rtol=1e-12, atol=1e-9)
    rtol = 4 * np.finfo(dtype).eps  # numpy's float32 combine rounds twice, the kernel once
    np.testing.assert_allclose(results["c"][1], results["numpy"][1], rtol=rtol, atol=rtol * np.abs(results["c"][1]).max())


def test_backend_selection():
    old = adasum.configure(kernels="numpy")
    try:
        assert adapters.kernels_backend() == "numpy"
        adapters.set_kernels_backend("c")
        assert adapters.kernels_backend() == "c"
    finally:
        adasum.configure(old)
    with pytest.raises(ValueError, match="'c' or 'numpy'"):
        adapters.set_kernels_backend("fortran")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parts_operands_equal_the_packed_ones(dtype):
    """Any operand may be a list of per-span buffers; the bits are those of the packed call."""
    a, b, spans = _data(dtype, seed=6)
    a_parts = [a[s:e].copy() for s, e in spans]
    b_parts = [b[s:e].copy() for s, e in spans]
    ca, cb = np.linspace(0.2, 1.1, len(spans)), np.linspace(0.9, -0.4, len(spans))
    want_dots = np.empty((len(spans), 3))
    K.dots(a, b, spans, want_dots)
    for x, y in [(a_parts, b), (a, b_parts), (a_parts, b_parts)]:
        got_dots = np.empty((len(spans), 3))
        K.dots(x, y, spans, got_dots)
        assert want_dots.tobytes() == got_dots.tobytes()
    want = np.zeros_like(a)
    K.scaled_add(want, a, b, spans, ca, cb)
    got = np.zeros_like(a)
    K.scaled_add(got, a_parts, b, spans, ca, cb)
    assert want.tobytes() == got.tobytes()
    dst_parts = [np.zeros(e - s, dtype) for s, e in spans]
    K.scaled_add(dst_parts, a, b_parts, spans, ca, cb)
    assert np.concatenate(dst_parts).tobytes() == want[spans[0, 0]:spans[-1, 1]].tobytes()
    # dst may be b (the upper rank of a pair writes Adasum(left, right) over its own right vector)
    b2 = [p.copy() for p in b_parts]
    K.scaled_add(b2, a_parts, b2, spans, ca, cb)
    assert np.concatenate(b2).tobytes() == want[spans[0, 0]:spans[-1, 1]].tobytes()
    with pytest.raises(ValueError, match="expected .* parts"):
        K.dots(a_parts[:-1], b, spans, got_dots)
    with pytest.raises(ValueError, match="part 1: expected"):
        K.dots([a_parts[0], a_parts[1][:-1] if len(a_parts[1]) else np.ones(1, dtype), *a_parts[2:]], b, spans,
               got_dots)
    with pytest.raises(ValueError, match="same dtype"):
        K.dots([p.astype(np.float64 if dtype == "float32" else np.float32) for p in a_parts], b, spans, got_dots)
    ro = [p.copy() for p in a_parts]
    ro[-1].flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        K.scaled_add(ro, a, b, spans, ca, cb)


def test_layout_tells_adjacent_disjoint_and_overlapping():
    flat = np.zeros(100, np.float32)
    assert K.layout([flat[:10], flat[10:10], flat[10:40].reshape(5, 6), flat[40:]], True) == 2
    assert K.layout([flat[10:20], flat[:10]], True) == 1  # apart, out of order
    assert K.layout([flat[:10], flat[11:20]], True) == 1  # a gap
    assert K.layout([np.zeros(3), np.zeros(5)], True) == 1
    assert K.layout([flat[:10], flat[5:20]], True) == 0
    assert K.layout([flat[30:40], flat[:50]], True) == 0
    assert K.layout([flat[:10], flat[:10]], True) == 0  # the same tensor twice
    assert K.layout([], True) == 2
    ro = np.zeros(4)
    ro.flags.writeable = False
    assert K.layout([ro], False) == 2
    with pytest.raises((BufferError, ValueError)):
        K.layout([ro], True)
    with pytest.raises((BufferError, ValueError)):
        K.layout([flat[::2]], False)


@pytest.mark.parametrize("dtype,scale", [("float32", 0), ("float64", 0), ("float64", -1060), ("float64", 600)])
@pytest.mark.parametrize("counts", [(1, 1), (2, 1), (1, 3), (5, 3)])
def test_compiled_rule_is_the_python_rule(dtype, scale, counts):
    """The compiled pair() is the fast implementation of adasum.rule.combine's rule, not a second rule: on data
    whose dot products are exact in any order (small integers, times 2**scale), its coefficients and
    combine give the bits of the Python path (dot products, adasum.rule.combine.coefficients, scaled add), also
    where float64 partials must be rescaled (subnormal data, and squares beyond the range)."""
    rng = np.random.default_rng([9, *counts])
    bounds = [0, 7, 7, 40, 41, 300]  # an empty layer and a layer of one element among them
    left = np.ldexp(rng.integers(-8, 9, bounds[-1]).astype(dtype), scale)
    right = np.ldexp(rng.integers(-8, 9, bounds[-1]).astype(dtype), scale)
    right[7:40] = 0  # a zero side: its coefficient is exactly 1
    right[41:60] = left[41:60]  # parts parallel
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    span_array = np.array(spans, dtype=np.int64)
    adapter = adapters.NumpyAdapter()
    results = {}
    for backend in ("c", "numpy"):
        settings = adasum.Settings(kernels=backend)
        dst = np.empty_like(left)
        adapter.pair(left.copy(), right.copy(), dst, spans, span_array, *counts, s=settings)
        results[backend] = dst
    assert results["c"].tobytes() == results["numpy"].tobytes()
    if scale:
        return
    for s, e in spans:  # and the rule is the reference's
        want = combine(left[s:e], right[s:e], *counts).astype(dtype)
        np.testing.assert_allclose(results["c"][s:e], want, rtol=4 * np.finfo(dtype).eps, atol=0)


# --- float16 and bfloat16 (bfloat16 as its uint16 bits) ---------------------------------------------------

SIXTEEN = {"float16": np.float16, "bfloat16": np.uint16}


def _sixteen(dtype: str, bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(SIXTEEN[dtype])


def _same_bits(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    """16-bit arrays equal bit for bit, every NaN alike (which NaN of two propagates is not fixed)."""
    g, w = got.view(np.uint16).copy(), want.view(np.uint16).copy()
    with np.errstate(invalid="ignore"):
        g[np.isnan(widen(got))] = w[np.isnan(widen(want))] = 0xFFFF
    return bool((g == w).all())


def _every_isa():
    """Runs the block under every instruction set cap (a cap above the CPU's runs the widest it has)."""
    try:
        for cap in ("auto", "avx2", "portable"):
            yield native.use_isa(cap)
    finally:
        native.use_isa(adasum.current_settings().kernels_isa)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_dots_follow_the_fixed_summation_order(dtype):
    """16-bit data widened exactly in registers and summed in float64 in the one documented order: the same
    bits on every instruction set, subnormals included."""
    rng = np.random.default_rng(18)
    for isa in _every_isa():
        for n in [0, 1, 7, 8, 31, 32, 33, 39, 40, 63, 64, 65, 100, 1000, 4099]:
            a = narrow(rng.standard_normal(n) * 2.0 ** rng.integers(-26, 12, n), dtype)
            b = narrow(rng.standard_normal(n) * 2.0 ** rng.integers(-26, 12, n), dtype)
            out = np.empty((1, 3))
            K.dots(a, b, np.array([[0, n]]), out)
            assert out[0].tolist() == _dots_in_the_documented_order(widen(a), widen(b)), (isa, n)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_scaled_add_rounds_once(dtype):
    """Every 16-bit value (subnormals, the largest, infinities, NaN) combined with random ones: the float64
    value ca·a + cb·b rounded once to the dtype, to nearest, ties to even, on every instruction set; into a
    third buffer and in place."""
    a = _sixteen(dtype, np.arange(1 << 16))
    b = _sixteen(dtype, np.random.default_rng(19).integers(0, 1 << 16, 1 << 16))
    spans = np.array([[0, 3], [3, 1000], [1000, 1 << 16]], dtype=np.int64)
    coefficients = [(0.3, 0.7), (1.0, 0.0), (0.5, 0.5), (1e-7, 3.1), (1.0000001, -0.9999999), (1e6, 1e-30),
                    (1.0, -(1 - 2.0 ** -12))]
    for isa in _every_isa():
        for ca, cb in coefficients:
            with np.errstate(all="ignore"):
                want = narrow(ca * widen(a) + cb * widen(b), dtype)
            dst = np.empty_like(a)
            K.scaled_add(dst, a, b, spans, np.full(3, ca), np.full(3, cb))
            assert _same_bits(dst, want, dtype), (isa, ca, cb)
            x = a.copy()
            K.scaled_add(x, x, b, spans, np.full(3, ca), np.full(3, cb))
            assert _same_bits(x, want, dtype), (isa, ca, cb, "in place")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_scaled_add_near_midpoints(dtype):
    """Sums a hair above and below the middle between two 16-bit values (rounding them to float32 first
    lands on the middle, and the tie then goes the wrong way half the time) and exactly on it (ties to
    even), from the smallest steps to the largest values, with a NaN and infinities in the same rounds of
    eight elements: rounded once, on every instruction set, into a third buffer and in place."""
    rng = np.random.default_rng(22)
    p, lo, hi = (10, -14, 15) if dtype == "float16" else (7, -126, 127)
    n = 3 * 1024
    e = rng.integers(lo + 1, hi + 1, n)  # g's binade: half its step, 2^(e - p - 1), is a value of the type
    g = np.ldexp(1 + rng.integers(0, 1 << p, n) / (1 << p), e) * rng.choice([-1.0, 1.0], n)
    a, b = narrow(g, dtype), narrow(np.ldexp(1.0, e - p - 1) * np.sign(g), dtype)
    a[[5, 700, 2100]] = narrow(np.array([np.nan, np.inf, -np.inf]), dtype)
    spans = np.array([[0, n // 3], [n // 3, 2 * n // 3], [2 * n // 3, n]], dtype=np.int64)
    ca, cb = np.ones(3), np.array([1 + 2.0 ** -30, 1 - 2.0 ** -30, 1.0])
    x = np.concatenate([widen(a[s:t]) + q * widen(b[s:t]) for (s, t), q in zip(spans, cb)])
    with np.errstate(all="ignore"):
        want = narrow(x, dtype)
        twice = narrow(x.astype(np.float32).astype(np.float64), dtype)
    assert (want.view(np.uint16) != twice.view(np.uint16)).sum() > n // 5  # the data is what it says
    for isa in _every_isa():
        dst = np.empty_like(a)
        K.scaled_add(dst, a, b, spans, ca, cb)
        assert _same_bits(dst, want, dtype), isa
        y = a.copy()
        K.scaled_add(y, y, b, spans, ca, cb)
        assert _same_bits(y, want, dtype), (isa, "in place")


def test_sixteen_rounding_is_correct():
    """adasum.rule.sixteen.narrow rounds float64 once: numpy's own float16 cast (which rounds from float64
    directly), and for bfloat16 the nearest value (ties to even), checked exactly on values that lie near
    the middle between two bfloat16 values, where rounding through float32 first can go wrong."""
    rng = np.random.default_rng(20)
    v = rng.standard_normal(1 << 16) * 2.0 ** rng.uniform(-30, 18, 1 << 16)
    with np.errstate(over="ignore"):
        assert (narrow(v, "float16").view(np.uint16) == v.astype(np.float16).view(np.uint16)).all()
    lo = widen(narrow(rng.standard_normal(2000) * 2.0 ** rng.integers(-130, 120, 2000), "bfloat16"))
    step = np.abs(lo) * 2.0 ** -8
    near = np.concatenate([lo + step / 2 + step * 2.0 ** -30, lo + step / 2 - step * 2.0 ** -30, lo + step / 2])
    got = widen(narrow(near, "bfloat16"))
    for x, g in zip(near.tolist(), got.tolist()):
        if not np.isfinite(x) or x == 0:
            continue
        candidates = sorted({g, float(widen(narrow(np.array([np.nextafter(g, np.inf)]), "bfloat16"))[0]),
                             float(widen(narrow(np.array([np.nextafter(g, -np.inf)]), "bfloat16"))[0])})
        assert abs(Fraction(x) - Fraction(g)) <= min(abs(Fraction(x) - Fraction(c)) for c in candidates), x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("counts", [(1, 1), (2, 1), (1, 3)])
def test_sixteen_numpy_fallback_is_bitwise_the_compiled(dtype, counts):
    """The numpy kernels compute 16-bit data as the compiled ones do: dot products in float64, combine in
    float64 rounded once. On data whose dot products are exact in any order (small integers times a power
    of two, down to subnormals), pair() gives the same bits on both."""
    rng = np.random.default_rng([21, *counts])
    bounds = [0, 7, 7, 40, 41, 300, 1300]
    scale = -20 if dtype == "float16" else -130  # the last layer subnormal in the dtype
    left = rng.integers(-8, 9, bounds[-1]).astype(np.float64)
    right = rng.integers(-8, 9, bounds[-1]).astype(np.float64)
    left[300:], right[300:] = np.ldexp(left[300:], scale), np.ldexp(right[300:], scale)
    right[7:40] = 0
    right[41:60] = left[41:60]
    left, right = narrow(left, dtype), narrow(right, dtype)
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    span_array = np.array(spans, dtype=np.int64)
    adapter = adapters.NumpyAdapter()
    results = {}
    for backend in ("c", "numpy"):
        settings = adasum.Settings(kernels=backend)
        dst = np.empty_like(left)
        adapter.pair(left.copy(), right.copy(), dst, spans, span_array, *counts, s=settings)
        dots = adapter.partial_dots(left, right, spans, s=settings)
        results[backend] = dst.tobytes(), dots.tobytes()
    assert results["c"] == results["numpy"]
    for s, e in spans:  # and the rule is the reference's, rounded once
        want = narrow(combine(widen(left[s:e]), widen(right[s:e]), *counts), dtype)
        assert np.frombuffer(results["c"][0], left.dtype)[s:e].tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_row_sums_are_the_rule_bit_for_bit(dtype):
    """The compiled sum of 16-bit rows (what 16-bit sums and means add) is adasum.rule.sum16's float32 sum
    in row order, divided, rounded once, bit for bit on every instruction set: subnormal and overflowing
    results, every block boundary; a NaN result is reported, for the rule to give its bits."""
    from adasum.rule.sum16 import narrow_16bit, sum_rows_16bit

    rng = np.random.default_rng(31)
    code = int(dtype == "bfloat16")
    for isa in _every_isa():
        for size in (1, 2, 3, 5):
            for n in (0, 1, 7, 8, 9, 2047, 2048, 2049, 5000):
                x = (rng.standard_normal((size, n)) * 2.0 ** rng.integers(-30, 16, (size, n))).astype(np.float32)
                rows = narrow_16bit(x.reshape(-1), dtype).reshape(size, n)
                rows[rows & 0x7C00 == 0x7C00] = 0  # float16 infinities can meet as inf - inf: NaN
                for divisor in sorted({1, size, 3}):
                    out = np.empty(n, np.uint16)
                    assert not K.sum_rows16(rows, out, code, divisor), (isa, size, n, divisor)
                    want = sum_rows_16bit(rows, dtype, divisor)
                    assert out.tobytes() == want.tobytes(), (isa, dtype, size, n, divisor)
        nan_bits = 0x7E00 if dtype == "float16" else 0x7FC0
        rows = np.array([[nan_bits, 0, 1], [0, 0, 1]], np.uint16)
        assert K.sum_rows16(rows, np.empty(3, np.uint16), code, 1)
