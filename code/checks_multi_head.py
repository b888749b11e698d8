"""The checks of Chapter 6, Multi-head attention (the machinery: checking.py)."""

from __future__ import annotations

import functools
import itertools

import torch

from checking import Check, attention_rule, module_rules

# split_heads / merge_heads, grouped_query_attention(...)

check_split_merge = Check(
    "check_split_merge",
    rules=[*module_rules("MultiHeadAttention.split_heads", "MultiHeadAttention.merge_heads")],
    unchanged=("split_heads: each head holds its block of features",
               "merge_heads: gives the tokens back"))

def _random_head_shapes():
    gen = torch.Generator().manual_seed(6)
    shapes = []
    for _ in range(3):
        B, L, H, hd = (int(n) for n in torch.randint(1, 6, (4,), generator=gen))
        shapes.append((B, L, H * hd, H))
    return tuple(shapes)


_HEAD_SHAPES = ((2, 3, 8, 2), (1, 5, 12, 3), (3, 4, 6, 1), (2, 1, 8, 4))  # (B, L, D, H)


def _heads_inputs(shapes=_HEAD_SHAPES):
    """[(where, x (B, L, D) with all entries different, H, heads (B, H, L, hd))]: heads[b, h, t]
    holds features h*hd to (h+1)*hd - 1 of x[b, t], copied one entry at a time. A list, not a
    generator: a generator that a failing case leaves unfinished is closed by the garbage
    collector at some later moment, perhaps while another answer is recorded, and its code
    would then count as that answer's (tests/test_checking.py keeps the checks free of them)."""
    return [_heads_of(*shape) for shape in shapes]


@functools.lru_cache(maxsize=None)
def _heads_of(B, L, D, H):
    """One input of _heads_inputs, built once: the loop is slow, and the answer only ever gets
    copies of x (checking.Answer)."""
    hd = D // H
    x = torch.arange(B * L * D, dtype=torch.float32).reshape(B, L, D)
    heads = torch.zeros(B, H, L, hd)
    for b, h, t, e in itertools.product(range(B), range(H), range(L), range(hd)):
        heads[b, h, t, e] = x[b, t, h * hd + e]  # entry by entry
    return f"B={B}, L={L}, D={D}, H={H}", x, H, heads


def _heads_call(where, fn, *args):
    """fn(*args), its RuntimeError turned into a hint."""
    try:
        return fn(*args)
    except RuntimeError as err:
        hint = ("after a transpose use reshape (or contiguous().view)"
                if len(args) == 1 else "check the shapes you view or reshape to: "
                "(B, L, H, hd) first, then transpose(1, 2)")
        raise AssertionError(f"{where}: {fn.__name__} raised {err!r}; {hint}") from None


def _split_shaped(where, split_heads, x, H):
    B, L, D = x.shape
    hd = D // H
    got = _heads_call(where, split_heads, x, H)
    assert isinstance(got, torch.Tensor), (
        f"split_heads must return a tensor, got {type(got).__name__}")
    if tuple(got.shape) == (B, L, H, hd) and L != H:
        raise AssertionError(f"{where}: split_heads returned (B, L, H, hd) = "
                             f"{tuple(got.shape)}; transpose to (B, H, L, hd)")
    assert tuple(got.shape) == (B, H, L, hd), (
        f"{where}: split_heads: expected shape (B, H, L, hd) = {(B, H, L, hd)}, got "
        f"{tuple(got.shape)}")
    return got


def _merge_shaped(where, merge_heads, heads):
    B, H, L, hd = heads.shape
    merged = _heads_call(where, merge_heads, heads)
    assert isinstance(merged, torch.Tensor), (
        f"merge_heads must return a tensor, got {type(merged).__name__}")
    assert tuple(merged.shape) == (B, L, H * hd), (
        f"{where}: merge_heads: expected shape (B, L, D) = {(B, L, H * hd)}, got "
        f"{tuple(merged.shape)}")
    return merged


@check_split_merge.case("shapes")
def _(split_heads, merge_heads):
    for where, x, H, heads in _heads_inputs():
        _split_shaped(where, split_heads, x, H)
        _merge_shaped(where, merge_heads, heads)


def _split_values(split_heads, inputs):
    for where, x, H, heads in inputs:
        got = _split_shaped(where, split_heads, x, H)
        if torch.equal(got, heads):  # exact: a split moves entries, it computes none
            continue
        B, H, L, hd = heads.shape
        if torch.equal(got, x.view(B, H, L, hd)):
            raise AssertionError(
                f"{where}: split_heads viewed x as (B, H, L, hd) directly; the shape is right "
                "but tokens are mixed: view as (B, L, H, hd), then transpose(1, 2)")
        if torch.equal(got, x.view(B, L, hd, H).permute(0, 3, 1, 2)):
            raise AssertionError(f"{where}: head h got every H-th feature; it must get the "
                                 "contiguous block h*hd:(h+1)*hd")
        raise AssertionError(
            f"{where}: split_heads: head h must hold features h*hd:(h+1)*hd of every token")


def _merge_values(merge_heads, inputs):
    for where, x, _, heads in inputs:
        merged = _merge_shaped(where, merge_heads, heads)
        if torch.equal(merged, x):  # exact: a merge moves entries, it computes none
            continue
        assert not torch.equal(merged, heads.reshape(x.shape)), (
            f"{where}: merge_heads reshaped (B, H, L, hd) directly; transpose(1, 2) back to "
            "(B, L, H, hd) first")
        raise AssertionError(f"{where}: merge_heads(split(x)) must give x back")


