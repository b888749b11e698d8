"""The checks of Chapter 9, Inference (the machinery: checking.py)."""

from __future__ import annotations

import functools

import torch

from checking import Check, attention_rule, module_rules

# cached_attention(k_cache, v_cache, q, k, v) -> (y, k_cache, v_cache)

check_cached_attention = Check(
    "check_cached_attention",
    rules=[attention_rule(),
           *module_rules("scaled_dot_product_attention", "MultiHeadAttention", "KVCache")],
    unchanged="one new token, on an empty cache and after 5 cached")

_CACHED_CASES = {  # name: (B, S cached, n new, T in all, d_k, d_v)
    "one new token, empty cache": (2, 0, 1, 1, 4, 3),
    "one new token after 5 cached": (2, 5, 1, 6, 4, 3),
    "a chunk of 3 new tokens after 4 cached": (2, 4, 3, 7, 4, 3),
    "a sequence, prompt of 3 then one token at a time": (2, 3, 1, 8, 4, 3),
    "a long sequence: prompt of 20, then chunks of 1 to 7": (1, 20, 1, 64, 5, 2),
}
_RANDOM_SEQUENCES = 2  # sequences of sizes drawn at random


def _random_sequence(number):
    """(B, S, n, T, d_k, d_v) and the chunk sizes after the prompt, drawn from a generator."""
    g = torch.Generator().manual_seed(30 + number)
    B, S, d_k, d_v = (int(n) for n in torch.randint(1, 6, (4,), generator=g))
    sizes = torch.randint(1, 5, (int(torch.randint(1, 6, (), generator=g)),), generator=g)
    return (B, S, 1, S + int(sizes.sum()), d_k, d_v), sizes.tolist()


def _cached_sequence(name):
    """q, k (B, T, d_k), v (B, T, d_v) of a whole sequence for the case `name`."""
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    g = torch.Generator().manual_seed(90 + S + 10 * n)
    q, k = (torch.randn(B, T, d_k, generator=g) for _ in range(2))
    v = torch.randn(B, T, d_v, generator=g)
    return q, k, v


def _cached_inputs(name):
    """(where, (k_cache, v_cache, q_new, k_new, v_new)) for the case `name`."""
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    q, k, v = _cached_sequence(name)
    where = f"S={S} cached, n={n} new, d_k={d_k}, d_v={d_v}"
    return where, (k[:, :S], v[:, :S], q[:, S:S + n], k[:, S:S + n], v[:, S:S + n])


def _cached_call(fn, where, inputs, caches=True):
    """fn(*inputs), checked for type and shapes: (y, k_cache, v_cache); the caches' shapes
    only if `caches`."""
    k_cache, v_cache, q, k, v = inputs
    B, S, d_k = k_cache.shape
    n, d_v = q.shape[1], v.shape[-1]
    try:
        got = fn(*(t.clone() for t in inputs))
    except (RuntimeError, ValueError, IndexError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; the caches are (B, S, d), the new "
            "tokens (B, n, d): append along the sequence axis, dim 1") from None
    assert isinstance(got, tuple) and len(got) == 3, (
        f"{where}: expected a tuple (y, k_cache, v_cache), got {type(got).__name__}")
    for part, want in zip(("y", "k_cache", "v_cache"),
                          ((B, n, d_v), (B, S + n, d_k), (B, S + n, d_v))):
        t = got[("y", "k_cache", "v_cache").index(part)]
        assert isinstance(t, torch.Tensor), (
            f"{where}: {part} should be a tensor, got {type(t).__name__}")
        if part != "y" and caches and tuple(t.shape) != want:
            if tuple(t.shape) == (B, S, want[2]):
                raise AssertionError(
                    f"{where}: {part} has shape {tuple(t.shape)}, the old cache; return "
                    f"the cache with the n new rows appended, {want}")
            raise AssertionError(
                f"{where}: {part} has shape {tuple(t.shape)}, expected {want}: the cache "
                "grows along the sequence axis (dim 1), by the n new positions")
        if part == "y" and tuple(t.shape) != want:
            raise AssertionError(
                f"{where}: y has shape {tuple(t.shape)}, expected (B, n, d_v) = {want}: "
                "one output row per new token")
    return got


def _cached_mistakes(S, n, d_k, d_v):
    """(visible (n, S + n) or None, scale, message) for the usual mistakes."""
    j = torch.arange(S + n)[None, :]
    r = torch.arange(n)[:, None]
    return [
        (j <= r, d_k ** -0.5,
         "the causal mask is aligned to the top left (tril() of an n x (S + n) matrix, "
         "or is_causal=True): new query r is position S + r and must see keys 0..S + r, "
         "the bottom-right alignment"),
        (j < S + r, d_k ** -0.5,
         "a new token does not see its own key: append the new keys and values to the "
         "cache before attending (query r, position S + r, sees keys 0..S + r, itself "
         "included)"),
        (j < S, d_k ** -0.5,
         "the new tokens see only the cached keys: append the new keys and values before "
         "attending, so that query r sees keys 0..S + r, its own and the earlier new ones "
         "included"),
        (None, d_k ** -0.5,
         "no causal mask among the new tokens: a new token sees the keys of new tokens "
         "after it; query r may see keys 0..S + r only"),
        (j <= S + r, 1.0, "the scores are not divided by sqrt(d_k)"),
        (j <= S + r, 1 / d_k, "the scores are divided by d_k; divide by sqrt(d_k)"),
        (j <= S + r, d_v ** -0.5,
         "the scores are divided by sqrt(d_v), the width of the values; divide by "
         "sqrt(d_k), the width of the queries and keys"),
    ]


