"""The checks of Chapter 1, Intuition (the machinery: checking.py)."""

from __future__ import annotations

import torch

from checking import Check, attention_by_loops, module_rules, softmax_rules

# simple_self_attention(x) -> (output, weights)

check_simple_self_attention = Check(
    "check_simple_self_attention",
    rules=[*softmax_rules(), *module_rules("scaled_dot_product_attention")],
    unchanged="values: sentence A and a random input")


def _ssa_inputs() -> dict[str, torch.Tensor]:
    """The fixed inputs and those drawn at random, by name; the first: the six words of sentence
    A, as in the text."""
    gen = torch.Generator().manual_seed(0)
    return {
        "sentence A (6, 4)": torch.tensor(
            [[0.0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1],
             [2, 0, 0, 0], [1, 1, 0, 0]]),
        "random (5, 3)": torch.randn(5, 3, generator=gen),
        "batch (2, 4, 3)": torch.randn(2, 4, 3, generator=gen),
        "large scores (4, 2)": 40 * torch.randn(4, 2, generator=gen),
        **_random_inputs()}


def _random_inputs() -> dict[str, torch.Tensor]:
    """Four inputs of sizes drawn from a fixed generator, one of them a batch, one with two
    batch axes (x is (..., T, d))."""
    gen = torch.Generator().manual_seed(1)
    inputs = {}
    for batch in ((), (), (int(torch.randint(1, 4, (), generator=gen)),),
                  tuple(int(n) for n in torch.randint(1, 4, (2,), generator=gen))):
        T, d = (int(n) for n in torch.randint(1, 8, (2,), generator=gen))
        x = 3 * torch.randn(*batch, T, d, generator=gen)
        inputs[f"drawn at random {tuple(x.shape)}"] = x
    return inputs


def _ssa_by_loops(x: torch.Tensor, scale: float = 1.0):
    """(output, weights) of simple self-attention, pair by pair (chapter 2's loops with
    identity projections), in x's dtype."""
    eye = torch.eye(x.shape[-1])
    out, weights = attention_by_loops(x, eye, eye, eye, scale=scale)
    return out.to(x.dtype), weights.to(x.dtype)


def _ssa_result(fn, name: str, x: torch.Tensor):
    """fn(x) as (output, weights), checked for type and shape, or AssertionError naming the
    mistake."""
    try:
        result = fn(x)
    except RuntimeError as err:
        hint = ("for a batch, transpose the last two axes with x.transpose(-2, -1); x.T "
                "reverses all of them" if x.dim() > 2 else "check the shapes of your products")
        raise AssertionError(f"{name}: {fn.__name__} raised {err!r}; {hint}") from None
    assert isinstance(result, tuple) and len(result) == 2, (
        f"{name}: return a tuple (output, weights), got {type(result).__name__}")
    out, weights = result
    assert all(isinstance(t, torch.Tensor) for t in result), (
        f"{name}: output and weights must be tensors, got {type(out).__name__} and "
        f"{type(weights).__name__}")
    want_w_shape = (*x.shape[:-1], x.shape[-2])
    if out.shape == want_w_shape and weights.shape == x.shape and x.shape != want_w_shape:
        raise AssertionError(f"{name}: you returned (weights, output); return (output, weights)")
    assert weights.shape == want_w_shape, (
        f"{name}: weights: expected shape (..., T, T) = {want_w_shape}, got "
        f"{tuple(weights.shape)}")
    assert out.shape == x.shape, (
        f"{name}: output: expected shape (..., T, d) = {tuple(x.shape)}, got "
        f"{tuple(out.shape)}")
    return out, weights


def _ssa_values(fn, name: str, x: torch.Tensor) -> None:
    """fn(x) against simple attention computed pair by pair: the weights, then the output."""
    out, weights = _ssa_result(fn, name, x)
    assert weights.isfinite().all() and out.isfinite().all(), (
        f"{name}: NaN or inf. exp of a large score overflows: subtract each row's maximum "
        "before exp")
    want_out, want_w = _ssa_by_loops(x)
    ones = torch.ones(weights.shape[:-1])
    sums = weights.sum(-1)
    if not torch.allclose(sums, ones, atol=1e-5):
        assert not torch.allclose(weights.sum(-2), ones, atol=1e-5), (
            f"{name}: the columns of weights sum to 1, not the rows: normalise over the keys, "
            "dim=-1")
        raise AssertionError(
            f"{name}: each row of weights must sum to 1, got sums from {sums.min():.3g} to "
            f"{sums.max():.3g}: normalise the exponentials over the keys, dim=-1")
    _, scaled = _ssa_by_loops(x, scale=x.shape[-1] ** -0.5)  # divided by sqrt(d)
    assert not (torch.allclose(weights, scaled, atol=1e-5)
                and not torch.allclose(weights, want_w, atol=1e-5)), (
        f"{name}: you divided the scores by sqrt(d); simple attention uses the plain dot "
        "product")
    torch.testing.assert_close(
        weights, want_w, rtol=1e-4, atol=1e-5,
        msg=lambda m: f"{name}: weights differ from the expected ones (computed pair by pair). {m}")
    torch.testing.assert_close(
        out, want_out, rtol=1e-4, atol=1e-4, msg=lambda m: (
            f"{name}: output != weights @ x: row i of the output is the average of the rows "
            f"of x with the weights of row i. {m}"))


@check_simple_self_attention.case("shapes on every input")
def _(fn):
    for name, x in _ssa_inputs().items():
        _ssa_result(fn, name, x)


@check_simple_self_attention.case("values: sentence A and a random input", 2)
def _(fn):
    for name, x in list(_ssa_inputs().items())[:2]:
        _ssa_values(fn, name, x)


@check_simple_self_attention.case("values: a batch")
def _(fn):
    _ssa_values(fn, "batch (2, 4, 3)", _ssa_inputs()["batch (2, 4, 3)"])


@check_simple_self_attention.case("values: scores in the thousands")
def _(fn):
    _ssa_values(fn, "large scores (4, 2)", _ssa_inputs()["large scores (4, 2)"])


@check_simple_self_attention.case("values: sizes drawn at random")
def _(fn):
    for name, x in _ssa_inputs().items():
        if name.startswith("drawn at random"):
            _ssa_values(fn, name, x)
