"""The checks' promise, tried as a determined student would (code/checking.py).

tests/test_exercises.py holds each check's common mistakes. Here every check meets, in
classes, the answers that broke the promise of an earlier version of the checks:

1. forbidden work under another name (`torch.special.softmax`, `log_softmax(...).exp()`,
   `torch.ops.aten`, the C function behind PyTorch's attention, attention used as a softmax,
   a pasted copy of the module's function);
2. forbidden work captured before the check ran (a default argument, a closure, an object
   holding it);
3. answers that modify their arguments;
4. right answers computed in another dtype (float64 inside, returned in float64 or cast back);
5. answers right only where the fixed inputs look (a condition of the statement that no fixed
   case reached: sizes drawn at random, half precision, an empty source, a long sequence, ...);
6. trivial answers (the input returned, zeros or ones of the right shapes).

Each class has at least two members for every check, each with the points it must earn:
nothing, part, at most a fifth, or all. And every sentence of a chapter that promises what a
check refuses ("the check gives no points to an answer that calls ...") names only what the
catalogue shows refused.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import io
import math
import pathlib
import re
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention
import checking
import induction
import lm
import position
from chapter_structure import read_source
from classroom import numbered_chapters
from test_exercises import (C1, C2, C2b, C3, C4, C5, C5b, C6, C7, C8, C9, C10, C11, C11b, C12,
                            C13, C13c, C13m, C13s, C13t,
                            CG,
                            CHECK_NAMES,
                            REFERENCES, graded_points, load_check, reference_functions)

torch.set_num_threads(1)

NOTHING, PART, FIFTH, FULL = "nothing", "part", "at most a fifth", "full"
FORBIDDEN = "which this exercise asks you to write yourself or rules out"
NEG_INF = float("-inf")


@dataclass
class Entry:
    check: str
    kind: int  # the class, 1 to 6
    name: str  # what the answer does, naming the calls it makes
    functions: dict  # function name -> the answer's function, replacing the reference's
    earns: str
    fragment: str | None = None  # a part of the message it must get
    calls: tuple[str, ...] = field(default=())  # the forbidden calls it makes, by name


CATALOGUE: list[Entry] = []


def add(check, kind, name, earns, fragment=None, calls=(), **functions):
    CATALOGUE.append(Entry(check, kind, name, functions, earns, fragment, tuple(calls)))


def only(check) -> str:
    (name,) = REFERENCES[check].functions
    return name


# ---------------------------------------------------------------------------------------------
# Forbidden work, reached by many routes (classes 1 and 2)


def _sdpa_as_softmax(z, dim):
    """Softmax along dim, from PyTorch's attention: query z, identity keys and values."""
    z = z.movedim(dim, -1)
    eye = torch.eye(z.shape[-1], dtype=z.dtype).expand(*z.shape[:-1][:-1], z.shape[-1], -1)
    out = F.scaled_dot_product_attention(z, eye, eye, scale=1.0)
    return out.movedim(-1, dim)


def _softmax_to_script(z: Tensor, dim: int) -> Tensor:
    return torch.softmax(z, dim)


with warnings.catch_warnings():  # torch.jit.script is deprecated, and still works
    warnings.simplefilter("ignore", DeprecationWarning)
    _scripted_softmax = torch.jit.script(_softmax_to_script)


POOL = concurrent.futures.ThreadPoolExecutor(1)  # made before any check runs


def in_a_thread(fn):
    """fn run in a thread of its own, where this thread's recording does not reach."""
    def call(*args, **kwargs):
        out = []
        worker = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
        worker.start()
        worker.join()
        return out[0]
    return call


SOFTMAX_ALIASES = {  # class 1: another name for a softmax, (z, dim) -> weights
    "torch.softmax in a thread of its own": in_a_thread(lambda z, dim: torch.softmax(z, dim)),
    "torch.softmax in a thread pool made beforehand": lambda z, dim: POOL.submit(
        torch.softmax, z, dim).result(),
    "torch.special.softmax": lambda z, dim: torch.special.softmax(z, dim),
    "torch.log_softmax(...).exp()": lambda z, dim: torch.log_softmax(z, dim).exp(),
    "torch.ops.aten._softmax": lambda z, dim: torch.ops.aten._softmax(z, dim, False),
    "torch.nn.Softmax": lambda z, dim: torch.nn.Softmax(dim=dim)(z),
    "F.softmin of the negated scores": lambda z, dim: F.softmin(-z, dim),
    "exp(z - torch.logsumexp(z))": lambda z, dim: torch.exp(
        z - torch.logsumexp(z, dim, keepdim=True)),
    "scaled_dot_product_attention as a softmax, identity keys and values": _sdpa_as_softmax,
    "torch.jit.script of torch.softmax": lambda z, dim: _scripted_softmax(z, dim),
    "torch.distributions.Categorical": lambda z, dim: torch.distributions.Categorical(
        logits=z.movedim(dim, -1)).probs.movedim(-1, dim),
    "torch._refs.softmax, PyTorch's Python reference": lambda z, dim: _refs_softmax(z, dim),
    "torch._decomp's decomposition of _softmax": lambda z, dim: _decomposed_softmax(z, dim),
    "exp(z - torch.logcumsumexp(z)[last])": lambda z, dim: torch.exp(
        z - torch.logcumsumexp(z, dim).narrow(dim, z.shape[dim] - 1, 1)),
    "a softmax written in NumPy on Tensor.numpy()": lambda z, dim: _numpy_softmax(z, dim),
    "a softmax in NumPy on an array made from tolist()": lambda z, dim: _tolist_softmax(z, dim),
    "a softmax in NumPy on numpy.from_dlpack": lambda z, dim: _dlpack_softmax(z, dim),
    "softplus folding the log-sum-exp (logaddexp by another name)": lambda z, dim: _softplus_softmax(z, dim),
    "the book's flash.flash_attention as a softmax": lambda z, dim: _flash_softmax(z, dim),
}


def _refs_softmax(z, dim):
    import torch._refs
    return torch._refs.softmax(z, dim)


# torch._refs' first call imports torch._dynamo and sympy. Under the recording, which sees every
# Python call, that import took 9 s of the first test to call it in each process, against 2 s
# outside. A process of the suite imports them anyway, unrecorded, once it runs a check that
# trains (its `prepare` steps an optimizer, which imports them): here, once, unrecorded.
_refs_softmax(torch.zeros(2), 0)


def _decomposed_softmax(z, dim):
    from torch._decomp import decompositions
    return decompositions._softmax(z, dim, False)


def _numpy_softmax(z, dim):
    return _numpy_from(z.detach().numpy(), z, dim)


def _numpy_from(a, like, dim):
    """A softmax along `dim` computed in NumPy on the array a, back as a tensor like `like`."""
    import numpy
    e = numpy.exp(a - a.max(axis=dim, keepdims=True))
    return torch.from_numpy(e / e.sum(axis=dim, keepdims=True)).to(like.dtype)


def _tolist_softmax(z, dim):
    import numpy
    return _numpy_from(numpy.array(z.detach().double().tolist()), z, dim)


def _dlpack_softmax(z, dim):
    import numpy
    return _numpy_from(numpy.from_dlpack(z.detach().double().contiguous()), z, dim)


def _softplus_softmax(z, dim):
    """exp(z - lse), the log-sum-exp folded key by key with softplus: log(e^a + e^b) is
    a + softplus(b - a), logaddexp in another name."""
    z = z.movedim(dim, -1)
    lse = z[..., :1]
    for j in range(1, z.shape[-1]):
        lse = lse + F.softplus(z[..., j:j + 1] - lse)
    return torch.exp(z - lse).movedim(-1, dim)


def _flash_softmax(z, dim):
    """The book's flash.flash_attention as a softmax: one query of ones, the scores as keys
    of width 1, identity values."""
    import flash
    z = z.movedim(dim, -1)
    q = torch.ones(*z.shape[:-1], 1, 1, dtype=z.dtype)
    out = flash.flash_attention(q, z.unsqueeze(-1), torch.eye(z.shape[-1], dtype=z.dtype),
                                scale=1.0)
    return out.squeeze(-2).movedim(-1, dim)


def captured(target: Callable, label: str) -> dict[str, Callable]:
    """Class 2: `target` held before the check runs, three ways."""
    def default_argument(*args, _f=target, **kwargs):
        return _f(*args, **kwargs)

    def closure():
        held = target

        def call(*args, **kwargs):
            return held(*args, **kwargs)
        return call

    holder = types.SimpleNamespace(fn=functools.partial(target))
    return {f"{label}, captured as a default argument": default_argument,
            f"{label}, captured in a closure": closure(),
            f"{label}, held by another object": lambda *args, **kwargs: holder.fn(*args,
                                                                                 **kwargs)}


