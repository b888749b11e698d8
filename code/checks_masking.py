"""The checks of Chapter 5, Masking (the machinery: checking.py)."""

from __future__ import annotations

import torch

from checking import Check, module_rules, softmax_rules

# causal_padding_mask(...), masked_softmax(...)

check_causal_padding_mask = Check(
    "check_causal_padding_mask", rules=[*module_rules("causal_mask", "padding_mask")],
    unchanged="padded sequences")


def _entrywise(lengths, T, rule):
    """The (B, T, T) mask whose entry [b, i, j] is rule(lengths[b], i, j), built one entry at
    a time."""
    return torch.tensor([[[bool(rule(n, i, j)) for j in range(T)] for i in range(T)]
                         for n in lengths], dtype=torch.bool)


def _may_attend(n, i, j):  # the exercise's rule, for one entry
    return j <= i and j < n


# The usual mistakes, each as the rule for one entry that it follows instead. "not causal"
# comes before "combined with OR": on sequences without padding both give all True.
_MASK_MISTAKES = {
    "inverted mask: True must mean 'may attend', not 'blocked'":
        lambda n, i, j: not _may_attend(n, i, j),
    "off by one: the diagonal is missing; a token must see itself":
        lambda n, i, j: j < i and j < n,
    "off by one: each query may also see the next token":
        lambda n, i, j: j <= i + 1 and j < n,
    "upper triangle: the mask shows the future instead of the past":
        lambda n, i, j: j >= i and j < n,
    "off by one in the padding: the real keys are the positions j < lengths[b], "
    "not j <= lengths[b]":
        lambda n, i, j: j <= i and j <= n,
    "the rows of padded queries are all False: mask the padding keys (columns) only; "
    "blocking padded queries (alone or with the keys) leaves those rows with no key at all, "
    "and the loss ignores them anyway":
        lambda n, i, j: j <= i and i < n,
    "padding ignored: keys beyond each length must be blocked":
        lambda n, i, j: j <= i,
    "not causal: the causal part of the mask is missing":
        lambda n, i, j: j < n,
    "combined with OR: a key must be allowed by both masks, so combine them with & (AND), "
    "not | (OR)":
        lambda n, i, j: j <= i or j < n,
}

_NO_PADDING = (([4, 4], 4), ([1], 1))
_PADDED = (([3, 1, 4], 4), ([6, 2], 6), ([1, 3, 2], 3))
_EMPTY_AND_SHORT = (([2, 5, 0], 5), ([2, 3], 5))  # a length 0; T beyond the longest


def _mask_call(fn, lengths, T):
    """(fn(lengths, T), where), with a plain message if fn raises."""
    where = f"lengths={lengths}, T={T}"
    try:
        return fn(torch.tensor(lengths), T), where
    except (RuntimeError, IndexError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; compare query positions (T, 1), key "
            "positions (1, T) and lengths (B, 1, 1) by broadcasting") from None


def _mask_shape(got, lengths, T, where):
    B = len(lengths)
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    longest = max(lengths)
    hint = (f": the mask is T by T, also when T exceeds the longest sequence; not "
            f"lengths.max() by lengths.max()" if tuple(got.shape) == (B, longest, longest)
            and longest != T else "")
    assert tuple(got.shape) == (B, T, T), (
        f"{where}: expected shape (B, T, T) = {(B, T, T)}, got {tuple(got.shape)}{hint}")


def _mask_values(fn, inputs):
    for lengths, T in inputs:
        got, where = _mask_call(fn, lengths, T)
        _mask_shape(got, lengths, T, where)
        assert got.dtype == torch.bool, (
            f"{where}: expected a boolean mask (True = may attend), got {got.dtype}")
        expected = _entrywise(lengths, T, _may_attend)
        if torch.equal(got, expected):
            continue
        for message, rule in _MASK_MISTAKES.items():
            assert not torch.equal(got, _entrywise(lengths, T, rule)), f"{where}: {message}"
        b, i, j = (got != expected).nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: entry [b={b}, query={i}, key={j}] is {bool(got[b, i, j])}, expected "
            f"{bool(expected[b, i, j])}")


@check_causal_padding_mask.case("shapes")
def _(fn):
    for lengths, T in _PADDED + _NO_PADDING + _EMPTY_AND_SHORT:
        got, where = _mask_call(fn, lengths, T)
        _mask_shape(got, lengths, T, where)


