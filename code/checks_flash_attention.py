"""The checks of Chapter 10, FlashAttention (the machinery: checking.py)."""

from __future__ import annotations

import functools

import torch

from checking import Check, softmax_rules

# merge_partials(m1, ell1, y1, m2, ell2, y2) -> (m, ell, y)

check_merge_partials = Check("check_merge_partials", rules=softmax_rules(),
                             unchanged="two blocks")


def _partial(z: torch.Tensor, v: torch.Tensor):
    """The partial result of one block of keys, by its definition: z (..., L, c) scores of the
    block (-inf = not visible), v (..., c, Ev) its values -> m (..., L) the largest score,
    ell (..., L) the sum of exp(z - m), y (..., L, Ev) the sum of exp(z - m) * v. A row that
    sees no key of the block has m = -inf, ell = 0, y = 0."""
    m = z.amax(dim=-1) if z.shape[-1] else z.new_full(z.shape[:-1], float("-inf"))
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    e = torch.exp(z - shift[..., None])  # (..., L, c), 0 where z = -inf
    return m, e.sum(dim=-1), e @ v


def _merge_inputs(name: str):
    """(where, z, v, split): scores z (..., L, S) and values v (..., S, Ev) of a case, and the
    index where the keys split into block 1 and block 2."""
    g = torch.Generator().manual_seed(10)
    if name.startswith("random"):  # sizes drawn at random, some rows blind to a block
        g.manual_seed(20 + int(name.split()[-1]))
        batch, L, S, Ev = (int(n) for n in torch.randint(1, 6, (4,), generator=g))
        S += 1
        split = int(torch.randint(1, S, (), generator=g))
        z = 3 * torch.randn(batch, L, S, generator=g, dtype=torch.float64)
        z[torch.rand(batch, L, S, generator=g) < 0.3] = float("-inf")
        return (f"scores {tuple(z.shape)}, keys 0-{split - 1} | {split}-{S - 1}, some -inf", z,
                torch.randn(batch, S, Ev, generator=g, dtype=torch.float64), split)
    if name == "two blocks":  # moderate scores, a batch axis, L != Ev
        z = 2 * torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
        return "scores (2, 5, 7), keys 0-3 | 4-6", z, torch.randn(2, 7, 3, generator=g,
                                                                  dtype=torch.float64), 4
    if name == "large scores":  # block 2 in the thousands: exp of a score overflows
        z = torch.randn(4, 6, generator=g, dtype=torch.float64)
        z[:, 3:] += 1000.0
        z[1:3, :3] += 2000.0  # rows 1 and 2: block 1 is the larger
        return "scores (4, 6) near 1000 and 2000, keys 0-2 | 3-5", z, torch.randn(
            6, 2, generator=g, dtype=torch.float64), 3
    # "empty blocks": row 0 sees only block 2, row 1 only block 1, row 2 nothing at all
    z = torch.randn(3, 5, generator=g, dtype=torch.float64)
    z[0, :2] = z[1, 2:] = z[2, :] = float("-inf")
    return ("scores (3, 5), keys 0-1 | 2-4; row 0 sees only block 2, row 1 only block 1, "
            "row 2 no key"), z, torch.randn(5, 4, generator=g, dtype=torch.float64), 2


def _merge_call(fn, where, part1, part2):
    """fn(*part1, *part2), checked for type and shapes."""
    try:
        got = fn(*part1, *part2)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}. m and ell are (..., L), one number per "
            "query row, and y is (..., L, Ev): to scale the rows of y by a factor of shape "
            "(..., L), index it as factor[..., None]") from None
    assert isinstance(got, tuple) and len(got) == 3, (
        f"{where}: return a tuple (m, ell, y), got {type(got).__name__}")
    for label, t, like in zip(("m", "ell", "y"), got, part1):
        assert isinstance(t, torch.Tensor), f"{where}: {label} must be a tensor"
        assert t.shape == like.shape, (
            f"{where}: {label} must have shape {tuple(like.shape)}, as {label}1 has; got "
            f"{tuple(t.shape)}")
    return got