SOFTMAX_CAPTURED = {
    **captured(lambda z, dim: torch.softmax(z, dim), "torch.softmax"),
    **captured(torch.Tensor.softmax, "torch.Tensor.softmax"),
    **captured(lambda z, dim: attention.softmax(z, dim), "the module's softmax"),
}
# The lambdas above call torch.softmax and attention.softmax by their names when they run; the
# same objects captured directly:
SOFTMAX_CAPTURED.update({
    name.replace("torch.softmax", "torch.softmax itself"): fn for name, fn in
    captured(torch.softmax, "torch.softmax").items()})
SOFTMAX_CAPTURED.update({
    name.replace("softmax", "softmax itself"): fn for name, fn in
    captured(attention.softmax, "the module's softmax").items()})


def _weights(z):
    """A softmax written by hand over the last axis (allowed everywhere)."""
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def softmax_answers(check, sm) -> dict:
    """The answer to `check` built on a softmax sm(z, dim), right but for what sm is."""
    if check == C1:
        def simple_self_attention(x):
            w = sm(x @ x.transpose(-2, -1), -1)
            return w @ x, w
        return {"simple_self_attention": simple_self_attention}
    if check == C4:
        return {"stable_softmax": lambda scores, dim=-1: sm(scores, dim)}
    if check == C5b:
        def masked_softmax(scores, mask):
            return sm(scores.masked_fill(~mask, NEG_INF), -1).nan_to_num(0.0)
        return {"masked_softmax": masked_softmax}
    if check == C10:
        def merge_partials(m1, ell1, y1, m2, ell2, y2):
            m = torch.maximum(m1, m2)
            # the two blocks' shares of the merged sum, by a softmax over the two blocks
            logs = torch.stack([ell1.log() + m1, ell2.log() + m2], -1)
            share = sm(logs, -1).nan_to_num(0.0)
            safe = torch.where(m.isfinite(), m, torch.zeros_like(m))
            ell = ell1 * torch.exp(m1 - safe) + ell2 * torch.exp(m2 - safe)
            y = (share[..., :1] * y1 / ell1.clamp_min(1e-300)[..., None]
                 + share[..., 1:] * y2 / ell2.clamp_min(1e-300)[..., None]) * ell[..., None]
            return m, ell, y
        return {"merge_partials": merge_partials}
    raise KeyError(check)


ATTENTION_ALIASES = {  # (q, k, v, mask, scale) -> output, by PyTorch's attention
    "scaled_dot_product_attention in a thread of its own": in_a_thread(
        lambda q, k, v, mask=None, scale=None: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale)),
    "torch._C._nn.scaled_dot_product_attention": lambda q, k, v, mask=None, scale=None:
        torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
    "torch.ops.aten.scaled_dot_product_attention": lambda q, k, v, mask=None, scale=None:
        torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale),
    "scaled_dot_product_attention on its math backend": lambda q, k, v, mask=None, scale=None:
        _on_math(q, k, v, mask, scale),
    "the module's scaled_dot_product_attention": lambda q, k, v, mask=None, scale=None:
        attention.scaled_dot_product_attention(q, k, v, mask, scale=scale)[0],
}


def _on_math(q, k, v, mask, scale):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


ATTENTION_CAPTURED = captured(
    lambda q, k, v, mask=None, scale=None: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale), "torch.nn.functional.scaled_dot_product_attention")
ATTENTION_CAPTURED.update({
    name.replace("attention", "attention itself"): (
        lambda fn: lambda q, k, v, mask=None, scale=None: fn(q, k, v, mask, 0.0, False,
                                                             scale=scale))(fn)
    for name, fn in captured(F.scaled_dot_product_attention,
                             "torch.nn.functional.scaled_dot_product_attention").items()})


def attention_answers(check, attn) -> dict:
    """The answer to `check` built on attn(q, k, v, mask, scale), right but for what attn is."""
    if check == C1:
        def simple_self_attention(x):
            return attn(x, x, x, None, 1.0), _weights(x @ x.transpose(-2, -1))
        return {"simple_self_attention": simple_self_attention}
    if check == C2:
        def self_attention(x, w_q, w_k, w_v):
            q, k, v = x @ w_q, x @ w_k, x @ w_v
            return attn(q, k, v), _weights(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]))
        return {"self_attention": self_attention}
    if check == C7:
        def cross_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
            q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
            mask = None
            if enc_lengths is not None:
                mask = (torch.arange(k.shape[1]) < enc_lengths[:, None])[:, None, :]
            return attn(q, k, v, mask)
        return {"cross_attention": cross_attention}
    if check == C9:
        def cached_attention(k_cache, v_cache, q, k, v):
            keys, values = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
            S, n = k_cache.shape[1], q.shape[1]
            sees = torch.ones(n, S + n, dtype=torch.bool).tril(diagonal=S)
            return attn(q, keys, values, sees), keys, values
        return {"cached_attention": cached_attention}
    if check == CG:
        def grouped_query_attention(q, k, v):
            group = q.shape[1] // k.shape[1]
            return attn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        return {"grouped_query_attention": grouped_query_attention}
    raise KeyError(check)


for _check in (C1, C4, C5b, C10):
    for _name, _sm in SOFTMAX_ALIASES.items():
        add(_check, 1, _name, NOTHING, FORBIDDEN, **softmax_answers(_check, _sm))
    for _name, _sm in SOFTMAX_CAPTURED.items():
        add(_check, 2, _name, NOTHING, FORBIDDEN, **softmax_answers(_check, _sm))

for _check in (C1, C2, C7, C9, CG):
    for _name, _attn in ATTENTION_ALIASES.items():
        if _check == CG and "module's" in _name:
            continue  # the module's attention is what that exercise asks to use
        add(_check, 1, _name, NOTHING, FORBIDDEN, **attention_answers(_check, _attn))
    for _name, _attn in ATTENTION_CAPTURED.items():
        add(_check, 2, _name, NOTHING, FORBIDDEN, **attention_answers(_check, _attn))


def _enable_gqa(q, k, v):
    return torch._C._nn.scaled_dot_product_attention(q, k, v, enable_gqa=True)


add(CG, 1, "enable_gqa through torch._C._nn", NOTHING, FORBIDDEN,
    grouped_query_attention=_enable_gqa)