@check_split_merge.case("split_heads: each head holds its block of features", 2)
def _(split_heads, merge_heads):
    _split_values(split_heads, _heads_inputs())


@check_split_merge.case("split_heads: ValueError when H does not divide D")
def _(split_heads, merge_heads):
    _split_values(split_heads, _heads_inputs(((1, 2, 6, 3),)))  # 3 heads do divide 6
    try:
        split_heads(torch.zeros(1, 2, 6), 4)
    except ValueError:
        return
    except Exception as err:
        raise AssertionError(
            f"split_heads(x, 4) with D = 6 raised {err!r}; it must raise ValueError itself: "
            "4 heads cannot share 6 features equally") from None
    raise AssertionError("split_heads(x, 4) with D = 6 must raise ValueError: 4 heads cannot "
                         "share 6 features equally")


@check_split_merge.case("merge_heads: gives the tokens back", 2)
def _(split_heads, merge_heads):
    _merge_values(merge_heads, _heads_inputs())


@check_split_merge.case("sizes drawn at random")
def _(split_heads, merge_heads):
    _split_values(split_heads, _heads_inputs(_random_head_shapes()))
    _merge_values(merge_heads, _heads_inputs(_random_head_shapes()))


check_grouped_query_attention = Check(
    "check_grouped_query_attention", rules=[attention_rule(), *module_rules("repeat_kv")],
    unchanged="multi-query attention: G = 1",
    # the module's attention, which the answer calls, checks shapes with torch.broadcast_shapes,
    # whose first call imports SymPy
    prepare=lambda: torch.broadcast_shapes((1,), (1,)))

_GQA_HEADS = {"grouped": ((4, 2), (6, 3), (8, 2)), "multi-query": ((4, 1),),
              "multi-head": ((4, 4),), "random": ((6, 2), (5, 5), (3, 1))}  # (H, G)


def _gqa_inputs(kinds=tuple(_GQA_HEADS)):
    """[(where, q (B, H, L, hd), k and v (B, G, S, hd))] for each (H, G) of the kinds (a list,
    as _heads_inputs says why)."""
    return [_gqa_sized(kind, H, G) for kind in kinds for H, G in _GQA_HEADS[kind]]


def _gqa_sized(kind, H, G):
    g = torch.Generator().manual_seed(10 * H + G)
    B, L, S, hd = 2, 3, 5, 4
    if kind == "random":
        B, L, S, hd = (int(n) for n in torch.randint(1, 7, (4,), generator=g))
    q = torch.randn(B, H, L, hd, generator=g)
    k, v = [torch.randn(B, G, S, hd, generator=g) for _ in range(2)]
    sizes = f", B={B}, L={L}, S={S}, hd={hd}" if kind == "random" else ""
    return f"H={H} query heads, G={G} key-value heads{sizes}", q, k, v


def _gqa_shaped(fn, where, q, k, v):
    try:
        got = fn(q, k, v)
    except (RuntimeError, ValueError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; k and v have G heads and q has H: give "
            "every query head its key-value head before the batched product") from None
    assert isinstance(got, torch.Tensor), (
        f"{where}: expected a tensor, got {type(got).__name__} (the module's "
        "scaled_dot_product_attention returns output and weights)")
    assert tuple(got.shape) == tuple(q.shape), (
        f"{where}: expected shape (B, H, L, hd) = {tuple(q.shape)}, got {tuple(got.shape)}")
    return got


def _gqa_values(fn, kind):
    from attention import scaled_dot_product_attention
    for where, q, k, v in _gqa_inputs((kind,)):
        got = _gqa_shaped(fn, where, q, k, v)
        H, G = q.shape[1], k.shape[1]
        for h in range(H):  # one query head at a time, with its key-value head h // (H // G)
            want = scaled_dot_product_attention(q[:, h], k[:, h // (H // G)],
                                                v[:, h // (H // G)])[0]  # (B, L, hd)
            if torch.allclose(got[:, h], want, atol=1e-5):
                continue
            uses = [j for j in range(G) if torch.allclose(
                got[:, h], scaled_dot_product_attention(q[:, h], k[:, j], v[:, j])[0],
                atol=1e-6)]
            if uses:
                raise AssertionError(
                    f"{where}: query head {h} used key-value head {uses[0]}, not "
                    f"{h} // (H // G) = {h // (H // G)}; heads 0..{H // G - 1} share key-value "
                    "head 0 (repeat_interleave repeats each head in place; repeat cycles "
                    "through them)")
            raise AssertionError(f"{where}: query head {h} differs from attention with "
                                 f"key-value head {h // (H // G)}")


@check_grouped_query_attention.case("shapes")
def _(fn):
    for where, q, k, v in _gqa_inputs():
        _gqa_shaped(fn, where, q, k, v)


@check_grouped_query_attention.case("groups of query heads: (H, G) = (4, 2), (6, 3), (8, 2)",
                                    2)
def _(fn):
    _gqa_values(fn, "grouped")


@check_grouped_query_attention.case("multi-query attention: G = 1")
def _(fn):
    _gqa_values(fn, "multi-query")


@check_grouped_query_attention.case("multi-head attention: G = H")
def _(fn):
    _gqa_values(fn, "multi-head")


@check_grouped_query_attention.case("sizes drawn at random")
def _(fn):
    _gqa_values(fn, "random")