def _float32_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got equals want to float32's precision (what a merge computed in float32 reaches)."""
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def _merge_values(fn, name: str):
    """Merge the partial results of the two blocks of a case and compare with the partial
    result of all the keys at once; if they differ, name the mistake."""
    where, z, v, split = _merge_inputs(name)
    part1 = _partial(z[..., :split], v[..., :split, :])
    part2 = _partial(z[..., split:], v[..., split:, :])
    m, ell, y = _merge_call(fn, where, part1, part2)
    want_m, want_ell, want_y = _partial(z, v)
    close = functools.partial(torch.allclose, rtol=1e-9, atol=1e-12, equal_nan=True)
    (m1, ell1, y1), (m2, ell2, y2) = part1, part2
    bad = m.isnan() | ell.isnan() | y.isnan().any(dim=-1)  # (..., L)
    if (bad & (want_m == float("-inf"))).any():
        rows = (bad & (want_m == float("-inf"))).nonzero()[:, -1].tolist()
        raise AssertionError(
            f"{where}: NaN in rows {rows} (0-based), which see no key in either block. A "
            "block that a row does not see has m = -inf, ell = 0, y = 0, and "
            "exp(-inf - (-inf)) is NaN: where the new maximum is -inf, shift by 0 instead")
    if bad.any():
        raise AssertionError(
            f"{where}: NaN or inf in the result (inf / inf, or inf * 0). Only differences of "
            "scores may be exponentiated, and only ones <= 0: rescale each block by "
            "exp(its maximum - the new maximum), never by exp(a maximum) alone")
    # The statement asks for no dtype: a merge computed in float32 inside is right to float32's
    # precision (about 1e-7 relative on these float64 inputs), and no mistake is that small.
    if all(_float32_close(got, want) for got, want in ((m, want_m), (ell, want_ell),
                                                        (y, want_y))):
        return
    if not close(m, want_m):
        assert not close(m, m2), (
            f"{where}: m is the second block's maximum m2; the merged maximum is the larger "
            "of m1 and m2")
        assert not close(m, m1), (
            f"{where}: m is the first block's maximum m1; the merged maximum is the larger "
            "of m1 and m2")
        raise AssertionError(f"{where}: m must be the largest score of both blocks, "
                             "torch.maximum(m1, m2)")
    if not (ell.isfinite().all() and y.isfinite().all()):
        raise AssertionError(
            f"{where}: inf in ell or y. Only differences of scores may be exponentiated, and "
            "only ones <= 0: rescale each block by exp(its maximum - the new maximum), never "
            "by exp(a maximum) alone or by exp(new maximum - old maximum)")
    m_safe = torch.where(m.isfinite(), m, torch.zeros_like(m))
    f1 = torch.exp(m1 - m_safe)  # the factors that bring each block to the new maximum
    f2 = torch.exp(m2 - m_safe)
    if not close(ell, want_ell):
        mistakes = [
            (ell1 + ell2, "the running sums are added without rescaling: each block's ell is "
             "relative to its own maximum, so bring both to the new maximum first"),
            (ell1 / f1 + ell2 / f2, "the sums are rescaled by exp(new max - old max), the "
             "inverse of the right factor exp(old max - new max)"),
            (ell1 * torch.exp(m1 - m2) + ell2, "both sums are rescaled to the second block's "
             "maximum m2, not to the new maximum max(m1, m2): right only where m2 >= m1"),
            (ell1 * f1 + ell2, "only the first block's sum is rescaled; the second block's "
             "ell2 is relative to m2 and needs exp(m2 - m) too"),
        ]
        for wrong, message in mistakes:
            if close(ell, wrong):
                raise AssertionError(f"{where}: {message}")
        err = float((ell - want_ell).abs().max())
        raise AssertionError(f"{where}: ell differs from the sum of exp(score - m) over both "
                             f"blocks by up to {err:.3g}")
    if not close(y, want_y):
        g1, g2 = f1[..., None], f2[..., None]
        mistakes = [
            (y1 + y2, "ell is rescaled but y is not: the unnormalised outputs need the same "
             "factors as the sums"),
            (y1 / g1 + y2 / g2, "y is rescaled by exp(new max - old max), the inverse of the "
             "right factor"),
            (want_y / want_ell[..., None], "y is divided by ell: keep it unnormalised while "
             "merging, and divide by ell once, after the last block"),
            (y1 * g1 + y2, "only the first block's y is rescaled; y2 is relative to m2 and "
             "needs exp(m2 - m) too"),
            ((y1 * g1 + y2 * g2) / 2, "the two rescaled outputs are averaged; add them: "
             "the weights come from ell, at the end"),
        ]
        for wrong, message in mistakes:
            if close(y, wrong):
                raise AssertionError(f"{where}: {message}")
        err = float((y - want_y).abs().max())
        raise AssertionError(f"{where}: y differs from the sum of exp(score - m) * value over "
                             f"both blocks by up to {err:.3g}")


@check_merge_partials.case("shapes", 1)
def _(fn):
    for name in ("two blocks", "large scores", "empty blocks"):
        where, z, v, split = _merge_inputs(name)
        _merge_call(fn, where, _partial(z[..., :split], v[..., :split, :]),
                    _partial(z[..., split:], v[..., split:, :]))


@check_merge_partials.case("two blocks", 2)
def _(fn):
    _merge_values(fn, "two blocks")


@check_merge_partials.case("large scores", 1)
def _(fn):
    _merge_values(fn, "large scores")


@check_merge_partials.case("empty blocks", 1)
def _(fn):
    _merge_values(fn, "empty blocks")


@check_merge_partials.case("many blocks, folded", 1)
def _(fn):
    from attention import scaled_dot_product_attention as sdpa
    g = torch.Generator().manual_seed(11)
    q = 3 * torch.randn(6, 4, generator=g, dtype=torch.float64)  # (L, E)
    k = torch.randn(23, 4, generator=g, dtype=torch.float64)  # (S, E)
    v = torch.randn(23, 5, generator=g, dtype=torch.float64)  # (S, Ev)
    z = q @ k.T / 2.0  # (L, S), scale 1/sqrt(E)
    state = (torch.full((6,), float("-inf"), dtype=torch.float64),
             torch.zeros(6, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64))
    where = "six queries, 23 keys in blocks of 4 (the last of 3), from the empty state"
    for j0 in range(0, 23, 4):
        state = _merge_call(fn, where, state, _partial(z[:, j0:j0 + 4], v[j0:j0 + 4]))
    m, ell, y = state
    want, _ = sdpa(q, k, v)  # (L, Ev)
    got = y / ell[:, None]
    assert _float32_close(got, want), (
        f"{where}: y / ell after the last block differs from attention's output by up to "
        f"{float((got - want).abs().max()):.3g}")


@check_merge_partials.case("sizes drawn at random")
def _(fn):
    for number in (1, 2, 3):
        _merge_values(fn, f"random {number}")
