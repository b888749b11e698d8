"""The checks of Chapter 2, Queries, keys and values (the machinery: checking.py)."""

from __future__ import annotations

import torch

from checking import Check, attention_by_loops, attention_rule, module_rules

# self_attention(x, w_q, w_k, w_v) -> (output, weights); additive_scores(...)

check_self_attention = Check(
    "check_self_attention",
    rules=[attention_rule(),
           *module_rules("scaled_dot_product_attention", "MultiHeadAttention")],
    unchanged="weights on ordinary inputs")


def _sa_inputs():
    """name -> (x, w_q, w_k, w_v): d_k, d_v and d_model differ after the worked example."""
    gen = torch.Generator().manual_seed(10)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    eye = torch.eye(2)
    return {"worked example": (torch.tensor([[1.0, 0], [0, 1], [1, 1]]), eye, eye, eye),
            "d_k=3, d_v=5": (rand(4, 6), rand(6, 3), rand(6, 3), rand(6, 5)),
            "batch (2, 5, 6)": (rand(2, 5, 6), rand(6, 3), rand(6, 3), rand(6, 4)),
            "large inputs": (20 * rand(3, 4), rand(4, 2), rand(4, 2), rand(4, 2)),
            **_sa_random_inputs()}


def _sa_random_inputs():
    """Two inputs of sizes drawn from a fixed generator, the second a batch."""
    gen = torch.Generator().manual_seed(12)
    inputs = {}
    for batch in ((), (int(torch.randint(1, 4, (), generator=gen)),)):
        T, d_model, d_k, d_v = (int(n) for n in torch.randint(1, 8, (4,), generator=gen))
        args = (torch.randn(*batch, T, d_model, generator=gen),
                *(torch.randn(d_model, d, generator=gen) for d in (d_k, d_k, d_v)))
        inputs[f"random: x {tuple(args[0].shape)}, d_k={d_k}, d_v={d_v}"] = args
    return inputs


_sa_by_loops = attention_by_loops


def _sa_call(fn, where, x, w_q, w_k, w_v, want_out, want_w, parts=("output", "weights")):
    """fn's (output, weights), checked for type and for the shapes of `parts`."""
    try:
        result = fn(x, w_q, w_k, w_v)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; project with x @ w_q, x @ w_k, x @ w_v "
            "and transpose the keys with k.transpose(-2, -1) (k.T reverses every axis of a "
            "batch)") from None
    assert isinstance(result, tuple) and len(result) == 2, (
        f"{where}: return a tuple (output, weights), got {type(result).__name__}")
    out, weights = result
    assert all(isinstance(t, torch.Tensor) for t in result), (
        f"{where}: output and weights must be tensors, got {type(out).__name__} and "
        f"{type(weights).__name__}")
    if (out.shape == want_w.shape and weights.shape == want_out.shape
            and want_w.shape != want_out.shape):
        raise AssertionError(f"{where}: you returned (weights, output); return "
                             "(output, weights)")
    if "weights" in parts:
        assert weights.shape == want_w.shape, (
            f"{where}: weights: expected shape (..., T, T) = {tuple(want_w.shape)}, got "
            f"{tuple(weights.shape)}")
    if "output" in parts:
        hint = (": multiply the weights by v = x @ w_v, not by x"
                if out.shape == x.shape else "")
        assert out.shape == want_out.shape, (
            f"{where}: output: expected shape (..., T, d_v) = {tuple(want_out.shape)}, got "
            f"{tuple(out.shape)}{hint}")
    return out, weights


def _sa_weights_right(where, weights, x, w_q, w_k, w_v, want_w):
    assert weights.isfinite().all(), (
        f"{where}: NaN or inf. exp of a large score overflows: use a stable softmax (the "
        "module's, or subtract each row's maximum)")
    ones = torch.ones(weights.shape[:-1])
    sums = weights.double().sum(-1)
    if not torch.allclose(sums, ones.double(), atol=1e-5):
        assert not torch.allclose(weights.double().sum(-2), ones.double(), atol=1e-5), (
            f"{where}: the columns of weights sum to 1, not the rows: take the softmax over "
            "the keys, dim=-1")
        raise AssertionError(
            f"{where}: each row of weights must sum to 1, got sums from {sums.min():.3g} to "
            f"{sums.max():.3g}: the weights are the softmax of the scaled scores over the "
            "keys, dim=-1")
    d_model, d_k = x.shape[-1], w_k.shape[-1]
    mistakes = {
        "the scores are not divided by sqrt(d_k)": dict(scale=1.0),
        f"the scores are divided by sqrt(d_model) = sqrt({d_model}); divide by sqrt(d_k) = "
        f"sqrt({d_k}), the width of the keys": dict(scale=1 / d_model ** 0.5),
        "the scores are divided by d_k; divide by sqrt(d_k)": dict(scale=1 / d_k),
        "queries and keys are swapped: the scores are K Q^T, the transpose of Q K^T":
            dict(keys_first=True)}
    close = lambda a, b: torch.allclose(a.double(), b, atol=1e-5)
    for mistake, how in mistakes.items():
        _, wrong = _sa_by_loops(x, w_q, w_k, w_v, **how)
        assert not (close(weights, wrong) and not close(weights, want_w)), (
            f"{where}: {mistake}")
    torch.testing.assert_close(
        weights.double(), want_w, rtol=1e-4, atol=1e-5, msg=lambda m: (
            f"{where}: weights differ from the expected ones (computed pair by pair). {m}"))


