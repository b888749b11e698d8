"""Scaled dot-product attention and multi-head attention, written to be read.

This is the one implementation the book uses: every chapter imports it, and
the tests compare it with PyTorch's own
``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.MultiheadAttention``.

Shape legend (the letters of the book's notation page and PyTorch's docs)::

    B   batch size
    H   number of heads
    L   number of queries (target sequence length)
    S   number of keys and values (source sequence length)
    E   width of a query or key, d_k
    Ev  width of a value, d_v
    D   model width, d_model = H * head_dim

Mask convention, everywhere in this module: a boolean mask is True where a
query *may attend* to a key (the convention of PyTorch's
``scaled_dot_product_attention``); a floating mask is *added* to the scores.
``torch.nn.MultiheadAttention`` and the layers built on it
(``nn.Transformer``, ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``) use the opposite boolean meaning (True =
blocked): negate a boolean mask when passing it between them and this module.

A query whose keys are all masked gets zero weights and a zero output, never
NaN. Masked positions are filled with ``-inf`` and the softmax is written to
survive that, so one fill serves every dtype. A finite fill such as ``-1e9``
does not: it overflows in float16, whose largest magnitude is 65504
(``masked_fill`` raises; converted, it becomes ``-inf``), while bfloat16 and
float32 hold it (bfloat16 rounds it to about ``-9.98e8``); and where it fits,
a row whose keys are all masked gets uniform weights over those keys instead
of zeros.

References: Vaswani et al. (2017), "Attention Is All You Need", section 3.2.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "causal_mask",
    "padding_mask",
    "MultiHeadAttention",
    "KVCache",
    "repeat_kv",
    "plot_attention",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------- softmax


def softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax along ``dim``; all ``-inf`` slices give 0.

    Subtracting the slice maximum leaves the result unchanged (softmax is
    shift invariant) and keeps every exponent <= 0, so nothing overflows.
    """
    if not isinstance(scores, Tensor) or not scores.is_floating_point():
        raise TypeError(
            f"softmax expects a floating-point tensor, got {_describe(scores)}"
        )
    if scores.shape[dim] == 0:  # nothing to weigh (no keys at all)
        return torch.zeros_like(scores)
    top = scores.amax(dim=dim, keepdim=True)
    # An all -inf slice has top = -inf, and exp(-inf - (-inf)) is NaN:
    # shift such a slice by 0 instead.
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exp = torch.exp(scores - top.detach())
    total = exp.sum(dim=dim, keepdim=True)
    # An all -inf slice has exp == 0 everywhere: divide it by 1, not by 0, so
    # the result and its gradient are zeros rather than NaN.
    return exp / torch.where(total > 0, total, torch.ones_like(total))


# ----------------------------------------------------------------------- masks


def causal_mask(
    L: int, S: Optional[int] = None, *, window: Optional[int] = None,
    sinks: int = 0, device=None,
) -> Tensor:
    """Boolean ``(L, S)`` mask, True on and below the diagonal.

    Query i may attend to keys 0..i. With ``S != L`` the diagonal starts at
    the top-left corner, as PyTorch's ``is_causal=True`` does. With
    ``window=W`` query i sees only the last W of them, keys i-W+1..i (a
    sliding window): True where ``0 <= i - j < W``. ``sinks=s`` keeps the
    first s keys visible besides the window (the "attention sinks" of
    StreamingLLM): True where ``j <= i`` and (``i - j < W`` or ``j < s``),
    at most W + s keys per query. Without a window every earlier key is
    visible already, and ``sinks`` changes nothing.
    """
    S = L if S is None else S
    sizes = {"L": L, "S": S, **({} if window is None else {"window": window})}
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"causal_mask needs positive integer sizes, got {name}={n!r}"
            )
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(
            f"causal_mask needs a non-negative integer sinks, got {sinks!r}"
        )
    causal = torch.ones(L, S, dtype=torch.bool, device=device).tril()  # (L, S)
    if window is None:
        return causal
    mask = causal.triu(-(window - 1))  # drop keys W or more steps back
    mask[:, :sinks] |= causal[:, :sinks]  # the first keys, where causal
    return mask