@check_causal_padding_mask.case("sequences without padding")
def _(fn):
    _mask_values(fn, _NO_PADDING)


@check_causal_padding_mask.case("padded sequences", 2)
def _(fn):
    _mask_values(fn, _PADDED)


@check_causal_padding_mask.case("an empty sequence, and T beyond the longest")
def _(fn):
    _mask_values(fn, _EMPTY_AND_SHORT)


@check_causal_padding_mask.case("sizes drawn at random")
def _(fn):
    gen = torch.Generator().manual_seed(5)
    inputs = []
    for _ in range(3):
        T = int(torch.randint(1, 9, (), generator=gen))
        B = int(torch.randint(1, 5, (), generator=gen))
        inputs.append((torch.randint(0, T + 1, (B,), generator=gen).tolist(), T))
    _mask_values(fn, inputs)


check_masked_softmax = Check("check_masked_softmax", rules=softmax_rules(),
                             unchanged="rows with visible keys")


def _visible_softmax(scores, keep):
    """Row by row, in float64: PyTorch's softmax of the scores where keep is True, 0 elsewhere
    (a row where keep is all False stays 0)."""
    z = scores.double().reshape(-1, scores.shape[-1])
    keep = keep.reshape(z.shape)
    out = torch.zeros_like(z)
    for row in range(len(z)):
        visible = keep[row]
        if visible.any():
            out[row, visible] = torch.softmax(z[row, visible], dim=0)
    return out.reshape(scores.shape)


def _ms_inputs():
    """Scores (B, L, S) = (2, 3, 5) and a (B, L, S) mask where every row keeps a key."""
    g = torch.Generator().manual_seed(10)
    scores = torch.randn(2, 3, 5, generator=g)
    mask = torch.rand(2, 3, 5, generator=g) > 0.4
    mask[1, :, 0] = True
    return scores, mask


def _ms_with_empty_row():
    scores, mask = _ms_inputs()
    mask[0, 1] = False  # a fully masked row
    return scores, mask


def _ms_broadcast_inputs():
    from attention import causal_mask
    scores, _ = _ms_inputs()
    lengths = torch.tensor([3, 5])
    return {"(L, S) causal mask, broadcast over B": (scores, causal_mask(3, 5)),
            "(B, 1, S) padding mask, broadcast over L":
                (scores, (torch.arange(5) < lengths[:, None])[:, None, :])}


def _ms_float16_inputs():
    scores, mask = _ms_with_empty_row()
    return (12 + 8 * scores).half(), mask


def _ms_call(fn, where, x, m):
    """fn(x, m), with a plain message if it raises."""
    try:
        return fn(x, m)
    except (RuntimeError, IndexError) as err:
        hint = "does the mask broadcast, and did you keep the reduced axis (keepdim=True)?"
        if x.dtype == torch.float16 and "overflow" in str(err):
            hint = "a fill such as -1e9 does not fit in float16; fill with -inf"
        raise AssertionError(f"{where}: {fn.__name__} raised {err!r}; {hint}") from None


def _ms_shape(got, x, where):
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert got.shape == x.shape, (
        f"{where}: expected shape {tuple(x.shape)}, got {tuple(got.shape)}")


def _ms_values(fn, where, x, m):
    """Run fn on a copy of x and compare with the softmax of the visible scores, naming the
    mistake if they differ."""
    _ms_right(_ms_call(fn, where, x.clone(), m), where, x, m)


