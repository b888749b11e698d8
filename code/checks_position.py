"""The checks of Chapter 8, Position (the machinery: checking.py)."""

from __future__ import annotations

import math

import torch

from checking import Check, module_rules

# rope_interleaved(x, positions) -> rotated x

check_rope_interleaved = Check(
    "check_rope_interleaved", rules=[*module_rules("rotary_embedding", module="position")],
    unchanged="one sequence")


def _rope_by_loops(x, positions, layout="interleaved", exponent=2, sign=1, swap=False):
    """x rotated pair by pair, in float64: pairs (2i, 2i+1) ("interleaved") or (i, i + d/2)
    ("half"), angle sign * p * 10000**(-exponent*i/d), cos and sin exchanged if swap."""
    d = x.shape[-1]
    pos = torch.as_tensor(positions).expand(x.shape[:-1]).reshape(-1)
    rows = x.detach().to(torch.float64).reshape(-1, d)
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        p = int(pos[r])
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + d // 2)
            angle = sign * p * 10000.0 ** (-exponent * i / d)
            c, s = math.cos(angle), math.sin(angle)
            if swap:
                c, s = s, c
            u, v = float(rows[r, a]), float(rows[r, b])
            out[r, a] = u * c - v * s
            out[r, b] = v * c + u * s
    return out.reshape(x.shape)


def _rope_inputs():
    """{name: (where, x, positions)}."""
    g = torch.Generator().manual_seed(8)
    shifted = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])  # (B, L): 2 left pads
    return {
        "one sequence": ("x (6, 8), positions arange(6)",
                         torch.randn(6, 8, generator=g, dtype=torch.float64), torch.arange(6)),
        "heads and positions per sequence": (
            "x (B, H, L, d) = (2, 3, 5, 4), positions (B, 1, L) = (2, 1, 5)",
            torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64), shifted[:, None, :]),
        "far positions": ("x (4, 16), positions 1000, 2000, 3000, 4000",
                          torch.randn(4, 16, generator=g, dtype=torch.float64),
                          torch.tensor([1000, 2000, 3000, 4000])),
        **{f"random {i}": _rope_random(g, per_sequence=i == 2) for i in (1, 2)}}


def _rope_random(g, per_sequence: bool):
    """(where, x, positions) of sizes drawn from g: x (B, L, d), positions below 500, (L,) or,
    `per_sequence`, (B, L): one row of ids per sequence."""
    B, L, half = (int(n) for n in torch.randint(1, 6, (3,), generator=g))
    x = torch.randn(B, L, 2 * half, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 500, (B, L) if per_sequence else (L,), generator=g)
    return (f"x {tuple(x.shape)}, positions {tuple(positions.shape)} "
            f"{positions.tolist()}"), x, positions


def _rope_call(fn, where, x, positions):
    got = fn(x.clone(), positions)
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert tuple(got.shape) == tuple(x.shape), (
        f"{where}: expected the shape of x, {tuple(x.shape)}, got {tuple(got.shape)}")
    return got


