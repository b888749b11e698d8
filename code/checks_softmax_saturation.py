"""The checks of Chapter 4, Softmax saturation (the machinery: checking.py)."""

from __future__ import annotations

import torch

from checking import Check, softmax_rules, tensor_like

# stable_softmax(scores, dim=-1) -> weights

check_stable_softmax = Check("check_stable_softmax", rules=softmax_rules(),
                             unchanged="ordinary scores, dim=-1")


def _softmax_call(fn, scores, dim):
    try:
        return fn(scores, dim=dim)
    except RuntimeError as err:
        raise AssertionError(
            f"scores of shape {tuple(scores.shape)}, dim={dim}: {fn.__name__} raised {err!r}; "
            "keep the reduced axis (keepdim=True) so that the max and the sum broadcast"
        ) from None


def _ordinary_scores():
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(7))  # (3, 5): not square


@check_stable_softmax.case("ordinary scores, dim=-1")
def _(fn):
    z = _ordinary_scores()
    out = _softmax_call(fn, z, -1)
    tensor_like(out, z.shape, "dim=-1")
    assert not torch.isnan(out).any(), "NaN on ordinary scores (about 1)"
    if not torch.allclose(out, torch.softmax(z, dim=-1), atol=1e-6):
        if torch.allclose(out, torch.softmax(z, dim=0), atol=1e-6):
            raise AssertionError("dim=-1: normalised over the wrong axis "
                                 "(columns sum to 1, not rows)")
        raise AssertionError("dim=-1: differs from torch.softmax on ordinary scores")


@check_stable_softmax.case("another axis, dim=0")
def _(fn):
    z = _ordinary_scores()
    out = _softmax_call(fn, z, 0)
    tensor_like(out, z.shape, "dim=0")
    assert torch.allclose(out, torch.softmax(z, dim=0), atol=1e-6), (
        "dim=0: differs from torch.softmax(z, dim=0); use dim in every reduction (the max and "
        "the sum), not a fixed axis")


@check_stable_softmax.case("large and very negative scores")
def _(fn):
    z = _ordinary_scores()
    for name, extreme in (("large (about 1000)", z * 300 + 1000),
                          ("very negative (about -1000)", z - 1000)):
        out = _softmax_call(fn, extreme, -1)
        tensor_like(out, z.shape, f"{name} scores")
        assert torch.isfinite(out).all(), (
            f"NaN or inf for {name} scores: subtract the row maximum first")
        assert torch.allclose(out, torch.softmax(extreme, dim=-1), atol=1e-6), (
            f"wrong result for {name} scores")


@check_stable_softmax.case("float16", keeps_dtype=True)
def _(fn):
    half = torch.tensor([[20.0, 19.0, 0.0]], dtype=torch.float16)
    out = _softmax_call(fn, half, -1)
    tensor_like(out, half.shape, "float16")
    assert out.dtype == torch.float16, (
        f"float16 scores: the weights must keep the dtype of the scores, float16, got "
        f"{out.dtype}")
    assert torch.isfinite(out).all(), (
        "NaN or inf in float16 for scores of 20: exp(20) overflows float16 (largest 65504); "
        "subtract the row maximum first")
    assert torch.allclose(out.float(), torch.softmax(half.float(), dim=-1), atol=2e-3), (
        f"wrong result in float16: got {out.tolist()}")
    out = _softmax_call(fn, torch.full((1, 3), float("-inf"), dtype=torch.float16), -1)
    assert not torch.isnan(out).any(), (
        "NaN for an all -inf row in float16: a small constant such as 1e-30 added to the "
        "denominator is 0 in float16 (its smallest number is about 6e-8)")


def _masked_rows():
    ninf = float("-inf")
    return torch.tensor([[1.0, ninf, 2.0], [ninf, ninf, ninf]])  # (2, 3)


@check_stable_softmax.case("rows with -inf scores")
def _(fn):
    masked = _masked_rows()
    out = _softmax_call(fn, masked, -1)
    tensor_like(out, masked.shape, "-inf scores")
    assert not torch.isnan(out[0]).any(), "NaN in a row with some -inf"
    assert out[0, 1] == 0, f"a -inf score must get weight exactly 0, got {out[0, 1].item()}"
    assert torch.allclose(out[0], torch.softmax(masked[0], dim=-1)), (
        "wrong weights in a row with some -inf scores")
    assert not torch.isnan(out[1]).any(), (
        "NaN for a row that is all -inf: -inf - (-inf) is nan; shift such rows by 0 and avoid "
        "0/0")
    assert (out[1] == 0).all(), f"a row that is all -inf must give zeros, got {out[1].tolist()}"


@check_stable_softmax.case("gradient through an all -inf row")
def _(fn):
    leaf = _masked_rows().requires_grad_()
    out = _softmax_call(fn, leaf, -1)
    tensor_like(out, leaf.shape, "gradient")
    want = torch.zeros(2, 3)  # the all -inf row gives zeros
    want[0] = torch.softmax(_masked_rows()[0], dim=-1)
    assert torch.allclose(out.detach(), want, atol=1e-6), (
        "wrong weights for the rows [1, -inf, 2] and [-inf, -inf, -inf]")
    (out * torch.arange(1.0, 4.0)).sum().backward()
    assert torch.isfinite(leaf.grad).all(), (
        "the gradient is NaN for the all -inf row: a NaN made in the forward pass and replaced "
        "afterwards (nan_to_num, torch.where) still reaches the backward pass; avoid computing "
        "0/0 at all")


@check_stable_softmax.case("sizes and axes drawn at random")
def _(fn):
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        shape = tuple(int(n) for n in torch.randint(1, 6, (int(torch.randint(1, 4, (),
                                                                generator=gen)),), generator=gen))
        dim = int(torch.randint(-len(shape), len(shape), (), generator=gen))
        z = 20 * torch.randn(shape, generator=gen)
        where = f"scores of shape {shape}, dim={dim}"
        out = _softmax_call(fn, z, dim)
        tensor_like(out, z.shape, where)
        assert torch.allclose(out, torch.softmax(z, dim=dim), atol=1e-6), (
            f"{where}: differs from torch.softmax(z, dim={dim})")
