"""How the tests compare floating-point results: one rule, one place.

The rule (project standard). A matrix product over a different number of rows, a sum in
another order, a loop against a vectorised kernel, a chunked KV cache against the whole
sequence: each is *another computation*, and its last bits depend on the BLAS path (MKL's
instruction set or its vendor-neutral path), on PyTorch's own vector kernels and on how a
reduction is split across threads. Such results are compared with `assert_close` (or `close`),
whose tolerance follows from the dtype.

Bitwise equality (`assert_same`) is right only where

* both sides come from the same computation on the same shapes (the same call run twice, a
  model retrained from the same seed), or
* one side is a copy of the other (a view, a slice, `clone`, `torch.cat`, a cache's storage
  holding what it was given), or
* the tensors hold integers or booleans (masks, token ids, positions).

(A value that every path computes exactly by definition, such as a masked weight exp(-inf) = 0
checked with ``(w == 0).all()``, is a property of one result, not a comparison of two.)

`tests/test_numerics.py` fails if a test file compares bitwise any other way (a raw
`torch.equal(`, `atol=0` or `rtol=0`), so every bitwise comparison says which case it is.
"""

from __future__ import annotations

import torch

# Ulps (units of torch.finfo(dtype).eps) by which two computations of one short expression may
# differ. float32 and float64: a few roundings each (a dot product of up to ~64 terms of size
# ~1, summed in another order, differs by about sqrt(64) = 8 ulps at most in practice), with a
# margin of 2; the tests' comparisons needed at most 6 natively, under MKL_CBWR=COMPATIBLE and
# under ATEN_CPU_CAPABILITY=default. float16 and bfloat16: PyTorch's CPU kernels accumulate
# them in float32 and round each operation's result once, so two computations differ by those
# final roundings (half an ulp each side), 2 ulps with the margin, per operation chained.
ULPS = 16
ULPS_16_BIT = 2


def _dtype(x) -> torch.dtype:
    return x.dtype if isinstance(x, torch.Tensor) else torch.as_tensor(x).dtype


def tolerance(*dtypes: torch.dtype, factor: float = 1) -> tuple[float, float]:
    """(rtol, atol) for results computed in the coarsest of `dtypes`: ``ULPS * eps * factor``
    each, eps = torch.finfo(dtype).eps (``ULPS_16_BIT`` for float16 and bfloat16), so at factor 1
    float64: 3.6e-15, float32: 1.9e-6, float16: 2.0e-3, bfloat16: 1.6e-2. Integer and bool
    dtypes get (0, 0): exact.

    `factor` (>= 1) widens it for a longer computation, with the reason in a comment where it
    is given: a reduction of n > 64 terms (rounding errors of a sum grow like sqrt(n)), many
    roundings chained (a loop of steps each rounding its input again), or intermediate values
    far larger than 1 (atol is absolute: scores of size 1000 are rounded by about 1000 ulps of
    1)."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (a tolerance below the dtype's), got {factor}")
    floating = [d for d in dtypes if d.is_floating_point or d.is_complex]
    if not floating:
        return 0.0, 0.0
    coarsest = max(floating, key=lambda d: torch.finfo(d).eps)
    ulps = ULPS_16_BIT if torch.finfo(coarsest).bits == 16 else ULPS
    tol = ulps * torch.finfo(coarsest).eps * factor
    return tol, tol


def assert_close(actual, expected, *, msg=None, factor: float = 1, dtype=None):
    """actual equals expected to the rounding of another computation in their dtype.

    The tolerance is `tolerance(dtype, factor=factor)`; `dtype` defaults to the coarser of the
    two sides' dtypes. Give it when a side was converted after the computation (a float32
    result compared as ``.double()`` with a float64 reference was computed in float32).
    Shapes and dtypes must agree, as in torch.testing.assert_close; NaN equals NaN."""
    rtol, atol = tolerance(*([dtype] if dtype is not None else
                             [_dtype(actual), _dtype(expected)]), factor=factor)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=msg)


def close(actual, expected, *, factor: float = 1, dtype=None) -> bool:
    """Whether `assert_close(actual, expected, factor=factor, dtype=dtype)` would pass."""
    try:
        assert_close(actual, expected, factor=factor, dtype=dtype)
    except AssertionError:
        return False
    return True


def assert_same(actual, expected, *, msg=None):
    """actual equals expected exactly (NaN equals NaN, 0.0 equals -0.0; shapes and dtypes
    agree).

    Only for the cases the rule allows, which the caller should name in a comment: the same
    computation on the same shapes, a copy, or integer/bool tensors. For the result of another
    computation use `assert_close`."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=msg)
