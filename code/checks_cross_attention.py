"""The checks of Chapter 7, Cross-attention (the machinery: checking.py)."""

from __future__ import annotations

import functools

import torch

from checking import Check, attention_rule, module_rules

# cross_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None) -> (B, L, d_v)

check_cross_attention = Check(
    "check_cross_attention",
    rules=[attention_rule(),
           *module_rules("scaled_dot_product_attention", "MultiHeadAttention")],
    unchanged="padded sources")


def _cross_inputs():
    """{name: (where, inputs)}: decoder and encoder of different lengths and widths;
    inputs = (x_dec, x_enc, w_q, w_k, w_v, enc_lengths)."""
    g = torch.Generator().manual_seed(7)
    cases = {  # B, L, S, d_dec, d_enc, d_k, d_v, enc_lengths, input size
        "no padding": (2, 3, 5, 4, 4, 4, 3, None, 2),
        "unequal widths": (2, 3, 5, 5, 4, 6, 3, None, 2),  # d_dec, d_enc, d_k, d_v all differ
        "padded sources": (3, 4, 6, 5, 6, 8, 2, [6, 2, 4], 2),
        "large inputs": (2, 5, 3, 3, 7, 16, 4, [1, 3], 30),  # scores in the thousands
        "an empty source": (3, 2, 4, 3, 5, 4, 2, [4, 0, 2], 2)}
    for number in range(2):  # sizes drawn at random
        B, L, S, d_dec, d_enc, d_k, d_v = (int(n) for n in torch.randint(1, 7, (7,), generator=g))
        lengths = None if number == 0 else torch.randint(1, S + 1, (B,), generator=g).tolist()
        cases[f"random {number + 1}"] = (B, L, S, d_dec, d_enc, d_k, d_v, lengths, 3)
    out = {}
    for name, (B, L, S, d_dec, d_enc, d_k, d_v, lengths, size) in cases.items():
        x_dec = size * torch.randn(B, L, d_dec, generator=g)
        x_enc = size * torch.randn(B, S, d_enc, generator=g)
        w_q = torch.randn(d_dec, d_k, generator=g)
        w_k = torch.randn(d_enc, d_k, generator=g)
        w_v = torch.randn(d_enc, d_v, generator=g)
        lens = None if lengths is None else torch.tensor(lengths)
        out[name] = (f"B={B}, L={L}, S={S}, d_dec={d_dec}, d_enc={d_enc}, d_k={d_k}, d_v={d_v}, "
                     f"enc_lengths={lengths}",
                     (x_dec, x_enc, w_q, w_k, w_v, lens))
    return out


def _cross_call(fn, where, inputs):
    """fn(*inputs), checked for type and shape."""
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    B, L, S, d_v = x_dec.shape[0], x_dec.shape[1], x_enc.shape[1], w_v.shape[1]
    try:
        got = fn(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=lens)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; queries come from x_dec (B, L, d_dec), "
            "keys and values from x_enc (B, S, d_enc), and the padding mask is (B, 1, S), "
            "over the keys") from None
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) == (B, S, d_v):
        raise AssertionError(
            f"{where}: expected shape (B, L, d_v) = {(B, L, d_v)}, one row per decoder "
            f"position, got {tuple(got.shape)}, one row per encoder position. Queries come "
            "from x_dec, keys and values from x_enc.")
    assert tuple(got.shape) == (B, L, d_v), (
        f"{where}: expected shape (B, L, d_v) = {(B, L, d_v)}, got {tuple(got.shape)}")
    return got


def _one_example_at_a_time(inputs, attend):
    """torch.stack over the examples b of attend(q, k, v, n): q (L, d_k), k (S, d_k), v (S, d_v)
    the example's queries, keys and values, n its number of real encoder positions."""
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    rows = []
    for b in range(x_dec.shape[0]):
        q, k, v = x_dec[b] @ w_q, x_enc[b] @ w_k, x_enc[b] @ w_v
        n = x_enc.shape[1] if lens is None else int(lens[b])
        rows.append(attend(q, k, v, n))
    return torch.stack(rows)  # (B, L, d_v)