def _cached_values(fn, name):
    """Compare y with the rows of full causal attention over the whole sequence; if it
    differs, name the mistake whose result it reproduces."""
    from attention import scaled_dot_product_attention as sdpa
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    where, inputs = _cached_inputs(name)
    y = _cached_call(fn, where, inputs, caches=False)[0]
    q, k, v = _cached_sequence(name)
    want = sdpa(q, k, v, is_causal=True)[0][:, S:S + n]  # (B, n, d_v), rows of the full
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-5)
    if close(y, want):
        return
    keys, values = k[:, :S + n], v[:, :S + n]
    zeroed = y.nan_to_num(0.0, 0.0, 0.0)
    for visible, scale, message in _cached_mistakes(S, n, d_k, d_v):
        wrong = sdpa(q[:, S:S + n], keys, values, attn_mask=visible, scale=scale)[0]
        if close(zeroed, wrong.nan_to_num(0.0)) and not close(wrong, want):
            raise AssertionError(f"{where}: {message}")
    assert torch.isfinite(y).all(), f"{where}: NaN or inf in y"
    err = float((y - want).abs().max())
    raise AssertionError(f"{where}: y differs from causal attention over all S + n "
                         f"positions by up to {err:.3g}")


@check_cached_attention.case("one new token, on an empty cache and after 5 cached")
def _(fn):
    # together: on an empty cache any weighting of the one value is right, y = v included
    _cached_values(fn, "one new token, empty cache")
    _cached_values(fn, "one new token after 5 cached")


@check_cached_attention.case("a chunk of 3 new tokens after 4 cached", 2)
def _(fn):
    _cached_values(fn, "a chunk of 3 new tokens after 4 cached")


@check_cached_attention.case("the returned caches")
def _(fn):
    for name in ("one new token, empty cache", "a chunk of 3 new tokens after 4 cached"):
        where, inputs = _cached_inputs(name)
        _, k_out, v_out = _cached_call(fn, where, inputs)
        k_cache, v_cache, _, k, v = inputs
        for part, got, old, new in (("k_cache", k_out, k_cache, k),
                                    ("v_cache", v_out, v_cache, v)):
            # exact: the returned cache holds copies of the given rows, computed by no one
            if torch.equal(got, torch.cat([old, new], dim=1)):
                continue
            if torch.equal(got, torch.cat([new, old], dim=1)):
                raise AssertionError(
                    f"{where}: {part} has the new rows first; they are the newest "
                    "positions and go after the cached ones")
            raise AssertionError(
                f"{where}: {part} should be the old cache with the new rows appended "
                "along dim 1, unchanged")


def _decode(fn, name, sizes):
    """Prompt of S tokens, then the chunks `sizes`, each step fed the caches the last
    returned: the outputs must be the rows of causal attention over the whole sequence."""
    from attention import scaled_dot_product_attention as sdpa
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    q, k, v = _cached_sequence(name)
    want = sdpa(q, k, v, is_causal=True)[0]  # (B, T, d_v)
    k_cache, v_cache = k[:, :0], v[:, :0]
    start, rows = 0, []
    for size in [S] + sizes:
        where = f"{name}; step at position {start}, {size} new"
        y, k_cache, v_cache = _cached_call(
            fn, where, (k_cache, v_cache, q[:, start:start + size],
                        k[:, start:start + size], v[:, start:start + size]))
        rows.append(y)
        start += size
        got = torch.cat(rows, dim=1)
        if not torch.allclose(got, want[:, :start], rtol=1e-4, atol=1e-5):
            _cached_values(fn, "a chunk of 3 new tokens after 4 cached")  # names a mistake
            raise AssertionError(
                f"{where}: the outputs differ from causal attention over the whole "
                "sequence; check the caches you return, which the next step receives")


@check_cached_attention.case("a sequence, prompt of 3 then one token at a time")
def _(fn):
    _decode(fn, "a sequence, prompt of 3 then one token at a time", [1] * 5)


@check_cached_attention.case("a long sequence: 64 positions, past any fixed cap")
def _(fn):
    sizes = [1, 7, 2, 1, 5, 3, 1, 6, 4, 1, 2, 7, 1, 3]  # 44 positions after the prompt of 20
    _decode(fn, "a long sequence: prompt of 20, then chunks of 1 to 7", sizes)


@check_cached_attention.case("sizes drawn at random")
def _(fn):
    for number in range(_RANDOM_SEQUENCES):
        _decode(fn, f"random {number + 1}", _random_sequence(number)[1])


for _number in range(_RANDOM_SEQUENCES):
    _CACHED_CASES[f"random {_number + 1}"] = _random_sequence(_number)[0]