def _ms_right(got, where, x, m):
    """got against the softmax of the visible scores of x, naming the mistake if they differ."""
    _ms_shape(got, x, where)
    assert got.dtype == x.dtype, (
        f"{where}: the weights must keep the dtype of the scores, {x.dtype}, got {got.dtype}")
    tol = 5e-3 if x.dtype == torch.float16 else 1e-5
    keep = m.expand(x.shape)
    empty = ~keep.any(-1)  # (B, L), fully masked rows
    got = got.float()
    expected = _visible_softmax(x, keep).float()
    inverted = _visible_softmax(x, ~keep).float()
    zeroed = got.nan_to_num(0.0, 0.0, 0.0)  # NaN and inf set to 0
    assert not (torch.allclose(zeroed, inverted, atol=tol)
                and not torch.allclose(zeroed, expected, atol=tol)), (
        f"{where}: inverted mask: True must mean 'may attend'; remove the positions where the "
        "mask is False")
    rows, cols = zeroed.sum(-1)[~empty], zeroed.sum(-2)[keep.any(-2)]
    assert not (torch.allclose(cols, torch.ones_like(cols), atol=tol)
                and not torch.allclose(rows, torch.ones_like(rows), atol=tol)), (
        f"{where}: the columns sum to 1, not the rows: take the softmax over the keys, dim=-1")
    bad = ~got.isfinite().all(-1)  # (B, L), rows with a NaN or inf
    assert not (bad & ~empty).any(), (
        f"{where}: NaN or inf in {int((bad & ~empty).sum())} row(s) with visible keys: exp of "
        "a large score overflows (in float16 above about 11); subtract the row maximum first")
    tiny = (" (a small constant such as 1e-30 added to the denominator is 0 in float16)"
            if x.dtype == torch.float16 else "")
    assert not (bad & empty).any(), (
        f"{where}: NaN in {int((bad & empty).sum())} fully masked row(s): a row with no "
        f"visible key must give zeros, not 0/0{tiny}")
    visible = got[~empty].masked_fill(keep[~empty], 0.0)  # the masked part of the other rows
    leaked = visible.abs().max().item() if visible.numel() else 0.0
    assert leaked == 0.0, (
        f"{where}: masked positions get weight up to {leaked:.3g}, expected 0: fill them with "
        "-inf before the softmax")
    if empty.any():
        lost = got[empty]  # (number of fully masked rows, S)
        uniform = torch.full_like(lost, 1 / lost.shape[-1])
        assert not torch.allclose(lost, uniform, atol=tol), (
            f"{where}: a fully masked row gets uniform weights 1/S, as a finite fill such as "
            "-1e9 or finfo.min gives; it must give zeros")
        assert not lost.any(), (
            f"{where}: a fully masked row must give zeros, got weights up to "
            f"{lost.abs().max():.3g}")
    sums = got.sum(-1)[~empty]
    assert torch.allclose(sums, torch.ones_like(sums), atol=tol), (
        f"{where}: rows with a visible key must sum to 1, got sums from {sums.min():.3f} to "
        f"{sums.max():.3f}: mask the scores before the softmax, not the weights after it")
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol,
                               msg=lambda message: f"{where}: {message}")


@check_masked_softmax.case("shapes")
def _(fn):
    cases = {"(B, L, S) mask": _ms_with_empty_row(), **_ms_broadcast_inputs(),
             "float16, scores up to about 30": _ms_float16_inputs()}
    for where, (x, m) in cases.items():
        _ms_shape(_ms_call(fn, where, x.clone(), m), x, where)


@check_masked_softmax.case("rows with visible keys")
def _(fn):
    _ms_values(fn, "(B, L, S) mask", *_ms_inputs())


@check_masked_softmax.case("masks that broadcast")
def _(fn):
    for where, (x, m) in _ms_broadcast_inputs().items():
        _ms_values(fn, where, x, m)


@check_masked_softmax.case("a fully masked row")
def _(fn):
    _ms_values(fn, "(B, L, S) mask with a fully masked row", *_ms_with_empty_row())


@check_masked_softmax.case("float16 and large scores", keeps_dtype=True)
def _(fn):
    _ms_values(fn, "float16, scores up to about 30", *_ms_float16_inputs())


@check_masked_softmax.case("the gradient through a fully masked row")
def _(fn):
    x, m = _ms_with_empty_row()
    leaf = x.clone().requires_grad_()
    where = "(B, L, S) mask with a fully masked row"
    got = _ms_call(fn, where, leaf, m)
    _ms_right(got.detach(), where, x, m)
    (got * torch.arange(1.0, x.shape[-1] + 1)).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), (
        f"{where}: the gradient is NaN: a NaN made in the forward pass (0/0 on the fully masked "
        "row) and replaced afterwards (nan_to_num, torch.where) still reaches the backward "
        "pass; avoid computing 0/0 at all")


@check_masked_softmax.case("sizes drawn at random")
def _(fn):
    gen = torch.Generator().manual_seed(6)
    for rank in (3, 4, 2):  # (B, L, S), (B, H, L, S), (L, S): any leading axes
        shape = tuple(int(n) for n in torch.randint(1, 6, (rank,), generator=gen))
        x = 10 * torch.randn(shape, generator=gen)
        m = torch.rand(shape, generator=gen) > 0.5
        _ms_values(fn, f"scores {shape}, a random mask", x, m)