def _sa_output_right(where, out, weights, want_out, want_w):
    assert out.isfinite().all(), (
        f"{where}: NaN or inf. exp of a large score overflows: use a stable softmax (the "
        "module's, or subtract each row's maximum)")
    if (not torch.allclose(out.double(), want_out, rtol=1e-4, atol=1e-4)
            and not torch.allclose(weights.double(), want_w, atol=1e-5)):
        raise AssertionError(f"{where}: output differs from the expected one; it must be "
                             "weights @ v, and the weights differ too: see the case on them")
    torch.testing.assert_close(
        out.double(), want_out, rtol=1e-4, atol=1e-4, msg=lambda m: (
            f"{where}: output differs from the expected one; it must be weights @ v. {m}"))


@check_self_attention.case("shapes")
def _(fn):
    for where, (x, w_q, w_k, w_v) in _sa_inputs().items():
        want_out, want_w = _sa_by_loops(x, w_q, w_k, w_v)
        _sa_call(fn, where, x, w_q, w_k, w_v, want_out, want_w)


_SA_ORDINARY = ("worked example", "d_k=3, d_v=5")


@check_self_attention.case("weights on ordinary inputs")
def _(fn):
    for where in _SA_ORDINARY:
        args = _sa_inputs()[where]
        want_out, want_w = _sa_by_loops(*args)
        _, weights = _sa_call(fn, where, *args, want_out, want_w, parts=("weights",))
        _sa_weights_right(where, weights, *args, want_w)


@check_self_attention.case("output on ordinary inputs")
def _(fn):
    for where in _SA_ORDINARY:
        args = _sa_inputs()[where]
        want_out, want_w = _sa_by_loops(*args)
        out, weights = _sa_call(fn, where, *args, want_out, want_w, parts=("output",))
        _sa_output_right(where, out, weights, want_out, want_w)


def _sa_all_right(fn, where):
    args = _sa_inputs()[where]
    want_out, want_w = _sa_by_loops(*args)
    out, weights = _sa_call(fn, where, *args, want_out, want_w)
    _sa_weights_right(where, weights, *args, want_w)
    _sa_output_right(where, out, weights, want_out, want_w)


@check_self_attention.case("a batch")
def _(fn):
    _sa_all_right(fn, "batch (2, 5, 6)")


@check_self_attention.case("large inputs")
def _(fn):
    _sa_all_right(fn, "large inputs")


@check_self_attention.case("sizes drawn at random")
def _(fn):
    for where in _sa_inputs():
        if where.startswith("random:"):
            _sa_all_right(fn, where)


def _additive_loops(fn) -> str | None:
    """A loop over the queries or keys, seen in the work fn does (the operators it dispatches,
    the functions it calls, the lines of its own code it runs): the same for every L and S when
    all pairs are computed at once, growing with L or S in a loop."""
    gen = torch.Generator().manual_seed(13)
    for L, S in ((2, 3), (9, 11)):
        fn(*(torch.randn(*shape, generator=gen)
             for shape in ((L, 3), (S, 4), (3, 5), (4, 5), (5,))))
    small, large = fn.work[-2:]
    hits_small, hits_large = fn.line_hits[-2:]
    if hits_large > hits_small + 2 or hits_small > 12:  # a line run once per query or key
        return (f"{fn.__name__} loops over the queries or keys (a line of it ran {hits_small} "
                f"times for L=2, S=3 and {hits_large} for L=9, S=11): compute every pair at once "
                "by broadcasting (L, 1, d_a) against (1, S, d_a)")
    if large > small + 6:
        return (f"{fn.__name__} loops over the queries or keys (it ran {small} operators, calls "
                f"and lines for L=2, S=3 and {large} for L=9, S=11): compute every pair at once "
                "by broadcasting (L, 1, d_a) against (1, S, d_a)")
    return None


check_additive_scores = Check("check_additive_scores", inspect=_additive_loops,
                              unchanged="values, d_q = d_k")


def _additive_inputs():
    """name -> (query, key, w_1, w_2, w_out)."""
    gen = torch.Generator().manual_seed(11)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    inputs = {}
    sizes = [(3, 3, 2, 2, 4), (2, 5, 3, 6, 7), (4, 2, 3, 3, 5)]
    sizes += [tuple(int(n) for n in torch.randint(1, 7, (5,), generator=gen)) for _ in range(2)]
    for L, S, d_q, d_k, d_a in sizes:
        where = f"L={L}, S={S}" + (f", d_q={d_q}, d_k={d_k}" if d_q != d_k else "")
        where = where if len(inputs) < 3 else f"random: {where}, d_a={d_a}"
        inputs[where] = rand(L, d_q), rand(S, d_k), rand(d_q, d_a), rand(d_k, d_a), rand(d_a)
    return inputs