def padding_mask(
    lengths: Union[Tensor, Sequence[int]], S: int, *, device=None
) -> Tensor:
    """Boolean ``(B, S)`` mask, True at the first ``lengths[b]`` positions.

    The first ``lengths[b]`` positions of sequence b are its real tokens, the
    rest padding. As ``attn_mask``, add the query (and head) axes:
    ``padding_mask(lengths, S)[:, None, :]`` is ``(B, 1, S)``, broadcasting
    over L; ``padding_mask(lengths, S)[:, None, None, :]`` is
    ``(B, 1, 1, S)``, broadcasting over heads too.
    """
    lengths = torch.as_tensor(lengths, device=device)
    if (lengths.dim() != 1 or lengths.is_floating_point()
            or lengths.dtype == torch.bool):
        raise ValueError(
            "padding_mask needs a 1-D integer tensor of lengths, got "
            f"{_describe(lengths)}"
        )
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(
            f"padding_mask needs a positive integer S, got S={S!r}"
        )
    if lengths.numel() and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(
            f"padding_mask lengths must lie in [0, S={S}], "
            f"got {lengths.tolist()}"
        )
    positions = torch.arange(S, device=lengths.device)  # (S,)
    return positions[None, :] < lengths[:, None]  # (B, S)


# ------------------------------------------------------------------- attention


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """softmax(query @ key^T * scale + mask) @ value -> (output, weights).

    Shapes: query ``(..., L, E)``, key ``(..., S, E)``, value
    ``(..., S, Ev)``; the leading axes broadcast. Returns output
    ``(..., L, Ev)`` and weights ``(..., L, S)``.

    ``attn_mask`` is boolean (True = may attend) or floating (added to the
    scores), of any shape that broadcasts to ``(..., L, S)``.
    ``is_causal=True`` lets query i see keys 0..i; given together with
    ``attn_mask``, both apply (PyTorch's function raises for the pair from
    version 2.14 on, and in 2.13 on some backends).
    ``scale`` defaults to ``1 / sqrt(E)``. ``dropout_p`` drops weights at
    random (always, like PyTorch's function: pass 0 at evaluation). The
    returned weights are the ones the output was computed with, so
    ``output == weights @ value``.
    """
    _check_qkv(query, key, value)
    L, E, S = query.shape[-2], query.shape[-1], key.shape[-2]
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(E)

    # float16/bfloat16: compute in float32 so large scores cannot overflow.
    compute_dtype = query.dtype
    if compute_dtype in _HALF_DTYPES:
        compute_dtype = torch.float32
    q, k = query.to(compute_dtype), key.to(compute_dtype)
    # Scaling the queries (L x E numbers) is cheaper than the scores (L x S).
    scores = (q * scale) @ k.transpose(-2, -1)  # (..., L, S)

    if attn_mask is not None:
        scores = _apply_mask(scores, attn_mask, query, key)
    if is_causal and L > 0 and S > 0:  # an empty sequence has nothing to mask
        future = ~causal_mask(L, S, device=scores.device)  # (L, S)
        scores = scores.masked_fill_(future, float("-inf"))

    weights = softmax(scores, dim=-1)  # (..., L, S)
    if dropout_p > 0.0:
        weights = nn.functional.dropout(weights, p=dropout_p, training=True)
    weights = weights.to(value.dtype)
    v = value.to(compute_dtype)
    output = weights.to(compute_dtype) @ v  # (..., L, Ev)
    return output.to(value.dtype), weights


def _apply_mask(
    scores: Tensor, attn_mask: Tensor, query: Tensor, key: Tensor
) -> Tensor:
    """Scores with a boolean mask filled by -inf, or a floating mask added."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(
            f"attn_mask must be a tensor, got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(
            "attn_mask must be boolean (True = may attend) or floating (added "
            f"to the scores), got dtype {attn_mask.dtype}"
        )
    target = tuple(scores.shape)
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
            f"to the scores (..., L, S) = {target} of query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if attn_mask.dtype == torch.bool:
        return scores.masked_fill(~attn_mask, float("-inf"))
    return scores + attn_mask.to(scores.dtype)


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> None:
    """Raise ValueError, naming every shape, unless query, key, value fit."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(
                f"{name} must be floating point, got dtype {t.dtype}"
            )
    shapes = (f"query {tuple(query.shape)}, key {tuple(key.shape)}, "
              f"value {tuple(value.shape)}")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise ValueError(
            f"query, key and value need at least 2 dims (..., seq, width); "
            f"got {shapes}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dim E; got {shapes}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S (dim -2); got {shapes}"
        )
    try:
        torch.broadcast_shapes(
            query.shape[:-2], key.shape[:-2], value.shape[:-2]
        )
    except RuntimeError:
        raise ValueError(
            f"the batch dims of query, key and value do not broadcast; "
            f"got {shapes}"
        ) from None
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share a dtype; got {query.dtype}, "
            f"{key.dtype}, {value.dtype}"
        )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