def _rope_values(fn, name):
    where, x, positions = _rope_inputs()[name]
    got = _rope_call(fn, where, x, positions).to(torch.float64)
    want = _rope_by_loops(x, positions)
    # Angles computed in float32 (as Meta's reference code does) are off by up to about
    # p * 6e-8 radians, 2.4e-4 at p = 4000: the tolerance allows that much at the largest p.
    tol = 1e-6 + 5e-7 * float(torch.as_tensor(positions).max())
    close = lambda a, b: torch.allclose(a, b, rtol=tol, atol=tol)  # noqa: E731
    if close(got, want):
        return
    mistakes = [
        (dict(layout="half"), "the pairs are (i, i + d/2), the half-split layout of GPT-NeoX and "
         "Hugging Face; the interleaved layout pairs neighbours (2i, 2i+1)"),
        (dict(exponent=1), "the frequencies are 10000**(-i/d); use 10000**(-2i/d), with i the "
         "index of the pair"),
        (dict(swap=True), "cos and sin are swapped: the first entry of a pair becomes "
         "x_a cos - x_b sin"),
        (dict(sign=-1), "the rotation goes the wrong way (by -angle): the pair (x_a, x_b) becomes "
         "(x_a cos - x_b sin, x_b cos + x_a sin)"),
    ]
    if name != "one sequence":
        mistakes.append((dict(positions=torch.arange(x.shape[-2])),
                         "the positions given are ignored (arange(L) is used): each sequence's "
                         "own position ids must be used, broadcast over the heads"))
    for change, message in mistakes:
        wrong = _rope_by_loops(x, change.pop("positions", positions), **change)
        if close(got, wrong):
            raise AssertionError(f"{where}: {message}")
    err = float((got - want).abs().max())
    hint = ("; are the angles computed in a low precision? compute p * frequency in float64 "
            "to stay accurate at large p" if name == "far positions" else "")
    raise AssertionError(
        f"{where}: output differs from the rotation by loops by up to {err:.3g}{hint}")


@check_rope_interleaved.case("shape and dtype", keeps_dtype=True)
def _(fn):
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(1))  # float32
    got = _rope_call(fn, "x (3, 5, 6) float32, positions arange(5)", x, torch.arange(5))
    assert got.dtype == torch.float32, (
        f"x (3, 5, 6) float32: the result must keep x's dtype, float32, got {got.dtype}")
    assert torch.isfinite(got).all(), "x (3, 5, 6) float32: NaN or inf in the output"


@check_rope_interleaved.case("one sequence", 2)
def _(fn):
    _rope_values(fn, "one sequence")


@check_rope_interleaved.case("heads and positions per sequence", 2)
def _(fn):
    _rope_values(fn, "heads and positions per sequence")


@check_rope_interleaved.case("far positions")
def _(fn):
    _rope_values(fn, "far positions")


@check_rope_interleaved.case("sizes drawn at random")
def _(fn):
    for name in ("random 1", "random 2"):
        _rope_values(fn, name)


@check_rope_interleaved.case("half precision: x's dtype kept, angles exact", keeps_dtype=True)
def _(fn):
    # In bfloat16, 301 is not a number (it rounds to 300 or 302), so angles p * frequency
    # computed in x's dtype are off by a radian; float16 is off by as much near p = 2000.
    positions = torch.tensor([0, 1, 255, 301, 777, 1500, 2047])
    x = torch.randn(len(positions), 8, generator=torch.Generator().manual_seed(3))
    where = f"x ({len(positions)}, 8) float32, positions {positions.tolist()}"
    wide = _rope_call(fn, where, x, positions).double()
    assert torch.allclose(wide, _rope_by_loops(x, positions), rtol=1e-4, atol=1e-4), (
        f"{where}: the rotation is wrong in float32 already (the other cases say how); this "
        "case then checks it in bfloat16 and float16")
    for dtype, tol in ((torch.bfloat16, 4e-2), (torch.float16, 5e-3)):
        name = str(dtype).split(".")[1]
        where = f"x ({len(positions)}, 8) {name}, positions {positions.tolist()}"
        half = x.to(dtype)
        got = _rope_call(fn, where, half, positions)
        assert got.dtype == dtype, (
            f"{where}: the result must keep x's dtype, {dtype}, got {got.dtype}")
        want = _rope_by_loops(half, positions)
        err = (got.double() - want).abs().amax(-1)  # (L,), by position
        scale = float(half.double().abs().max())
        if bool((err > tol * scale).any()):
            p = int(positions[int(err.argmax())])
            raise AssertionError(
                f"{where}: at position {p} the result differs from the exact rotation by "
                f"{float(err.max()):.3g}: compute the angles p * frequency in float64 (in x's "
                "half-precision dtype p itself may not be representable), then rotate in x's "
                "dtype or wider and convert back")