add(CG, 1, "the module's repeat_kv, reached through importlib", NOTHING, FORBIDDEN,
    grouped_query_attention=lambda q, k, v: attention.scaled_dot_product_attention(
        q, *(getattr(importlib.import_module("attention"), "repeat" + "_kv")(t, q.shape[1]
                                                                            // k.shape[1])
             for t in (k, v)))[0])
for _name, _repeat in captured(attention.repeat_kv, "the module's repeat_kv").items():
    add(CG, 2, _name, NOTHING, FORBIDDEN,
        grouped_query_attention=(lambda r: lambda q, k, v: attention.scaled_dot_product_attention(
            q, r(k, q.shape[1] // k.shape[1]), r(v, q.shape[1] // k.shape[1]))[0])(_repeat))


def _one_width(q, k, v, scale):
    """q, k, v zero-padded to one width w = max(d_k, d_v), q scaled so that PyTorch's
    1/sqrt(w) gives `scale` (1/sqrt(d_k) by default); and d_v, to cut the output back."""
    d_k, d_v = q.shape[-1], v.shape[-1]
    w = max(d_k, d_v)
    pad = lambda t: F.pad(t, (0, w - t.shape[-1]))  # noqa: E731
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    return pad(q) * scale * math.sqrt(w), pad(k), pad(v), w, d_v


def _mha_as_attention(q, k, v, mask=None, scale=None):
    """nn.MultiheadAttention with identity projections: one head of attention over q, k, v."""
    q, k, v, d, d_v = _one_width(q, k, v, scale)
    mha = torch.nn.MultiheadAttention(d, 1, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(d).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(d))
    squeeze = q.dim() == 2
    q, k, v = (t[None] if squeeze else t for t in (q, k, v))
    blocked = None if mask is None else ~mask.expand(q.shape[0], q.shape[1], k.shape[1])
    out = mha(q, k, v, attn_mask=blocked, need_weights=False)[0]
    return (out[0] if squeeze else out)[..., :d_v]


def _functional_mha(q, k, v, mask=None, scale=None):
    """torch.nn.functional.multi_head_attention_forward with identity projections."""
    q, k, v, d, d_v = _one_width(q, k, v, scale)
    squeeze = q.dim() == 2
    q, k, v = (t[None] if squeeze else t for t in (q, k, v))
    blocked = None if mask is None else ~mask.expand(q.shape[0], q.shape[1], k.shape[1])
    out = F.multi_head_attention_forward(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), d, 1,
        torch.eye(d).repeat(3, 1), None, None, None, False, 0.0, torch.eye(d), None,
        attn_mask=blocked, need_weights=False)[0].transpose(0, 1)
    return (out[0] if squeeze else out)[..., :d_v]


for _check in (C2, C7):
    add(_check, 1, "torch.nn.MultiheadAttention with identity projections", NOTHING, FORBIDDEN,
        **attention_answers(_check, _mha_as_attention))
    add(_check, 1, "torch.nn.functional.multi_head_attention_forward", NOTHING, FORBIDDEN,
        **attention_answers(_check, _functional_mha))


# Chapter 2, additive scores: the loop the exercise rules out, written many ways.
def _score(q, k, w_1, w_2, w_out):
    return torch.tanh(q @ w_1 + k @ w_2) @ w_out


add(C2b, 1, "a loop over the keys inside a broadcast over nothing", NOTHING, "loops over",
    additive_scores=lambda query, key, w_1, w_2, w_out: torch.stack(
        [torch.tanh(query @ w_1 + k @ w_2) @ w_out for k in key], dim=1))
add(C2b, 1, "map over the pairs", NOTHING, "loops over",
    additive_scores=lambda query, key, w_1, w_2, w_out: torch.tensor(
        [[float(_score(q, k, w_1, w_2, w_out)) for k in key] for q in query]))
add(C2b, 2, "a loop in a helper captured as a default argument", NOTHING, "loops over",
    additive_scores=lambda query, key, w_1, w_2, w_out, _s=_score: torch.stack(
        [torch.stack([_s(q, k, w_1, w_2, w_out) for k in key]) for q in query]))
add(C2b, 1, "a loop with a fixed trip count of 16, past any L of the check", NOTHING,
    "loops over", additive_scores=lambda query, key, w_1, w_2, w_out: torch.stack(
        [torch.tanh((query @ w_1)[min(i, len(query) - 1)] + key @ w_2) @ w_out
         for i in range(16)])[:len(query)])
add(C2b, 2, "a loop in a helper held by another object", NOTHING, "loops over",
    additive_scores=lambda query, key, w_1, w_2, w_out, _h=types.SimpleNamespace(s=_score):
        torch.stack([torch.stack([_h.s(q, k, w_1, w_2, w_out) for k in key]) for q in query]))


# Chapter 3: reseeding the global generator, and a formula in place of a measurement.
def _measured(d_k, n, sigma, draw):
    q, k = sigma * draw(n, d_k), sigma * draw(n, d_k)
    s = (q * k).sum(-1)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


def _global_draw(n, d_k):
    return torch.randn(n, d_k)


add(C3, 1, "torch.default_generator.manual_seed, the C method", NOTHING, "torch.manual_seed",
    score_variance=lambda d_k, n, sigma, generator: (
        torch.default_generator.manual_seed(generator.initial_seed()),
        _measured(d_k, n, sigma, _global_draw))[1])
add(C3, 1, "torch.random.set_rng_state from a generator's state", NOTHING, "torch.manual_seed",
    calls=("torch.manual_seed",),
    score_variance=lambda d_k, n, sigma, generator: (
        torch.random.set_rng_state(generator.get_state()),
        _measured(d_k, n, sigma, _global_draw))[1])
add(C3, 5, "the lemma's values times one draw from the generator", NOTHING, "does not vary",
    score_variance=lambda d_k, n, sigma, generator: tuple(
        v * (1 + 0.01 * float(torch.randn((), generator=generator)))
        for v in (d_k * sigma**4, sigma**4)))
add(C3, 5, "the lemma's values plus a uniform draw", NOTHING, "does not vary",
    score_variance=lambda d_k, n, sigma, generator: tuple(
        v + 0.05 * float(torch.rand((), generator=generator)) for v in (d_k * sigma**4,
                                                                         sigma**4)))
for _name, _seed in captured(torch.manual_seed, "torch.manual_seed").items():
    add(C3, 2, _name, NOTHING, "torch.manual_seed", calls=("torch.manual_seed",),
        score_variance=(lambda f: lambda d_k, n, sigma, generator: (
            f(generator.initial_seed()), _measured(d_k, n, sigma, _global_draw))[1])(_seed))


# Chapter 5, the mask: the module's functions, by other routes and pasted in.
def _pasted(function, **names):
    """A copy of the module's function, its source pasted into the notebook."""
    namespace = {"torch": torch, "Optional": Optional, "Tensor": Tensor, **names}
    exec(inspect.getsource(function), namespace)
    return namespace[function.__name__]


_pasted_causal = _pasted(attention.causal_mask)


def _mask_by(causal, padding):
    def causal_padding_mask(lengths, L):
        return causal(L)[None] & padding(lengths, L)[:, None, :]
    return causal_padding_mask


def _own_causal(L):
    return torch.ones(L, L, dtype=torch.bool).tril()


def _own_padding(lengths, L):
    return torch.arange(L) < lengths[:, None]


add(C5, 1, "a pasted copy of the module's causal_mask", NOTHING, "a copy of the module's code",
    causal_padding_mask=_mask_by(_pasted_causal, _own_padding))
_pasted_renamed = _pasted(attention.causal_mask)
_pasted_renamed.__name__ = "my_causal"  # and names the copy does not use
add(C5, 1, "a pasted copy of causal_mask, renamed", NOTHING, "a copy of the module's code",
    causal_padding_mask=_mask_by(_pasted_renamed, _own_padding))
add(C5, 1, "the check's own helper that builds the expected mask", NOTHING, "the check's own",
    causal_padding_mask=lambda lengths, L: importlib.import_module("checks_masking")._entrywise(
        lengths.tolist(), L, importlib.import_module("checks_masking")._may_attend))
add(C5, 1, "the module's padding_mask through importlib", NOTHING, FORBIDDEN,
    calls=("padding_mask",), causal_padding_mask=_mask_by(
        _own_causal, lambda lengths, L: importlib.import_module("attention").padding_mask(
            lengths, L)))
for _name, _causal in captured(attention.causal_mask, "the module's causal_mask").items():
    add(C5, 2, _name, NOTHING, FORBIDDEN, calls=("causal_mask",),
        causal_padding_mask=_mask_by(_causal, _own_padding))


# Chapter 6, split and merge: the module's methods, held by an object of another kind.
def _split_by(method):
    def split_heads(x, num_heads):
        if x.shape[-1] % num_heads:
            raise ValueError("num_heads must divide the width")
        return method(types.SimpleNamespace(head_dim=x.shape[-1] // num_heads), x)
    return split_heads


add(C6, 1, "MultiHeadAttention.split_heads on a stand-in object", NOTHING, FORBIDDEN,
    split_heads=_split_by(attention.MultiHeadAttention.split_heads))
add(C6, 1, "merge_heads of a MultiHeadAttention built for the purpose", NOTHING, FORBIDDEN,
    merge_heads=lambda x: attention.MultiHeadAttention(x.shape[1] * x.shape[-1], x.shape[1])
    .merge_heads(x))
for _name, _method in captured(getattr(attention.MultiHeadAttention, "split" + "_heads"),
                               "MultiHeadAttention.split_heads").items():
    add(C6, 2, _name, NOTHING, FORBIDDEN, split_heads=_split_by(_method))


# Chapter 8: the module's rotary_embedding (half-split) made interleaved by a permutation.
def _rope_by(rotary):
    def rope_interleaved(x, positions):
        d = x.shape[-1]
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # to half-split
        return rotary(x[..., perm], positions)[..., perm.argsort()]
    return rope_interleaved


add(C8, 1, "the module's rotary_embedding through importlib", NOTHING, FORBIDDEN,
    calls=("rotary_embedding",), rope_interleaved=_rope_by(
        lambda x, p: importlib.import_module("position").rotary_embedding(x, p)))
add(C8, 1, "the module's rotary_embedding through getattr", NOTHING, FORBIDDEN,
    rope_interleaved=_rope_by(lambda x, p: getattr(position, "rotary" + "_embedding")(x, p)))
for _name, _rotary in captured(position.rotary_embedding,
                               "the module's rotary_embedding").items():
    add(C8, 2, _name, NOTHING, FORBIDDEN, rope_interleaved=_rope_by(_rotary))


# Chapter 9: the module's KVCache, and the causal_lower_right of PyTorch.
def _with_kv_cache(cache_class):
    def cached_attention(k_cache, v_cache, q, k, v):
        cache = cache_class()
        cache.update(k_cache[:, None], v_cache[:, None])
        keys, values, _ = cache.update(k[:, None], v[:, None])  # and the mask
        keys, values = keys[:, 0], values[:, 0]
        S, n = k_cache.shape[1], q.shape[1]
        sees = torch.ones(n, S + n, dtype=torch.bool).tril(diagonal=S)
        scores = (q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~sees,
                                                                                   NEG_INF)
        return _weights(scores) @ values, keys, values
    return cached_attention


add(C9, 1, "the module's KVCache through importlib", NOTHING, FORBIDDEN,
    cached_attention=_with_kv_cache(importlib.import_module("attention").KVCache))
def _through_module_mha(q, k, v, mask=None, scale=None):
    """The module's MultiHeadAttention, one head, its projections set to the identity: it
    attends over q, k and v of one width (values padded to it)."""
    d, d_v = q.shape[-1], v.shape[-1]
    mha = attention.MultiHeadAttention(max(d, d_v), 1, bias=False)
    with torch.no_grad():
        for linear in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
            linear.weight.copy_(torch.eye(max(d, d_v)))
    pad = lambda t: F.pad(t, (0, max(d, d_v) - t.shape[-1]))  # noqa: E731
    out = mha(pad(q) * math.sqrt(max(d, d_v) / d), pad(k), pad(v), attn_mask=mask)
    return (out[0] if isinstance(out, tuple) else out)[..., :d_v]


add(C9, 1, "the module's MultiHeadAttention with identity projections", NOTHING, FORBIDDEN,
    **attention_answers(C9, _through_module_mha))
add(C9, 1, "causal_lower_right's materialised mask", NOTHING, FORBIDDEN,
    **attention_answers(C9, lambda q, k, v, mask=None, scale=None: _by_hand(
        q, k, v, importlib.import_module("torch.nn.attention.bias").causal_lower_right(
            q.shape[1], k.shape[1])._materialize())))


def _by_hand(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, NEG_INF)
    return _weights(scores) @ v


# Chapter 10: logsumexp and logaddexp, by many routes.
def _merge_by(lse2):
    def merge_partials(m1, ell1, y1, m2, ell2, y2):
        m = torch.maximum(m1, m2)
        safe = torch.where(m.isfinite(), m, torch.zeros_like(m))
        ell = torch.exp(lse2(ell1.log() + m1 - safe, ell2.log() + m2 - safe))
        y = y1 * torch.exp(m1 - safe)[..., None] + y2 * torch.exp(m2 - safe)[..., None]
        return m, ell, y
    return merge_partials


for _name, _lse2 in {
        "torch.special.logsumexp": lambda a, b: torch.special.logsumexp(
            torch.stack([a, b]), 0),
        "torch.ops.aten.logaddexp": lambda a, b: torch.ops.aten.logaddexp(a, b),
        "Tensor.logaddexp": lambda a, b: a.logaddexp(b)}.items():
    add(C10, 1, _name, NOTHING, FORBIDDEN, merge_partials=_merge_by(_lse2))
for _name, _lse2 in captured(torch.logaddexp, "torch.logaddexp").items():
    add(C10, 2, _name, NOTHING, FORBIDDEN, merge_partials=_merge_by(_lse2))


# Chapter 11, layer norm: PyTorch's normalisations reached by other routes.
def _ln_by(norm):
    """A right layer norm whose normalising step is norm(rows, eps), rows (N, D)."""
    def layer_norm(x, gain, shift, eps=1e-5):
        rows = x.reshape(-1, x.shape[-1])
        return norm(rows, eps).reshape(x.shape) * gain + shift
    return layer_norm


LN_ALIASES = {  # class 1
    "torch.ops.aten.native_layer_norm": lambda rows, eps: torch.ops.aten.native_layer_norm(
        rows, [rows.shape[-1]], None, None, eps)[0],
    "torch.layer_norm": lambda rows, eps: torch.layer_norm(rows, [rows.shape[-1]], eps=eps),
    "F.instance_norm of the rows as one-channel signals": lambda rows, eps: F.instance_norm(
        rows[:, None, :], eps=eps)[:, 0],
    "torch.nn.GroupNorm with one group": lambda rows, eps: torch.nn.GroupNorm(
        1, 1, eps=eps, affine=False, dtype=rows.dtype)(rows[:, None, :])[:, 0],
}
for _name, _norm in LN_ALIASES.items():
    add(C11, 1, _name, NOTHING, FORBIDDEN, layer_norm=_ln_by(_norm))
for _name, _fn in captured(lambda rows, eps: F.layer_norm(rows, rows.shape[-1:], eps=eps),
                           "F.layer_norm").items():
    add(C11, 2, _name, NOTHING, FORBIDDEN, layer_norm=_ln_by(_fn))
for _name, _fn in captured(F.layer_norm, "F.layer_norm itself").items():
    add(C11, 2, _name, NOTHING, FORBIDDEN,
        layer_norm=_ln_by((lambda f: lambda rows, eps: f(rows, rows.shape[-1:], eps=eps))(_fn)))


# Chapter 11, the block: its own forward and MLP under other names (class 1), and its forward
# held before the check ran (class 2).
import transformer  # noqa: E402


def _block_by(forward):
    """pre_ln_block as forward(block, x, attn_mask=..., is_causal=...)."""
    def pre_ln_block(x, block, *, attn_mask=None, is_causal=False):
        return forward(block, x, attn_mask=attn_mask, is_causal=is_causal)
    return pre_ln_block


def _block_with_its_mlp(x, block, *, attn_mask=None, is_causal=False):
    h = block.norm1(x)
    u = x + block.self_attn(h, h, h, attn_mask=attn_mask, is_causal=is_causal)[0]
    return u + block._mlp(block.norm2(u))  # the block's own MLP method


add(C11b, 1, "the block's forward through its class", NOTHING, FORBIDDEN,
    pre_ln_block=_block_by(lambda block, x, **mask: type(block).forward(block, x, **mask)))
add(C11b, 1, "the block's _mlp method for the MLP", NOTHING, FORBIDDEN,
    pre_ln_block=_block_with_its_mlp)
for _name, _fn in captured(transformer.TransformerBlock.forward,
                           "TransformerBlock.forward").items():
    add(C11b, 2, _name, NOTHING, FORBIDDEN, pre_ln_block=_block_by(_fn))


# Chapter 12, the induction score: the module's function and its mask of copyable positions,
# reached by other routes, pasted in, and captured before the check ran.
def _by_copyable(copyable):
    """A right induction score whose (sequence, query) pairs come from copyable(first, second,
    length, T), a (B, T) boolean mask."""
    def induction_score(weights, first, second, length):
        b, query = copyable(first, second, length, weights.shape[-1]).nonzero(as_tuple=True)
        key = query - (second - first)[b] + 1
        return weights[b, :, query, key].mean(dim=0)
    return induction_score


def _module_mask(first, second, length, T):
    tokens = torch.zeros(len(first), T + 1, dtype=torch.long)
    return importlib.import_module("induction").Batch(tokens, first, second, length).copyable()


IND_ALIASES = {  # class 1
    "the module's induction_score through importlib and getattr":
        lambda w, f, s, n: getattr(importlib.import_module("induction"), "induction" + "_score")(
            w, f, s, n),
    "a pasted copy of the module's induction_score": _pasted(
        induction.induction_score, _check_weights=induction._check_weights),
    "the module's Batch.copyable through importlib": _by_copyable(_module_mask),
    "Batch.copyable called as a plain function": _by_copyable(
        lambda f, s, n, T: induction.Batch.copyable(types.SimpleNamespace(
            inputs=torch.zeros(len(f), T), first=f, second=s, length=n))),
}
for _name, _fn in IND_ALIASES.items():
    add(C12, 1, _name, NOTHING, FORBIDDEN if "pasted" not in _name
        else "a copy of the module's code", induction_score=_fn)
for _name, _fn in captured(induction.induction_score, "the module's induction_score").items():
    add(C12, 2, _name, NOTHING, FORBIDDEN, induction_score=_fn)
for _name, _fn in captured(induction.Batch.copyable, "the module's Batch.copyable").items():
    add(C12, 2, _name, NOTHING, FORBIDDEN, induction_score=_by_copyable(
        (lambda c: lambda f, s, n, T: c(induction.Batch(torch.zeros(len(f), T + 1,
                                                                    dtype=torch.long),
                                                        f, s, n)))(_fn)))


# Chapter 13, the bigram loss: the module's function by other routes, pasted in, and captured.
def _as_tensor(loss):
    """The module's float as the () tensor the exercise returns."""
    return lambda *args: torch.tensor(loss(*args), dtype=torch.float64)


BIGRAM_ALIASES = {  # class 1
    "the module's bigram_loss through importlib and getattr": _as_tensor(
        lambda *args: getattr(importlib.import_module("lm"), "bigram" + "_loss")(*args)),
    "the module's bigram_loss in a thread of its own": _as_tensor(
        in_a_thread(lambda *args: lm.bigram_loss(*args))),
    "a pasted copy of the module's bigram_loss": _as_tensor(_pasted(
        lm.bigram_loss, _check_tokens=lm._check_tokens)),
}
for _name, _fn in BIGRAM_ALIASES.items():
    add(C13, 1, _name, NOTHING, FORBIDDEN if "pasted" not in _name
        else "a copy of the module's code", bigram_loss=_fn)
for _name, _fn in captured(lm.bigram_loss, "the module's bigram_loss").items():
    add(C13, 2, _name, NOTHING, FORBIDDEN, bigram_loss=_as_tensor(_fn))


# Chapter 13, the model from its parts: the module's DecoderLM and lm.build by other routes,
# pasted in, and captured; and right answers in other layouts, which earn everything.
from test_exercises import lm_fused_by_hand, lm_own_module  # noqa: E402


def _lm_through(make):
    """lm_logits by a DecoderLM that make(vocab, n_pos, d_model, num_heads, d_ff, layers,
    tie_weights=True, dtype=...) builds, holding the given weights."""
    def lm_logits(tokens, weights, num_heads):
        E = weights["embed.weight"]
        layers = len({name.split(".")[1] for name in weights if name.startswith("blocks.")})
        model = make(E.shape[0], len(weights["position.weight"]), E.shape[1], num_heads,
                     len(weights["blocks.0.linear1.weight"]), layers, tie_weights=True,
                     dtype=E.dtype)
        model.load_state_dict({**weights, "unembed.weight": E})
        return model(tokens)
    return lm_logits


def _pasted_decoder():
    """A copy of the module's DecoderLM, its source pasted into the notebook."""
    namespace = {"torch": torch, "nn": torch.nn, "Optional": Optional, "Tensor": Tensor,
                 "TransformerBlock": transformer.TransformerBlock,
                 "KVCache": attention.KVCache}
    exec(inspect.getsource(transformer.DecoderLM), namespace)
    return namespace["DecoderLM"]


def _build_by(build):
    """lm_logits through build(config, vocab_size), the module's lm.build or a copy."""
    def make(vocab, n_pos, d_model, num_heads, d_ff, layers, tie_weights, dtype):
        config = lm.Config(context=n_pos, d_model=d_model, num_heads=num_heads, d_ff=d_ff,
                           num_layers=layers)
        return build(config, vocab).to(dtype)
    return _lm_through(make)


MODEL_ALIASES = {  # class 1
    "the module's DecoderLM through importlib and getattr": _lm_through(
        lambda *a, **k: getattr(importlib.import_module("transformer"), "Decoder" + "LM")(
            *a, **k)),
    "the module's DecoderLM built in a thread of its own": _lm_through(
        in_a_thread(lambda *a, **k: transformer.DecoderLM(*a, **k))),
    "a pasted copy of the module's DecoderLM": _lm_through(_pasted_decoder()),
    "the module's lm.build through importlib and getattr": _build_by(
        lambda *a: getattr(importlib.import_module("lm"), "bu" + "ild")(*a)),
}
for _name, _fn in MODEL_ALIASES.items():
    add(C13m, 1, _name, NOTHING, FORBIDDEN if "pasted" not in _name
        else "a copy of the module's code", lm_logits=_fn)
for _name, _fn in captured(transformer.DecoderLM, "the module's DecoderLM").items():
    add(C13m, 2, _name, NOTHING, FORBIDDEN, lm_logits=_lm_through(_fn))
for _name, _fn in captured(lm.build, "the module's lm.build").items():
    add(C13m, 2, _name, NOTHING, FORBIDDEN, lm_logits=_build_by(_fn))
add(C13m, 4, "no module: one matrix for W_Q, W_K, W_V, attention by hand", FULL,
    lm_logits=lm_fused_by_hand)
add(C13m, 4, "a module of its own, its parameters under other names", FULL,
    lm_logits=lm_own_module)


# Chapter 13, the training steps: lm.train and the schedule Config.learning_rate by other
# routes and captured; right answers with AdamW written out or on its foreach path.
from test_exercises import (_train_like, train_adamw_by_hand,  # noqa: E402
                            train_foreach_and_a_list_of_rates)


def _train_by(train):
    """train_steps through train(config, seed, text, until=n), lm.train or another route to it,
    made to start from the given model and batches."""
    def train_steps(model, inputs, targets, config):
        text = "".join(chr(65 + i) for i in range(model.vocab_size)) * 8 * config.context
        queue = list(zip(inputs, targets))
        saved = lm.build, lm._batch
        lm.build, lm._batch = (lambda c, v: model), (lambda tokens, c, g: queue.pop(0))
        try:
            _, log = train(config, 0, text, until=len(inputs))
        finally:
            lm.build, lm._batch = saved
        return (torch.tensor(log["lr"], dtype=torch.float64),
                torch.tensor(log["loss"], dtype=torch.float64), model.state_dict())
    return train_steps


def _rate_by(rate_of):
    return lambda model, inputs, targets, config: _train_like(
        model, inputs, targets, config, rate_of=rate_of)


TRAIN_ALIASES = {  # class 1
    "the module's lm.train through importlib and getattr": _train_by(
        lambda *a, **k: getattr(importlib.import_module("lm"), "tr" + "ain")(*a, **k)),
    "the module's lm.train in a thread of its own": _train_by(
        in_a_thread(lambda *a, **k: lm.train(*a, **k))),
    "Config.learning_rate through type(config) and getattr": _rate_by(
        lambda t, c: getattr(type(c), "learning" + "_rate")(c, t)),
}
for _name, _fn in TRAIN_ALIASES.items():
    add(C13t, 1, _name, NOTHING, FORBIDDEN, train_steps=_fn)
for _name, _fn in captured(lm.Config.learning_rate, "the module's Config.learning_rate").items():
    add(C13t, 2, _name, NOTHING, FORBIDDEN,
        train_steps=_rate_by((lambda f: lambda t, c: f(c, t))(_fn)))
add(C13t, 4, "AdamW written out, float64 throughout", FULL, train_steps=train_adamw_by_hand)
add(C13t, 4, "PyTorch's AdamW on its foreach path", FULL,
    train_steps=train_foreach_and_a_list_of_rates)


# Chapter 13, sampling and writing: the module's sample, truncated and generate by other routes,
# pasted in, and captured; a right sampler that draws other tokens from the same distribution.
from test_exercises import lm_sample_ref, sample_by_inverse_cdf  # noqa: E402


def _sample_by(draw_from):
    """sample through draw_from(logits, temperature, top_k, top_p, generator)."""
    return lambda logits, temperature, top_k, top_p, generator: draw_from(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)


def _truncated_by(truncate):
    """A sampler of its own around truncate(logits, temperature=..., top_k=..., top_p=...)."""
    def sample(logits, temperature, top_k, top_p, generator):
        if temperature == 0:
            return logits.argmax(dim=-1)
        z = truncate(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        probs = torch.softmax(z.reshape(-1, logits.shape[-1]), dim=-1)
        return torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])
    return sample


def _generate_by(write):
    """generate through write(model, prompt, n, temperature=..., generator=..., cache=...)."""
    return lambda model, prompt, n, temperature, generator, cache: write(
        model, prompt, n, temperature=temperature, generator=generator, cache=cache)


_pasted_truncated = _pasted(lm.truncated, _check_sampling=lm._check_sampling,
                            Optional=Optional)
SAMPLING_ALIASES = {  # class 1
    "the module's sample through importlib and getattr": dict(sample=_sample_by(
        lambda *a, **k: getattr(importlib.import_module("lm"), "sam" + "ple")(*a, **k))),
    "the module's sample in a thread of its own": dict(sample=_sample_by(
        in_a_thread(lambda *a, **k: lm.sample(*a, **k)))),
    "a pasted copy of the module's truncated": dict(sample=_truncated_by(_pasted_truncated)),
    "the module's generate through importlib and getattr": dict(generate=_generate_by(
        lambda *a, **k: getattr(importlib.import_module("lm"), "gene" + "rate")(*a, **k))),
}
for _name, _fns in SAMPLING_ALIASES.items():
    add(C13s, 1, _name, NOTHING, FORBIDDEN if "pasted" not in _name
        else "a copy of the module's code", **_fns)
for _name, _fn in captured(lm.sample, "the module's sample").items():
    add(C13s, 2, _name, NOTHING, FORBIDDEN, sample=_sample_by(_fn))
for _name, _fn in captured(lm.truncated, "the module's truncated").items():
    add(C13s, 2, _name, NOTHING, FORBIDDEN, sample=_truncated_by(_fn))
for _name, _fn in captured(lm.generate, "the module's generate").items():
    add(C13s, 2, _name, NOTHING, FORBIDDEN, generate=_generate_by(_fn))
add(C13s, 4, "other tokens from the same distribution: one uniform number against the "
    "cumulative probabilities", FULL, sample=sample_by_inverse_cdf)


# Chapter 13, the capstone: the module's model, its build and the chapter's trained weights by
# other routes and captured (untrained: with the rules lifted they still pass the case of the
# names); class 4 written out: a class of its own in float32, the reference's weights cast.
from test_exercises import capstone_a_class_in_float32, capstone_too_few_steps  # noqa: E402


def _capstone_from(make):
    """train_lm whose model is make(n_vocab), untrained: its weights and 2 heads."""
    return lambda train_tokens, n_vocab, seconds: (make(n_vocab).state_dict(), 2)


def _small_config():
    return lm.Config(context=16, d_model=32, num_heads=2, d_ff=128, num_layers=1)


CAPSTONE_ALIASES = {  # class 1
    "the module's DecoderLM through importlib and getattr": _capstone_from(
        lambda V: getattr(importlib.import_module("transformer"), "Decoder" + "LM")(
            V, 16, 32, 2, 128, 1)),
    "the module's lm.build through importlib and getattr": _capstone_from(
        lambda V: getattr(importlib.import_module("lm"), "bu" + "ild")(_small_config(), V)),
    "the chapter's trained weights through importlib and getattr": (
        lambda train_tokens, n_vocab, seconds: (getattr(importlib.import_module("lm"), (
            "load" + "_run"))("shakespeare").model.state_dict(), 4)),
}
for _name, _fn in CAPSTONE_ALIASES.items():
    add(C13c, 1, _name, NOTHING, FORBIDDEN, train_lm=_fn)
for _name, _fn in captured(transformer.DecoderLM, "the module's DecoderLM").items():
    add(C13c, 2, _name, NOTHING, FORBIDDEN,
        train_lm=_capstone_from((lambda f: lambda V: f(V, 16, 32, 2, 128, 1))(_fn)))


def _weights_cast(fn, dtype):
    def train_lm(train_tokens, n_vocab, seconds):
        weights, num_heads = fn(train_tokens, n_vocab, seconds)
        return {name: w.to(dtype) for name, w in weights.items()}, num_heads
    return train_lm


add(C13c, 4, "a class of its own, float32, the weights from named_parameters", FULL,
    train_lm=capstone_a_class_in_float32)
add(C13c, 4, "the reference, its weights returned in float32", FULL,
    train_lm=_weights_cast(reference_functions(C13c)["train_lm"], torch.float32))


# ---------------------------------------------------------------------------------------------
# Classes 3, 4 and 6, made from each check's reference solution


def _tensors_of(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


def mutating(fn, which):
    """fn, then the tensor argument `which` (0 = first, -1 = last) overwritten in place."""
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        out = fn(*args, **kwargs)
        out = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out) if isinstance(
            out, tuple) else out.clone()  # not a view of what it overwrites next
        tensors = _tensors_of(args) + _tensors_of(kwargs.values())
        target = tensors[which]
        with torch.no_grad():
            target.zero_() if target.dtype == torch.bool else target.add_(1)
        return out
    return answer


def _widened(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of module whose parameters are float64 tensors computed from the original's, so
    that gradients still reach the original's parameters."""
    import copy
    wide = copy.deepcopy(module)
    for name, original in module.named_parameters():
        *path, leaf = name.split(".")
        owner = functools.reduce(getattr, path, wide)
        del owner._parameters[leaf]
        setattr(owner, leaf, original.double())
    return wide


def in_float64(fn, cast_back):
    """fn computed in float64; its floating results cast back to the input's dtype or not. A
    module argument (chapter 11's block) is passed with float64 parameters computed from its
    own."""
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        floating = [a.dtype for a in _tensors_of(args) if a.is_floating_point()]
        wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                _widened(a) if isinstance(a, torch.nn.Module) else a for a in args]
        out = fn(*wide, **kwargs)
        if cast_back and floating:
            back = lambda t: t.to(floating[0]) if t.is_floating_point() else t  # noqa: E731
            return tuple(back(t) for t in out) if isinstance(out, tuple) else back(out)
        return out
    return answer


def emptied(fn, how):
    """fn's results with every tensor replaced by zeros or ones of its shape and dtype, or
    the first argument returned in place of each tensor ("input")."""
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        out = fn(*args, **kwargs)
        if how == "input":
            first = args[0]
            return tuple(first for _ in out) if isinstance(out, tuple) else first
        make = torch.zeros_like if how == "zeros" else torch.ones_like
        if isinstance(out, torch.Tensor):
            return make(out)
        if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
            return tuple(make(t) for t in out)
        return tuple(0.0 if how == "zeros" else 1.0 for _ in out)  # chapter 3's two floats
    return answer


def peeking(fn):
    """fn, after a look at the frame that called it (where the check keeps what it expects)."""
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        sys._getframe(1)
        return fn(*args, **kwargs)
    return answer


DTYPE_REQUIRED = {C4, C5b, C8}  # the exercise asks for the input's dtype back
# The answer trains the module it is given: a copy whose parameters are float64 tensors computed
# from the original's has nothing to train, so these checks' class 4 is written out below.
TRAINS_ITS_MODULE = {C13t}
# The capstone's reference trains for seconds: classes 1, 3 and 6 start from a stand-in that
# trains ten steps (its model is below the unigram counts, not yet the bigram counts: part of
# the points); the check's one input has no floating tensor, so its class 4 is written out above.
STAND_IN = {C13c: {"train_lm": capstone_too_few_steps}}

for _check in CHECK_NAMES:
    _names = REFERENCES[_check].functions
    _reference = STAND_IN.get(_check) or reference_functions(_check)
    for _fn_name in _names:
        _fn = _reference[_fn_name]
        if _check != C3:  # chapter 3's function takes no tensor
            for _which, _label in ((0, "its first"), (-1, "its last")):
                add(_check, 3, f"{_fn_name} overwrites {_label} tensor argument", PART,
                    "modified its argument", **{_fn_name: mutating(_fn, _which)})
        if _check in TRAINS_ITS_MODULE or _check in STAND_IN:
            continue
        add(_check, 4, f"{_fn_name} in float64, cast back", FULL,
            **{_fn_name: in_float64(_fn, True)})
        add(_check, 4, f"{_fn_name} in float64, returned in float64",
            PART if _check in DTYPE_REQUIRED else FULL,
            "must keep" if _check in DTYPE_REQUIRED else None,
            **{_fn_name: in_float64(_fn, False)})
    for _how in ("zeros", "ones", "input"):
        add(_check, 6, f"returns {_how} of the right shapes", FIFTH,
            **{name: emptied(fn, _how) for name, fn in _reference.items()})
    add(_check, 1, "right, after a look at the check's frame", NOTHING, "frames",
        **{name: peeking(fn) for name, fn in _reference.items()})


def _variance_in_float64(d_k, n, sigma, generator):
    return _measured(d_k, n, sigma,
                     lambda *shape: torch.randn(*shape, generator=generator,
                                                dtype=torch.float64))


add(C3, 4, "drawn and measured in float64", FULL, score_variance=_variance_in_float64)


# ---------------------------------------------------------------------------------------------
# Class 5: right where the fixed inputs look, wrong where the statement also asks

# Chapter 3's inputs are three numbers, written out below; the capstone's one input is the
# book's text and the time, the same for every answer: there is no other input to be wrong on.
NOWHERE_ELSE = {C3, C13c}


def _key(args, by_value=True) -> tuple:
    """The arguments of a call, by value, or by their shapes and the other arguments; the
    tensors in a dict, list or tuple (chapter 14's weights) too, without their repr (which
    formats every number in Python, inside the check's recording: seconds per call)."""
    def part(a):
        if isinstance(a, torch.Tensor):
            return tuple(a.shape), tuple(a.detach().flatten().tolist()) if by_value else None
        if isinstance(a, dict):
            return tuple((k, part(v)) for k, v in a.items())
        if isinstance(a, (list, tuple)):
            return type(a).__name__, tuple(part(v) for v in a)
        return repr(a)
    return tuple(part(a) for a in args)


def known_arguments(check, by_value=True) -> set:
    """The arguments the check's fixed cases give its function: the cases but the shapes
    (which take every input) and the ones drawn at random."""
    seen = set()
    graded = load_check(check)
    reference = reference_functions(check)

    def recording(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            seen.add(_key(args, by_value))
            return fn(*args, **kwargs)
        return call

    answers = tuple(recording(fn) for fn in reference.values())
    for title in graded.cases:
        if "random" not in title and "shape" not in title:
            with contextlib.redirect_stdout(io.StringIO()):
                graded._attempt(title, graded._answers(answers))
    return seen


def memorising(check, fn, by_value=True):
    """fn on the arguments the fixed cases give (or on their sizes), zeros of the right shapes
    elsewhere: what passes every case that no input drawn at random reaches. The arguments it
    knows are found by `answer.prepare()`, which the test calls before grading (it runs the
    check, so not while collecting the tests, and not inside a graded call)."""
    known: set = set()

    @functools.wraps(fn)
    def answer(*args, **kwargs):
        if _key(args, by_value) in known:
            return fn(*args, **kwargs)
        return emptied(fn, "zeros")(*args, **kwargs)

    def prepare():
        if not known:
            known.update(known_arguments(check, by_value))
    answer.prepare = prepare
    return answer


for _check in CHECK_NAMES:
    if _check in NOWHERE_ELSE:
        continue
    _reference = reference_functions(_check)
    _first = REFERENCES[_check].functions[0]
    add(_check, 5, "right only on the inputs of the fixed cases", PART, "random",
        **{_first: memorising(_check, _reference[_first])})
    add(_check, 5, "right only at the sizes of the fixed cases", PART, "random",
        **{_first: memorising(_check, _reference[_first], by_value=False)})


def _buffer_of_five_keys(query, key, w_1, w_2, w_out):
    """Broadcast, but into a buffer sized for the book's examples, which have at most 5 keys."""
    hidden = torch.zeros(query.shape[0], 5, w_out.shape[0])
    S = min(key.shape[0], 5)
    hidden[:, :S] = (query @ w_1)[:, None, :] + (key[:S] @ w_2)[None, :, :]
    return (torch.tanh(hidden) @ w_out)[:, :key.shape[0]] if key.shape[0] <= 5 else torch.cat(
        [torch.tanh(hidden) @ w_out, torch.zeros(query.shape[0], key.shape[0] - 5)], dim=1)


add(C2b, 5, "a buffer of 5 keys, as many as the fixed cases have", PART, "random",
    additive_scores=_buffer_of_five_keys)


def _capped(limit):
    def cached_attention(k_cache, v_cache, q, k, v):
        keys = torch.cat([k_cache, k], 1)[:, -limit:]  # the oldest positions dropped
        values = torch.cat([v_cache, v], 1)[:, -limit:]
        S, n = keys.shape[1] - q.shape[1], q.shape[1]
        sees = torch.ones(n, S + n, dtype=torch.bool).tril(diagonal=S)
        return _by_hand(q, keys, values, sees), keys, values
    return cached_attention


add(C9, 5, "a cache capped at 8 positions", PART, "64 positions", cached_attention=_capped(8))
add(C9, 5, "a cache capped at 16 positions", PART, "64 positions", cached_attention=_capped(16))


def _cross(scale_width, empty_nan=False):
    def cross_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
        q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
        scores = q @ k.transpose(-2, -1) / math.sqrt(scale_width(x_dec, w_q))
        if enc_lengths is not None:
            pad = torch.arange(k.shape[1]) >= enc_lengths[:, None, None]
            scores = scores.masked_fill(pad, NEG_INF)
        weights = torch.softmax(scores, -1)
        return (weights if empty_nan else weights.nan_to_num(0.0)) @ v
    return cross_attention


add(C7, 5, "NaN for an empty source", PART, "NaN in the output of example(s) [1]",
    cross_attention=_cross(lambda x_dec, w_q: w_q.shape[-1], empty_nan=True))
add(C7, 5, "divided by sqrt(d_dec)", PART, "sqrt(d_dec)",
    cross_attention=_cross(lambda x_dec, w_q: x_dec.shape[-1]))


def _rope_angles_in(dtype_of):
    def rope_interleaved(x, positions):
        d, dtype = x.shape[-1], dtype_of(x)
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=dtype) / d)
        angles = (positions.to(dtype)[..., None] * freq).double()
        a, b = x[..., 0::2].double(), x[..., 1::2].double()
        return torch.stack([a * angles.cos() - b * angles.sin(),
                            b * angles.cos() + a * angles.sin()], -1).flatten(-2).to(x.dtype)
    return rope_interleaved


add(C8, 5, "angles in x's half-precision dtype", PART, "compute the angles p * frequency in "
    "float64", rope_interleaved=_rope_angles_in(lambda x: x.dtype))
add(C8, 5, "angles in bfloat16 always", PART, "low precision",
    rope_interleaved=_rope_angles_in(lambda x: torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# The tests


def _id(entry):
    return f"{entry.check}-{entry.kind}-{entry.name}"


@pytest.mark.parametrize("entry", CATALOGUE, ids=_id)
def test_the_catalogue_earns_what_it_should(entry, capsys):
    for fn in entry.functions.values():
        getattr(fn, "prepare", lambda: None)()  # an answer that must see the check first
    earned, messages = graded_points(entry.check, entry.functions)
    full = load_check(entry.check).points
    failed = [m for m in messages.values() if m is not None]
    report = f"{entry.name} earns {earned} of {full}: {messages}"
    if entry.earns == NOTHING:
        assert earned == 0, report
    elif entry.earns == PART:
        assert 0 < earned < full, report
    elif entry.earns == FIFTH:
        assert earned <= full / 5, report
    else:
        assert earned == full, report
    if entry.fragment:
        assert any(entry.fragment in m for m in failed), (entry.fragment, report)


@pytest.mark.parametrize("entry", [e for e in CATALOGUE if e.fragment == FORBIDDEN], ids=_id)
def test_a_forbidden_answer_computes_where_its_rules_are_lifted(entry, monkeypatch):
    """A forbidden answer is a working shortcut: with its check's rules lifted, it passes a case,
    or fails every case for no reason but the other ways of hiding work (another thread,
    compiled code). An answer that raised everywhere would earn nothing whatever the rules did,
    and prove nothing."""
    check = load_check(entry.check)
    monkeypatch.setattr(check, "rules", ())
    monkeypatch.setattr(check, "_looked", {})
    for fn in entry.functions.values():
        getattr(fn, "prepare", lambda: None)()
    functions = reference_functions(entry.check)
    functions.update(entry.functions)
    messages = []
    for title in check.cases:
        message = check._run(title, tuple(functions.values()))
        if message is None:
            return
        messages.append(message)
    assert all(FORBIDDEN in message for message in messages), (entry.name, messages)


def test_every_class_has_two_members_for_every_check():
    for check in CHECK_NAMES:
        kinds = [entry.kind for entry in CATALOGUE if entry.check == check]
        for kind in range(1, 7):
            if check == C3 and kind == 3:  # it takes no tensor, so it has none to modify
                continue
            if check == C13c and kind == 5:  # one input only (NOWHERE_ELSE)
                continue
            assert kinds.count(kind) >= 2, (check, kind)


def test_a_check_never_crashes():
    """Whatever the answer returns or raises, every case reports a message."""
    oddities = {
        "returns None": lambda *a, **k: None,
        "returns a string": lambda *a, **k: "weights",
        "returns a list of ints": lambda *a, **k: [1, 2, 3],
        "returns a complex tensor": lambda *a, **k: torch.zeros(2, dtype=torch.complex64),
        "raises KeyError": lambda *a, **k: {}["x"],
        "raises TypeError": lambda *a, **k: len(5),
        "raises ZeroDivisionError": lambda *a, **k: 1 / 0,
        "returns an int tensor": lambda *a, **k: torch.ones(3, dtype=torch.int64),
    }
    for check in CHECK_NAMES:
        graded = load_check(check)
        names = REFERENCES[check].functions
        for label, odd in oddities.items():
            answer = [odd for _ in names]
            for title in graded.cases:
                message = graded._run(title, tuple(answer))
                assert message, (check, label, title)


# What the recording sees: every alias of the issue, and what a dispatch mode would miss.
ALIASES = {
    "torch.special.softmax": (lambda z: torch.special.softmax(z, -1), "softmax"),
    "log_softmax().exp()": (lambda z: torch.log_softmax(z, -1).exp(), "softmax"),
    "torch._C._nn.scaled_dot_product_attention": (
        lambda z: torch._C._nn.scaled_dot_product_attention(z[None], z[None], z[None]),
        "scaled_dot_product"),
    "scaled_dot_product_attention as a softmax": (lambda z: _sdpa_as_softmax(z, -1),
                                                  "scaled_dot_product"),
    "torch.special.logsumexp": (lambda z: torch.special.logsumexp(z, -1), "logsumexp"),
    "torch.ops.aten._softmax": (lambda z: torch.ops.aten._softmax(z, -1, False), "softmax"),
}


@pytest.mark.parametrize("alias", ALIASES)
def test_the_recording_sees_every_alias(alias):
    call, family = ALIASES[alias]
    z = torch.randn(3, 4)
    with checking.recording() as recorded:
        call(z)
    assert any(family in op for op in recorded.ops), sorted(recorded.ops)


def test_a_dispatch_mode_would_not_see_attention_on_its_math_path():
    """Why the checks record with the profiler: below the composite operators, a
    TorchDispatchMode sees PyTorch's attention on its math path as the bmm, mul and softmax
    that an attention exercise allows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    z = torch.randn(1, 2, 3, 4)
    for call, family in ((lambda: _on_math(z, z, z, None, None), "scaled_dot_product"),
                         (lambda: F.scaled_dot_product_attention(z[0], z[0], z[0]),
                          "scaled_dot_product")):
        with Names() as mode:
            call()
        assert not any(family in name for name in mode.names), mode.names
        with checking.recording() as recorded:
            call()
        assert any(family in op for op in recorded.ops)


def test_no_check_is_a_generator():
    """A generator of a check's inputs that a failing case leaves unfinished is closed by the
    garbage collector at some later moment; if that moment falls inside another answer's
    recording, its code runs there and counts as the answer's (the check's own code), and the
    answer earns nothing. It happened: check_additive_scores, graded after check_split_merge had
    failed, once lost all its points to _heads_inputs of checks_multi_head.py. So no check
    yields; the recording's own context managers in checking.py always run to their end."""
    for path in sorted((pathlib.Path(checking.__file__).parent).glob("checks_*.py")):
        tree = ast.parse(path.read_text())
        generators = sorted({node.name for node in ast.walk(tree)
                             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                             and any(isinstance(inner, (ast.Yield, ast.YieldFrom, ast.GeneratorExp))
                                     and _owner(node, inner) for inner in ast.walk(node))})
        assert not generators, f"{path.name}: {generators} yield"


def _owner(function, inner) -> bool:
    """Whether the yield or generator expression `inner` belongs to `function` itself (not to a
    function nested in it), for a yield; a generator expression is flagged wherever it is
    unless it is consumed where it is made (an argument of a call)."""
    if isinstance(inner, ast.GeneratorExp):
        return False  # consumed by the call that receives it, or by unpacking
    for node in ast.walk(function):
        if node is not function and isinstance(node, (ast.FunctionDef, ast.Lambda)):
            if any(sub is inner for sub in ast.walk(node)):
                return False
    return True


def test_a_generator_closed_during_an_answer_would_count_as_the_answers():
    """Why the test above exists: a check's unfinished generator, closed while an answer is
    recorded, is seen as the check's own code running inside the answer."""
    import gc
    namespace = {}
    exec(compile("def pending():\n    yield 1\n    yield 2\n",
                 str(pathlib.Path(checking.__file__).parent / "checks_example.py"), "exec"),
         namespace)
    gen = namespace["pending"]()
    next(gen)  # left unfinished
    with checking.recording() as recorded:
        del gen  # closed here, by reference counting
        gc.collect()
    assert recorded.seen_elsewhere() is not None


def test_the_recording_writes_nothing(capfd):
    """The profiler's start and stop messages (Kineto writes a line to descriptor 2 each time)
    are silenced: a notebook would show them."""
    with checking.recording():
        torch.ones(3).exp()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_the_recording_sees_other_threads():
    """An operator that a thread started beforehand runs while the answer runs, handed to it
    through a plain list and a lock, with no call the answer's thread could be seen making."""
    import _thread
    import time

    assert isinstance(checking._profiler(), checking._AllThreads)
    jobs, stop = [], []

    def worker():
        while not stop:
            if jobs:
                fn, done = jobs.pop()
                fn()
                done.release()
            time.sleep(0.0002)

    threading.Thread(target=worker, daemon=True).start()
    done = _thread.allocate_lock()
    done.acquire()
    with checking.recording() as recorded:
        jobs.append((lambda: torch.softmax(torch.ones(3), 0), done))
        done.acquire()
    stop.append(True)
    assert recorded.elsewhere and "softmax" in recorded.elsewhere[1], recorded.elsewhere
    assert any("softmax" in op for op in recorded.ops)


def test_the_recording_restores_a_profile_function():
    import sys
    seen = []
    previous = sys.getprofile()
    sys.setprofile(lambda *args: None)
    try:
        marker = sys.getprofile()
        with checking.recording():
            seen.append(1)
        assert sys.getprofile() is marker
    finally:
        sys.setprofile(previous)


def test_what_an_answer_replaces_in_the_checks_or_their_comparisons_is_put_back_and_refused():
    """In a reader's own kernel, an answer that replaces the check's helpers or PyTorch's
    comparisons while it runs earns nothing, and finds them put back afterwards."""
    allclose, same = torch.allclose, checking._same

    def stable_softmax(scores, dim=-1):
        torch.allclose = lambda *args, **kwargs: True
        checking._same = lambda a, b: True
        return torch.zeros_like(scores)

    try:
        earned, messages = graded_points(C4, {"stable_softmax": stable_softmax})
        assert torch.allclose is allclose and checking._same is same
    finally:
        torch.allclose, checking._same = allclose, same
    assert earned == 0, messages
    assert all("was replaced, and is put back" in m for m in messages.values()), messages


def test_the_checks_modules_are_found_after_any_change_to_sys_modules(monkeypatch):
    """`_check_modules` scans sys.modules again only when its length or last name changed:
    it still finds a module added, one added after another was removed (the same length), and
    one put in place of another under the same name."""
    found = [module.__name__ for module in checking._check_modules()]
    assert "checking" in found and all(n.startswith("checks_") for n in found if n != "checking")
    added = types.ModuleType("checks_zz_added")
    monkeypatch.setitem(sys.modules, added.__name__, added)
    assert added in checking._check_modules()
    monkeypatch.setitem(sys.modules, "zz_filler", types.ModuleType("zz_filler"))
    checking._check_modules()
    length = len(sys.modules)
    monkeypatch.delitem(sys.modules, "zz_filler")
    swapped = types.ModuleType("checks_zz_swapped")
    monkeypatch.setitem(sys.modules, swapped.__name__, swapped)
    assert len(sys.modules) == length and swapped in checking._check_modules()
    replaced = types.ModuleType(added.__name__)
    monkeypatch.setitem(sys.modules, added.__name__, replaced)
    now = checking._check_modules()
    assert replaced in now and added not in now


# ---------------------------------------------------------------------------------------------
# The chapters' promises


PROMISE = re.compile(r"no points to an answer that[^.]*", re.S)
NEGATION = re.compile(r"\b(?:[Nn]o|[Nn]ot|[Nn]or|[Ww]ithout)\b")


def promises() -> list[tuple[str, str, list[str]]]:
    """(check, sentence, the names in backticks that it rules out) for every exercise that
    promises a refusal: the names from the sentence's first negation ("no", "not", "Do not")
    to the end of the promise, leaving out the function's own arguments."""
    found = []
    for path in numbered_chapters():
        chapter = read_source(path)
        for exercise in chapter.exercises:
            checks = re.findall(r"`(check_\w+)\(", exercise.text)
            if not checks:
                continue
            arguments = set(inspect.signature(
                next(iter(reference_functions(checks[0]).values()))).parameters)
            text = " ".join(exercise.text.split())
            for match in PROMISE.finditer(text):
                start = max(text.rfind(". ", 0, match.start()), 0)
                negation = NEGATION.search(text, start, match.start())
                sentence = text[negation.start() if negation else start:match.end()]
                names = [name for name in re.findall(r"`([\w.]+)`", sentence)
                         if name not in arguments]
                found.append((checks[0], sentence, names))
    return found


def test_every_chapter_promise_is_in_the_catalogue():
    """Each name that an exercise's promise rules out has an answer in the catalogue (here or
    among tests/test_exercises.py's forbidden answers) that calls it and earns nothing."""
    from test_exercises import EARNS, FORBIDDEN_WORK, WRONG
    found = promises()
    assert len({check for check, _, _ in found}) >= 12, found
    for check, sentence, names in found:
        labels = [e.name + " " + " ".join(e.calls) for e in CATALOGUE
                  if e.check == check and e.earns == NOTHING]
        labels += [inspect.getsource(fn) for _, _, _, fn in WRONG[check]
                   if fn.__name__ in FORBIDDEN_WORK and EARNS[check, fn.__name__] == NOTHING]
        for name in names:
            if name.startswith("check_"):
                continue
            short = name.rsplit(".", 1)[-1]
            assert any(short in label for label in labels), (check, name, sentence)


FRESH_KERNEL = '''
import sys
sys.path[:0] = {paths!r}
from checks_multi_head import check_grouped_query_attention
from checks_masking import check_masked_softmax
from attention import scaled_dot_product_attention
import torch


def grouped_query_attention(q, k, v):
    H, G = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // G, dim=1)
    v = v.repeat_interleave(H // G, dim=1)
    return scaled_dot_product_attention(q, k, v)[0]


def masked_softmax(scores, mask):
    mask = mask.expand(torch.broadcast_shapes(mask.shape, scores.shape))  # imports lazily
    filled = scores.masked_fill(~mask, float("-inf"))
    top = filled.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exp = torch.exp(filled - top)
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


for check, answer in ((check_grouped_query_attention, grouped_query_attention),
                      (check_masked_softmax, masked_softmax)):
    for title in check.cases:
        check.grade(title, answer)
'''


def test_a_right_answer_earns_everything_in_a_fresh_kernel():
    """In a fresh kernel, as nbgrader's, the first calls of some PyTorch functions import
    modules lazily, inside the answer's first call; what those imports run (an Enum's __new__,
    for one) is not forbidden work."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = FRESH_KERNEL.format(paths=[str(root / "code")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passed" in proc.stdout


def test_a_right_answer_earns_everything_with_the_book_reached_through_a_link(tmp_path):
    """A student who links the book's folder into a course folder imports the checks through
    the link: the checks' own code must still count as the book's, not as the answer's."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "book").symlink_to(root, target_is_directory=True)
    code = FRESH_KERNEL.format(paths=[str(tmp_path / "book" / "code")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": passed") == proc.stdout.count("\n"), proc.stdout