# ------------------------------------------------------------------ multi-head


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first, True in a boolean mask = may attend.

    ``num_heads`` heads of width ``head_dim = d_model // num_heads`` attend
    in parallel; their outputs are concatenated and mixed by ``out_proj``.
    Same parameter count as ``torch.nn.MultiheadAttention(d_model,
    num_heads, bias=bias)``: 4 D^2 weights, plus 4 D biases if ``bias``.
    Keys and values may come from a sequence of another width (an encoder
    of another size): ``kdim`` and ``vdim`` are then the widths that
    ``k_proj`` and ``v_proj`` read, as in PyTorch's module. ``device`` and
    ``dtype`` place the parameters.

    ``num_kv_heads`` (G, a divisor of ``num_heads``; default ``num_heads``)
    gives grouped-query attention: ``k_proj`` and ``v_proj`` output only
    ``G * head_dim`` features, and query head h reads key/value head
    ``h // (num_heads // G)``, as PyTorch's ``enable_gqa=True`` pairs them.
    ``num_kv_heads=1`` is multi-query attention.
    """

    def __init__(
        self, d_model: int, num_heads: int, *,
        num_kv_heads: Optional[int] = None, dropout: float = 0.0,
        bias: bool = True, kdim: Optional[int] = None,
        vdim: Optional[int] = None, device=None, dtype=None,
    ):
        super().__init__()
        if d_model < 1 or num_heads < 1 or d_model % num_heads != 0:
            raise ValueError(
                f"d_model={d_model} must be a positive multiple of "
                f"num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} must be a positive divisor of "
                f"num_heads={num_heads}"
            )
        self.d_model = d_model
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        kv_width = num_kv_heads * self.head_dim
        place = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, d_model, **place)
        self.k_proj = nn.Linear(self.kdim, kv_width, **place)
        self.v_proj = nn.Linear(self.vdim, kv_width, **place)
        self.out_proj = nn.Linear(d_model, d_model, **place)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        attn_mask: Optional[Tensor] = None,
        is_causal: bool = False,
        cache: Optional["KVCache"] = None,
    ) -> tuple[Tensor, Tensor]:
        """Attend from query ``(B, L, D)`` to key, value ``(B, S, D)``.

        Returns output ``(B, L, D)`` and weights ``(B, H, L, S)``.
        ``attn_mask`` broadcasts to ``(B, H, L, S)``: ``(L, S)`` for one
        mask shared by all, ``(B, 1, 1, S)`` for key padding. A 3-D mask
        is read as PyTorch's module reads it, ``(B * H, L, S)``.

        With a ``cache`` (self-attention while decoding; see ``KVCache``)
        the L new tokens' keys and values are stored in it first, and S
        counts every key the cache gives the new queries: the cached ones
        and the new. ``is_causal`` then aligns the new queries with the
        *last* L keys (bottom right), since they are the newest positions.
        The weights' S columns, and the key axis of an ``attn_mask``,
        follow the order of the keys the cache returns,
        ``cache.key_positions``: position order, except in a rolling cache
        (``KVCache(window=W)``) whose slots have wrapped around.
        """
        self._check_inputs(query, key, value)
        if cache is not None and query.shape[1] != key.shape[1]:
            raise ValueError(
                "a KVCache is for self-attention: the new queries are the new "
                f"positions, so query and key need one length; got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}"
            )
        q = self.split_heads(self.q_proj(query))  # (B, H, L, head_dim)
        k = self.split_heads(self.k_proj(key))  # (B, G, S, head_dim)
        v = self.split_heads(self.v_proj(value))  # (B, G, S, head_dim)
        if cache is not None:  # S becomes the cached positions plus the new
            k, v, visible = cache.update(k, v, is_causal=is_causal)
            is_causal = False  # visible (L, S) holds the alignment instead
        if attn_mask is not None and attn_mask.dim() == 3:
            B, _, L, _ = q.shape
            attn_mask = self._unflatten_heads(attn_mask, B, L, k.shape[-2])
        if cache is not None:
            attn_mask = visible if attn_mask is None else _and_mask(attn_mask, visible)
        groups = self.num_heads // self.num_kv_heads
        heads, weights = scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups),
            attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, H, L, head_dim), (B, H, L, S)
        output = self.out_proj(self.merge_heads(heads))  # (B, L, D)
        return output, weights

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, H, T, head_dim); head h: h-th slice of D. The
        keys and values of grouped-query attention, (B, T, G * head_dim),
        split the same way into (B, G, T, head_dim)."""
        B, T, width = x.shape
        x = x.view(B, T, width // self.head_dim, self.head_dim)  # (B, T, H, hd)
        return x.transpose(1, 2)  # (B, H, T, head_dim)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, T, head_dim) -> (B, T, D), the inverse of split_heads."""
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.d_model)  # (B, T, D)

    def _unflatten_heads(self, attn_mask: Tensor, B: int, L: int, S: int):
        """(B * H, L, S) -> (B, H, L, S). Broadcasting a 3-D mask against
        (B, H, L, S) would pair its first axis with the heads, silently."""
        H = self.num_heads
        if tuple(attn_mask.shape) != (B * H, L, S):
            raise ValueError(
                f"a 3-D attn_mask must be (B * num_heads, L, S) = "
                f"{(B * H, L, S)}, got {tuple(attn_mask.shape)}; for one mask "
                f"per sequence use (B, 1, L, S)"
            )
        return attn_mask.view(B, H, L, S)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor):
        shapes = (f"query {tuple(query.shape)}, key {tuple(key.shape)}, "
                  f"value {tuple(value.shape)}")
        if not (query.dim() == key.dim() == value.dim() == 3):
            raise ValueError(
                "MultiHeadAttention expects 3-D (B, T, d_model) inputs; "
                f"got {shapes}"
            )
        widths = (query.shape[-1], key.shape[-1], value.shape[-1])
        if widths != (self.d_model, self.kdim, self.vdim):
            raise ValueError(
                f"last dims must be (d_model, kdim, vdim) = "
                f"{(self.d_model, self.kdim, self.vdim)}; got {shapes}"
            )
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(
                f"query, key and value must share the batch size B; "
                f"got {shapes}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length S; got {shapes}"
            )

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A copy of the weights of ``m``, a ``torch.nn.MultiheadAttention``.

        Build ``m`` with ``batch_first=True`` for inputs laid out the same
        way. PyTorch stacks W_Q, W_K, W_V in one ``(3D, D)``
        ``in_proj_weight``: rows ``[0, D)`` are W_Q, ``[D, 2D)`` W_K and
        ``[2D, 3D)`` W_V; with ``kdim`` or ``vdim`` other than D it keeps
        them apart, as ``q_proj_weight``, ``k_proj_weight``,
        ``v_proj_weight``.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(
                "from_torch expects torch.nn.MultiheadAttention, "
                f"got {type(m).__name__}"
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "from_torch supports neither add_bias_kv nor add_zero_attn"
            )
        bias = m.in_proj_bias is not None
        if m._qkv_same_embed_dim:  # one stacked (3D, D) matrix
            D = m.embed_dim
            weights = [m.in_proj_weight[i * D:(i + 1) * D] for i in range(3)]
        else:  # kdim or vdim differ: three matrices
            weights = [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
        w = weights[0]
        new = cls(m.embed_dim, m.num_heads, dropout=m.dropout, bias=bias,
                  kdim=m.kdim, vdim=m.vdim, device=w.device, dtype=w.dtype)
        D = m.embed_dim
        projections = (new.q_proj, new.k_proj, new.v_proj)
        with torch.no_grad():
            for i, proj in enumerate(projections):
                proj.weight.copy_(weights[i])
                if bias:
                    proj.bias.copy_(m.in_proj_bias[i * D:(i + 1) * D])
            new.out_proj.weight.copy_(m.out_proj.weight)
            if bias:
                new.out_proj.bias.copy_(m.out_proj.bias)
        new.train(m.training)
        return new


# ---------------------------------------------------------- key-value cache


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, G, S, head_dim) -> (B, G * n_rep, S, head_dim): each key/value
    head repeated ``n_rep`` times in a row, so that head h of the result is
    head ``h // n_rep`` of ``x`` (grouped-query attention's pairing)."""
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"repeat_kv needs a positive integer n_rep, got {n_rep!r}")
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=-3)