def _additive_by_loops(query, key, w_1, w_2, w_out, mistake=None):
    """The (L, S) scores in float64, pair by pair; `mistake` names a wrong recipe."""
    query, key, w_1, w_2, w_out = (t.double() for t in (query, key, w_1, w_2, w_out))
    if mistake == "swapped":
        w_1, w_2 = w_2, w_1

    def score(i, j):
        hidden = query[i] @ w_1 + key[j] @ w_2  # (d_a,)
        if mistake == "no tanh":
            return hidden @ w_out
        if mistake == "tanh after":
            return torch.tanh(hidden @ w_out)
        return torch.tanh(hidden) @ w_out

    return torch.tensor([[float(score(i, j)) for j in range(key.shape[0])]
                         for i in range(query.shape[0])], dtype=torch.float64)


def _additive_mistakes(query, key, w_1, w_2, w_out) -> dict:
    """message -> the scores that mistake gives, where the input can tell it apart."""
    mistakes = {
        "the tanh is missing: without it the score is linear and cannot rank keys differently "
        "for different queries": _additive_by_loops(query, key, w_1, w_2, w_out, "no tanh"),
        "tanh is applied after w_out: apply it to the hidden vectors (L, S, d_a), then take "
        "the product with w_out": _additive_by_loops(query, key, w_1, w_2, w_out, "tanh after")}
    if query.shape[-1] == key.shape[-1]:
        mistakes["w_1 and w_2 are swapped: w_1 projects the queries, w_2 the keys"] = (
            _additive_by_loops(query, key, w_1, w_2, w_out, "swapped"))
    return mistakes


def _additive_call(fn, where, args, shape=True):
    try:
        got = fn(*args)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; w_1 projects the queries and w_2 the "
            "keys: query @ w_1 is (L, d_a) and key @ w_2 is (S, d_a): give them a key axis and "
            "a query axis so that they broadcast to (L, S, d_a)") from None
    assert isinstance(got, torch.Tensor), (
        f"{where}: expected a tensor, got {type(got).__name__}")
    L, S = args[0].shape[0], args[1].shape[0]
    if shape:
        assert not (L != S and tuple(got.shape) == (S, L)), (
            f"{where}: expected shape (L, S) = {(L, S)}, got (S, L) = {(S, L)}: the rows are "
            "the queries, the columns the keys")
        assert tuple(got.shape) == (L, S), (
            f"{where}: expected shape (L, S) = {(L, S)}, got {tuple(got.shape)}")
    return got


def _additive_values(fn, where, args):
    got = _additive_call(fn, where, args).double()
    want = _additive_by_loops(*args)
    mistakes = _additive_mistakes(*args)
    if got.shape[0] == got.shape[1]:
        mistakes["the scores are transposed: scores[i, j] pairs query i with key j"] = want.T
    for message, wrong in mistakes.items():
        assert not (torch.allclose(got, wrong, atol=1e-5)
                    and not torch.allclose(got, want, atol=1e-5)), f"{where}: {message}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"{where}: {m}")


_ADDITIVE_SAME_WIDTH = ("L=3, S=3", "L=4, S=2")  # d_q = d_k


@check_additive_scores.case("shapes")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        _additive_call(fn, where, _additive_inputs()[where])


@check_additive_scores.case("every pair's score, in any layout")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        args = _additive_inputs()[where]
        got = _additive_call(fn, where, args, shape=False).double().flatten()
        L, S = args[0].shape[0], args[1].shape[0]
        assert got.numel() == L * S, (
            f"{where}: expected L * S = {L * S} scores, one per pair (query i, key j), got "
            f"{got.numel()}")
        in_order = lambda scores: scores.flatten().sort().values
        for message, wrong in _additive_mistakes(*args).items():
            assert not torch.allclose(got.sort().values, in_order(wrong), atol=1e-5), (
                f"{where}: {message}")
        assert torch.allclose(got.sort().values, in_order(_additive_by_loops(*args)),
                              rtol=1e-4, atol=1e-5), (
            f"{where}: the scores differ from tanh(query[i] @ w_1 + key[j] @ w_2) @ w_out, "
            "whatever their order")


@check_additive_scores.case("values, d_q = d_k")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        _additive_values(fn, where, _additive_inputs()[where])


@check_additive_scores.case("values, d_q != d_k")
def _(fn):
    where = "L=2, S=5, d_q=3, d_k=6"
    _additive_values(fn, where, _additive_inputs()[where])


@check_additive_scores.case("sizes drawn at random")
def _(fn):
    for where, args in _additive_inputs().items():
        if where.startswith("random:"):
            _additive_values(fn, where, args)