def _cross_values(fn, name):
    """Compare with the module's attention, example by example over the real encoder positions
    only; if they differ, name the mistake whose result the answer reproduces."""
    from attention import scaled_dot_product_attention as sdpa
    where, inputs = _cross_inputs()[name]
    got = _cross_call(fn, where, inputs)
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    d_dec, d_k, d_v = x_dec.shape[-1], w_q.shape[-1], w_v.shape[-1]

    def each(attend):
        return _one_example_at_a_time(inputs, attend)

    want = each(lambda q, k, v, n: sdpa(q, k[:n], v[:n])[0])
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-4)
    if close(got, want):
        return
    mistakes = [
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=1.0)[0],
         "the scores are not divided by sqrt(d_k)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=1 / d_k)[0],
         "the scores are divided by d_k; divide by sqrt(d_k)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=d_dec ** -0.5)[0],
         "the scores are divided by sqrt(d_dec); divide by sqrt(d_k), the width of the keys"),
        (lambda q, k, v, n: sdpa(k[:n], q, q)[1].T @ v[:n],  # each key's weights over queries
         "softmax over the queries (dim=-2); it must run over the encoder positions (dim=-1)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=d_v ** -0.5)[0],
         "the scores are divided by sqrt(d_v), the width of the values; divide by sqrt(d_k), "
         "the width of the queries and keys"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], is_causal=True)[0],
         "a causal mask in cross-attention: every decoder position may see the whole source; "
         "only the decoder's self-attention is causal"),
    ]
    if lens is not None:
        mistakes += [
            (lambda q, k, v, n: sdpa(q, k, v)[0],
             "the padding of the encoder is ignored: keys at positions >= enc_lengths[b] must "
             "get zero weight"),
            (lambda q, k, v, n: sdpa(q, k[n:], v[n:])[0],
             "the mask is inverted: it hides the real tokens and keeps the padding"),
            (lambda q, k, v, n: sdpa(q, k[:n + 1], v[:n + 1])[0],
             "off by one in the padding: the real keys are the positions j < enc_lengths[b]"),
            (lambda q, k, v, n: sdpa(q, k, v)[0] * (torch.arange(len(q)) < n)[:, None],
             "query rows are masked: the source's padding is over the keys, the last axis of "
             "the scores (B, L, S); every decoder position has a query"),
            (lambda q, k, v, n: sdpa(q, k, v * (torch.arange(len(k)) < n)[:, None])[0],
             "the mask is applied to the weights after the softmax; fill the padded scores "
             "with -inf before it, so that each row of weights still sums to 1"),
        ]
    if lens is not None and (lens == 0).any():
        empty = lens == 0
        assert got[empty].isfinite().all(), (
            f"{where}: NaN in the output of example(s) {empty.nonzero().flatten().tolist()}, "
            "whose source has no real token (enc_lengths[b] = 0): such a query sees no key and "
            "must give a zero output, as the module's softmax gives for a fully masked row")
        assert not got[empty].any(), (
            f"{where}: an empty source (enc_lengths[b] = 0) must give zero outputs, got values "
            f"up to {float(got[empty].abs().max()):.3g}")
    zeroed = got.nan_to_num(0.0, 0.0, 0.0)  # NaN and inf set to 0
    for attend, message in mistakes:
        wrong = each(attend)
        if close(zeroed, wrong) and not close(wrong, want):
            raise AssertionError(f"{where}: {message}")
    assert torch.isfinite(got).all(), (
        f"{where}: NaN or inf in the output; exp of a large score overflows: use the module's "
        "softmax, which subtracts each row's maximum")
    err = float((got - want).abs().max())
    raise AssertionError(f"{where}: output differs from the reference by up to {err:.3g}")


@check_cross_attention.case("shapes")
def _(fn):
    for where, inputs in _cross_inputs().values():
        _cross_call(fn, where, inputs)


@check_cross_attention.case("no padding")
def _(fn):
    _cross_values(fn, "no padding")


@check_cross_attention.case("no padding, d_dec, d_enc, d_k and d_v all different")
def _(fn):
    _cross_values(fn, "unequal widths")


@check_cross_attention.case("padded sources")
def _(fn):
    _cross_values(fn, "padded sources")


@check_cross_attention.case("large inputs, padded")
def _(fn):
    _cross_values(fn, "large inputs")


@check_cross_attention.case("an empty source in the batch")
def _(fn):
    _cross_values(fn, "an empty source")


@check_cross_attention.case("sizes drawn at random")
def _(fn):
    for name in ("random 1", "random 2"):
        _cross_values(fn, name)