def _and_mask(attn_mask: Tensor, visible: Tensor) -> Tensor:
    """A user's mask combined with the cache's boolean (L, S) alignment."""
    if attn_mask.dtype == torch.bool:
        return attn_mask & visible
    return attn_mask.masked_fill(~visible, float("-inf"))


class KVCache:
    """The keys and values a decoder has computed so far, for self-attention.

    Pass the same cache to every call of one ``MultiHeadAttention`` while
    generating: ``out, w = mha(x_new, x_new, x_new, is_causal=True,
    cache=cache)``. Each call stores the new tokens' keys and values and
    lets the new queries, the newest positions, see every stored key and,
    with ``is_causal``, the new keys up to their own position. Any chunking
    of a sequence (the prompt at once, then one token at a time) then gives
    the rows of ``mha(x, x, x, is_causal=True)`` on the whole sequence.

    Three kinds, which differ in how they store, not in what they compute:

    ``KVCache()``
        concatenates: each call allocates new tensors for the stored and
        the new keys and values (``torch.cat``) and copies all of them
        into it, so a call after t positions copies t + n of them.
    ``KVCache(capacity=N)``
        preallocates: the first call allocates storage for N positions,
        ``(B, G, N, head_dim)`` for keys and for values, in the dtype and
        on the device of its keys; each call writes the new positions into
        it in place and returns views of the filled part (no copy). More
        than N positions raise a ValueError.
    ``KVCache(window=W)``
        a rolling buffer for sliding-window attention (a query at position
        p sees keys p-W+1..p only): the first call allocates W slots, and
        position p is written into slot p % W, over position p - W, which
        no later query may see. Once the positions wrap around, the slots
        are not in position order; attention does not depend on the order
        of the keys, as long as each key keeps its value and its mask
        entry, so ``update`` returns keys and values in slot order with the
        mask computed from the position each slot holds
        (``slot_positions``). A call that overwrites no key its queries
        need (one new token, or a chunk that fits in the slots not yet
        used) is written first and attends to the filled slots themselves,
        a view; a longer chunk attends to the slots followed by its own
        keys (a new tensor of at most W + n positions), and then its last
        min(n, W) positions are written into their slots.
    ``KVCache(window=W, sinks=s)``
        a rolling buffer that also keeps the first s positions, the
        "attention sinks" of StreamingLLM (Xiao et al. 2024): s + W slots,
        position p < s in slot p for good, and every later position in the
        ring of the other W, position p in slot s + (p - s) % W. A query at
        position p sees keys p-W+1..p and keys 0..s-1, the mask
        ``causal_mask(T, window=W, sinks=s)``. Chunks are handled as above,
        with s + W slots in place of W.

    ``window`` and ``capacity`` together are refused: a rolling cache
    holds its W slots (s + W with sinks); ``sinks`` needs a ``window``.
    ``keys``, ``values`` (``(B, G, len(cache), head_dim)``, None while
    empty) and ``len(cache)`` are the stored keys and values in position
    order for every kind (a rolling cache that has wrapped around returns a
    reordered copy, its sinks first); ``seen`` counts the positions
    processed so far (the position of the next token), and
    ``key_positions`` the positions of the keys the last ``update``
    returned, in their order (a user's mask over those keys follows it).

    The preallocated and rolling caches write into their storage in place:
    they are for inference, under ``torch.no_grad()`` (or
    ``torch.inference_mode()``). A later write would change keys that the
    backward pass of earlier steps saved (autograd would then fail inside
    ``backward()``), so given keys or values that require gradients while
    autograd records, they raise a RuntimeError at once. The
    concatenating cache supports autograd.
    """

    def __init__(self, window: Optional[int] = None,
                 capacity: Optional[int] = None, sinks: int = 0):
        for name, size in (("window", window), ("capacity", capacity)):
            if size is not None and (isinstance(size, bool)
                                     or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be a non-negative integer, got {sinks!r}")
        if window is not None and capacity is not None:
            raise ValueError(
                f"give window or capacity, not both (window={window}, "
                f"capacity={capacity}): a rolling cache holds its {window} "
                "slots and never needs more"
            )
        if sinks and window is None:
            raise ValueError(
                f"sinks={sinks} keeps the first positions of a rolling cache, "
                "besides its window: give window too (without one, every "
                "position is kept anyway)"
            )
        self.window = window
        self.capacity = capacity
        self.sinks = sinks
        self._keys: Optional[Tensor] = None  # concatenating: the stored keys;
        self._values: Optional[Tensor] = None  # otherwise the storage
        self._slots: Optional[Tensor] = None  # rolling: position per slot
        self.key_positions: Optional[Tensor] = None  # of the last update's keys
        self.seen = 0

    @property
    def kind(self) -> str:
        """"concatenating", "preallocated" or "rolling"."""
        if self.window is not None:
            return "rolling"
        return "concatenating" if self.capacity is None else "preallocated"

    def __len__(self) -> int:
        if self.kind == "concatenating":
            return 0 if self._keys is None else self._keys.shape[-2]
        return self.seen if self.kind == "preallocated" else min(self.seen, self._rows)

    @property
    def _rows(self) -> int:
        """The rolling cache's slots: the window's and the sinks'."""
        return self.window + self.sinks

    def __repr__(self) -> str:
        sinks = f"sinks={self.sinks}, " if self.sinks else ""
        size = {"concatenating": "", "preallocated": f"capacity={self.capacity}, ",
                "rolling": f"window={self.window}, {sinks}"}[self.kind]
        return f"KVCache({size}holds {len(self)} positions, seen={self.seen})"

    @property
    def keys(self) -> Optional[Tensor]:
        """The stored keys ``(B, G, len(cache), head_dim)``, in position order."""
        return self._in_order(self._keys)

    @property
    def values(self) -> Optional[Tensor]:
        """The stored values ``(B, G, len(cache), head_dim)``, in position order."""
        return self._in_order(self._values)

    @property
    def storage(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The tensors the cache holds its keys and values in: for a
        preallocated cache ``(B, G, capacity, head_dim)``, for a rolling one
        ``(B, G, sinks + window, head_dim)`` in slot order, for a concatenating one
        the stored keys and values themselves (None before the first call)."""
        return self._keys, self._values

    @property
    def slot_positions(self) -> Optional[Tensor]:
        """The position each row of ``storage`` holds, -1 for a row not
        written yet (a copy; None before the first call). For a rolling
        cache, slot s holds the latest position p with p % window == s
        (with sinks, slot p < sinks holds position p, and slot sinks + r the
        latest position p >= sinks with (p - sinks) % window == r)."""
        if self._keys is None:
            return None
        if self.kind == "rolling":
            return self._slots.clone()
        rows = torch.arange(self._keys.shape[-2], device=self._keys.device)
        return torch.where(rows < len(self), rows, -1)

    def _in_order(self, stored: Optional[Tensor]) -> Optional[Tensor]:
        if stored is None or len(self) == 0:
            return None
        if self.kind == "concatenating":
            return stored
        if self.kind == "preallocated" or self.seen <= self._rows:
            return stored[..., :len(self), :]  # a view: slot p holds position p
        s = self.sinks  # the sinks' slots, then the ring from its oldest slot,
        oldest = self._slot(self.seen - self.window)  # that of position seen - W
        return torch.cat([stored[..., :s, :], stored[..., oldest:, :],
                          stored[..., s:oldest, :]], dim=-2)

    def reset(self, release: bool = False) -> None:
        """Forget the positions: the next call starts a new sequence. A
        preallocated or rolling cache keeps its storage for that sequence
        (which must then have the same B, G, head_dim, dtype and device)
        unless ``release=True``, which drops it; a concatenating cache
        always drops its tensors."""
        self.seen = 0
        self.key_positions = None
        if release or self.kind == "concatenating":
            self._keys = self._values = self._slots = None
        elif self._slots is not None:
            self._slots.fill_(-1)

    def update(
        self, key: Tensor, value: Tensor, *, is_causal: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store ``key`` ``(B, G, n, head_dim)`` and ``value`` ``(B, G, n,
        head_dim_v)`` of n new tokens, the positions ``seen .. seen + n - 1``.

        Returns every key and value the new queries may need, ``(B, G, S,
        head_dim)``, and the boolean ``(n, S)`` mask of which ones each new
        query sees. Concatenating and preallocated caches return them in
        position order, S = stored + n (views of the storage for a
        preallocated cache); a rolling cache returns them in the order of
        its slots (see the class's docstring).
        """
        self._check(key, value)
        n, start = key.shape[-2], self.seen
        if self.kind == "concatenating":
            if self._keys is not None:
                key = torch.cat([self._keys, key], dim=-2)
                value = torch.cat([self._values, value], dim=-2)
            self._keys, self._values = key, value
            positions = torch.arange(start + n - key.shape[-2], start + n,
                                     device=key.device)
        elif self.kind == "preallocated":
            if start + n > self.capacity:
                raise ValueError(
                    f"the cache holds {start} positions and {n} new ones do not "
                    f"fit its capacity of {self.capacity}: {start} + {n} > "
                    f"{self.capacity}; create it with a larger capacity"
                )
            self._allocate(key, value, self.capacity)
            self._keys[..., start:start + n, :] = key  # in place: no new tensor
            self._values[..., start:start + n, :] = value
            key = self._keys[..., :start + n, :]  # views of the filled part
            value = self._values[..., :start + n, :]
            positions = torch.arange(start + n, device=key.device)
        else:
            key, value, positions = self._roll(key, value)
        self.seen += n
        self.key_positions = positions
        S = positions.shape[0]
        if self.window is None:  # keys at positions 0 .. start + n - 1, in order
            visible = torch.ones(n, S, dtype=torch.bool, device=key.device)
            return key, value, visible.tril(S - n) if is_causal else visible
        query_pos = torch.arange(start, start + n, device=key.device)
        back = query_pos[:, None] - positions[None, :]  # (n, S): steps back
        visible = (back < self.window) | (positions < self.sinks)[None, :]
        return key, value, visible & (back >= 0) if is_causal else visible

    def _roll(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The rolling cache's update: (keys, values, their positions)."""
        W, start, n = self.window, self.seen, key.shape[-2]
        rows = self._rows  # W, or W + sinks
        self._allocate(key, value, rows)
        held = min(start, rows)  # slots in use before this call
        if n == 1 or start + n <= rows:
            # Writing first overwrites only positions no new query may see
            # (with n = 1, position start - W), so attend to the slots.
            self._write(key, value, start)
            filled = min(start + n, rows)
            return (self._keys[..., :filled, :], self._values[..., :filled, :],
                    self._slots[:filled].clone())
        # A chunk that wraps around: its first queries still need keys that
        # its later positions will overwrite, so attend to the slots as they
        # are, followed by the chunk's own keys, and write afterwards.
        keys = torch.cat([self._keys[..., :held, :], key], dim=-2)
        values = torch.cat([self._values[..., :held, :], value], dim=-2)
        positions = torch.cat([self._slots[:held],
                               torch.arange(start, start + n, device=key.device)])
        sinks = max(0, min(n, self.sinks - start))  # the chunk's sink positions
        if sinks:  # (a chunk that wraps and starts among the sinks)
            self._write(key[..., :sinks, :], value[..., :sinks, :], start)
        keep = min(n - sinks, W)  # the chunk's last positions, which the ring keeps
        self._write(key[..., n - keep:, :], value[..., n - keep:, :], start + n - keep)
        return keys, values, positions

    def _slot(self, p: int) -> int:
        """The slot of position p: p itself for a sink, else its place in the ring."""
        s = self.sinks
        return p if p < s else s + (p - s) % self.window

    def _write(self, key: Tensor, value: Tensor, first: int) -> None:
        """Write m positions first, first + 1, ... into their slots, in
        place: positions among the sinks go to slots first, first + 1, ...;
        later ones, at most W, to the ring (two slices where it wraps)."""
        m, s = key.shape[-2], self.sinks
        positions = torch.arange(first, first + m, device=self._slots.device)
        c = max(0, min(m, s - first))  # the positions among the sinks
        self._keys[..., first:first + c, :] = key[..., :c, :]
        self._values[..., first:first + c, :] = value[..., :c, :]
        self._slots[first:first + c] = positions[:c]
        if c == m:
            return
        slot = self._slot(first + c)
        a = min(m - c, self._rows - slot)  # positions up to the end of the slots
        b = m - c - a  # the rest, from the ring's first slot, s
        self._keys[..., slot:slot + a, :] = key[..., c:c + a, :]
        self._values[..., slot:slot + a, :] = value[..., c:c + a, :]
        self._keys[..., s:s + b, :] = key[..., c + a:, :]
        self._values[..., s:s + b, :] = value[..., c + a:, :]
        self._slots[slot:slot + a] = positions[c:c + a]
        self._slots[s:s + b] = positions[c + a:]

    def _allocate(self, key: Tensor, value: Tensor, rows: int) -> None:
        """The storage, on the first call (or after ``reset(release=True)``)."""
        if self._keys is not None:
            return
        B, G, _, d_k = key.shape
        place = {"dtype": key.dtype, "device": key.device}
        self._keys = torch.empty(B, G, rows, d_k, **place)
        self._values = torch.empty(B, G, rows, value.shape[-1], **place)
        if self.kind == "rolling":
            self._slots = torch.full((rows,), -1, dtype=torch.long, device=key.device)

    def _check(self, key: Tensor, value: Tensor) -> None:
        shapes = f"key {_describe(key)}, value {_describe(value)}"
        if not (isinstance(key, Tensor) and isinstance(value, Tensor)
                and key.dim() == value.dim() == 4):
            raise ValueError("KVCache.update expects 4-D (B, G, n, head_dim) keys "
                             f"and values; got {shapes}")
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"keys and values must agree in (B, G, n); got {shapes}")
        if self.kind != "concatenating" and (key.dtype != value.dtype
                                             or key.device != value.device):
            raise ValueError(
                f"keys and values must share a dtype and a device; got {shapes} "
                f"on {key.device} and {value.device}")
        if self.kind != "concatenating" and torch.is_grad_enabled() and (
                key.requires_grad or value.requires_grad):
            raise RuntimeError(
                f"a {self.kind} KVCache writes into its storage in place and is for "
                "inference: call the model under torch.no_grad(), or use KVCache() "
                "(which concatenates) to differentiate through the cache")
        if self._keys is None:
            return
        stored_k, stored_v = self._keys, self._values
        if (key.shape[:2] != stored_k.shape[:2] or key.shape[-1] != stored_k.shape[-1]
                or value.shape[-1] != stored_v.shape[-1]):
            held = (f"the cached keys {tuple(self.keys.shape)}" if len(self) else
                    f"the cache's storage {tuple(stored_k.shape)}")
            raise ValueError(
                f"new keys {tuple(key.shape)} do not fit {held}: (B, G, head_dim) "
                "must agree; call reset(release=True), or use another cache, to "
                "start a sequence of another shape")
        if self.kind != "concatenating" and (key.dtype != stored_k.dtype
                                             or key.device != stored_k.device):
            raise ValueError(
                f"new keys of dtype {key.dtype} on {key.device} do not fit the "
                f"cache's storage of dtype {stored_k.dtype} on {stored_k.device}")


# -------------------------------------------------------------------- plotting


def plot_attention(
    weights, row_labels=None, col_labels=None, *, ax=None, title=None,
    annotate=None, cmap="viridis", vmin=0.0, vmax=None, decimals=2,
):
    """Heatmap of an ``(L, S)`` weight matrix: rows are queries, columns keys.

    Numbers are printed in the cells when the matrix is small
    (``annotate=None`` means "at most 10 x 10"). Returns the matplotlib
    ``AxesImage``. Matplotlib is imported here only, so the rest of the
    module does not need it.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if isinstance(weights, Tensor):
        w = weights.detach().float().cpu().numpy()
    else:
        w = np.asarray(weights, dtype=float)
    if w.ndim != 2:
        raise ValueError(
            f"plot_attention needs a 2-D (L, S) matrix, got shape {w.shape}"
        )
    ax = ax if ax is not None else plt.gca()
    image = ax.imshow(w, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    L, S = w.shape
    if annotate is None:
        annotate = L <= 10 and S <= 10
    if annotate:
        lo, hi = image.get_clim()
        middle = (lo + hi) / 2
        for i in range(L):
            for j in range(S):
                # Dark text on the bright end of the map, light on the dark.
                colour = "black" if w[i, j] > middle else "white"
                ax.text(j, i, f"{w[i, j]:.{decimals}f}", ha="center",
                        va="center", color=colour, fontsize=9)
    ax.set_xticks(range(S), labels=range(S) if col_labels is None
                  else col_labels)
    ax.set_yticks(range(L), labels=range(L) if row_labels is None
                  else row_labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    return image
