"""Scaled dot-product attention and multi-head attention, written to be read.

This is the one implementation the book uses: every chapter imports it, and the tests
compare it with PyTorch's own ``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.MultiheadAttention``.

Shape legend (the same letters as the book's notation page and PyTorch's docs)::

    B   batch size
    H   number of heads
    L   number of queries (target sequence length)
    S   number of keys and values (source sequence length)
    E   width of a query or key, d_k
    Ev  width of a value, d_v
    D   model width, d_model = H * head_dim

Mask convention, everywhere in this module: a boolean mask is True where a query *may
attend* to a key (PyTorch's ``scaled_dot_product_attention`` convention); a floating mask
is *added* to the scores. ``torch.nn.MultiheadAttention`` uses the opposite boolean meaning
(True = blocked): negate its masks before passing them here.

A query whose keys are all masked gets zero weights and a zero output, never NaN. Masked
positions are filled with ``-inf`` and the softmax is written to survive that, so the code
works in float16 and bfloat16, where a fill such as ``-1e9`` would overflow.

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
    "plot_attention",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- softmax


def softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax along ``dim``; a slice that is all ``-inf`` gives zeros.

    Subtracting the slice maximum leaves the result unchanged (softmax is shift
    invariant) and keeps every exponent <= 0, so nothing overflows.
    """
    if not isinstance(scores, Tensor) or not scores.is_floating_point():
        raise TypeError(f"softmax expects a floating-point tensor, got {_describe(scores)}")
    top = scores.amax(dim=dim, keepdim=True)
    # An all -inf slice has top = -inf and exp(-inf - (-inf)) = NaN; shift it by 0 instead.
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    exp = torch.exp(scores - top)
    total = exp.sum(dim=dim, keepdim=True)
    # For an all -inf slice exp is all zeros; divide by 1 so the result (and its gradient)
    # is zero rather than 0/0.
    return exp / torch.where(total > 0, total, torch.ones_like(total))


# --------------------------------------------------------------------------- masks


def causal_mask(L: int, S: Optional[int] = None, *, device=None) -> Tensor:
    """Boolean ``(L, S)`` mask, True on and below the diagonal: query i sees keys 0..i.

    With ``S != L`` the diagonal starts at the top-left corner, as PyTorch's
    ``is_causal=True`` does.
    """
    S = L if S is None else S
    for name, n in (("L", L), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"causal_mask needs positive integer sizes, got {name}={n!r}")
    return torch.ones(L, S, dtype=torch.bool, device=device).tril()  # (L, S)


def padding_mask(lengths: Union[Tensor, Sequence[int]], S: int, *, device=None) -> Tensor:
    """Boolean ``(B, S)`` mask, True at the first ``lengths[b]`` positions (the real tokens).

    To use it as ``attn_mask`` for a batch of queries, add the query (and head) axes:
    ``padding_mask(lengths, S)[:, None, :]`` has shape ``(B, 1, S)`` and broadcasts over L;
    ``padding_mask(lengths, S)[:, None, None, :]`` has shape ``(B, 1, 1, S)`` for heads.
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(
            f"padding_mask needs a 1-D integer tensor of lengths, got {_describe(lengths)}"
        )
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"padding_mask needs a positive integer S, got S={S!r}")
    if lengths.numel() and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(f"padding_mask lengths must lie in [0, S={S}], got {lengths.tolist()}")
    positions = torch.arange(S, device=lengths.device)  # (S,)
    return positions[None, :] < lengths[:, None]  # (B, S)


# --------------------------------------------------------------------------- attention


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
    """softmax(query @ key^T * scale + mask) @ value, returning ``(output, weights)``.

    Shapes: query ``(..., L, E)``, key ``(..., S, E)``, value ``(..., S, Ev)``; the leading
    axes broadcast. Returns output ``(..., L, Ev)`` and weights ``(..., L, S)``.

    ``attn_mask``: boolean (True = may attend) or floating (added to the scores), of any
    shape that broadcasts to ``(..., L, S)``. ``is_causal=True`` lets query i see keys
    0..i; given together with ``attn_mask`` both apply (PyTorch instead rejects the pair).
    ``scale`` defaults to ``1 / sqrt(E)``. ``dropout_p`` drops weights at random (always,
    like PyTorch's function; pass 0 at evaluation). The returned weights are those the
    output was computed with, so ``output == weights @ value`` holds.
    """
    _check_qkv(query, key, value)
    L, E, S = query.shape[-2], query.shape[-1], key.shape[-2]
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(E)

    # float16/bfloat16: accumulate in float32 so large scores cannot overflow.
    compute_dtype = torch.float32 if query.dtype in _HALF_DTYPES else query.dtype
    q, k = query.to(compute_dtype), key.to(compute_dtype)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., L, S)

    if attn_mask is not None:
        scores = _apply_mask(scores, attn_mask, query, key)
    if is_causal:
        keep = causal_mask(L, S, device=scores.device)  # (L, S)
        scores = scores.masked_fill(~keep, float("-inf"))

    weights = softmax(scores, dim=-1)  # (..., L, S)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p, training=True)
    weights = weights.to(value.dtype)
    output = weights.to(compute_dtype) @ value.to(compute_dtype)  # (..., L, Ev)
    return output.to(value.dtype), weights


def _apply_mask(scores: Tensor, attn_mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """Return scores with a boolean mask filled by -inf or a floating mask added."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(
            f"attn_mask must be boolean (True = may attend) or floating (added to the "
            f"scores), got dtype {attn_mask.dtype}"
        )
    target = tuple(scores.shape)
    try:
        fits = torch.broadcast_shapes(tuple(attn_mask.shape), target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores "
            f"(..., L, S) = {target} of query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if attn_mask.dtype == torch.bool:
        return scores.masked_fill(~attn_mask, float("-inf"))
    return scores + attn_mask.to(scores.dtype)


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> None:
    """Raise ValueError, naming every shape, unless query, key and value fit together."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    shapes = (
        f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    )
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise ValueError(f"query, key and value need at least 2 dims (..., seq, width); got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same last dim E; got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length S (dim -2); got {shapes}")
    try:
        torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dims of query, key and value do not broadcast; got {shapes}") from None
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}"
        )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


# --------------------------------------------------------------------------- multi-head


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first, with PyTorch's mask convention (True = may attend).

    ``num_heads`` heads of width ``head_dim = d_model // num_heads`` attend in parallel;
    their outputs are concatenated and mixed by ``out_proj``. Same parameter count as
    ``torch.nn.MultiheadAttention(d_model, num_heads, bias=bias)``: 4 D^2 (+ 4 D biases).
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model < 1 or num_heads < 1 or d_model % num_heads != 0:
            raise ValueError(
                f"d_model={d_model} must be a positive multiple of num_heads={num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor] = None,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """query ``(B, L, D)``, key and value ``(B, S, D)`` -> output ``(B, L, D)``, weights
        ``(B, H, L, S)``. ``attn_mask`` broadcasts to ``(B, H, L, S)``: ``(L, S)`` for one
        mask shared by all, ``(B, 1, 1, S)`` for key padding."""
        self._check_inputs(query, key, value)
        q = self._split_heads(self.q_proj(query))  # (B, H, L, head_dim)
        k = self._split_heads(self.k_proj(key))  # (B, H, S, head_dim)
        v = self._split_heads(self.v_proj(value))  # (B, H, S, head_dim)
        heads, weights = scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, H, L, head_dim), (B, H, L, S)
        return self.out_proj(self._merge_heads(heads)), weights  # (B, L, D), (B, H, L, S)

    def _split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, head_dim)

    def _merge_heads(self, x: Tensor) -> Tensor:
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.d_model)  # (B, T, D)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        shapes = (
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
        if not (query.dim() == key.dim() == value.dim() == 3):
            raise ValueError(f"MultiHeadAttention expects 3-D (B, T, d_model) inputs; got {shapes}")
        if not (query.shape[-1] == key.shape[-1] == value.shape[-1] == self.d_model):
            raise ValueError(f"last dim must be d_model={self.d_model}; got {shapes}")
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(f"query, key and value must share the batch size B; got {shapes}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value must have the same length S; got {shapes}")

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A copy of ``torch.nn.MultiheadAttention(..., batch_first=True)`` ``m``'s weights.

        PyTorch stores W_Q, W_K, W_V stacked in one ``(3D, D)`` ``in_proj_weight``; rows
        ``[0, D)`` are W_Q, ``[D, 2D)`` W_K and ``[2D, 3D)`` W_V.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch supports kdim = vdim = embed_dim, no add_bias_kv, no add_zero_attn")
        bias = m.in_proj_bias is not None
        new = cls(m.embed_dim, m.num_heads, dropout=m.dropout, bias=bias)
        new = new.to(device=m.in_proj_weight.device, dtype=m.in_proj_weight.dtype)
        D = m.embed_dim
        with torch.no_grad():
            for i, proj in enumerate((new.q_proj, new.k_proj, new.v_proj)):
                proj.weight.copy_(m.in_proj_weight[i * D : (i + 1) * D])
                if bias:
                    proj.bias.copy_(m.in_proj_bias[i * D : (i + 1) * D])
            new.out_proj.weight.copy_(m.out_proj.weight)
            if bias:
                new.out_proj.bias.copy_(m.out_proj.bias)
        new.train(m.training)
        return new


# --------------------------------------------------------------------------- plotting


def plot_attention(weights, row_labels=None, col_labels=None, *, ax=None, title=None,
                   annotate=None, cmap="viridis", vmin=0.0, vmax=None, decimals=2):
    """Heatmap of a ``(L, S)`` weight matrix: rows are queries, columns keys.

    Numbers are printed in the cells when the matrix is small (``annotate=None`` means
    "at most 10 x 10"). Returns the matplotlib ``AxesImage``. Matplotlib is imported only
    here, so the rest of the module does not need it.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    w = weights.detach().float().cpu().numpy() if isinstance(weights, Tensor) else np.asarray(weights, dtype=float)
    if w.ndim != 2:
        raise ValueError(f"plot_attention needs a 2-D (L, S) matrix, got shape {w.shape}")
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
                # Dark text on the bright end of the map, light text on the dark end.
                colour = "black" if w[i, j] > middle else "white"
                ax.text(j, i, f"{w[i, j]:.{decimals}f}", ha="center", va="center",
                        color=colour, fontsize=9)
    ax.set_xticks(range(S), labels=col_labels if col_labels is not None else range(S))
    ax.set_yticks(range(L), labels=row_labels if row_labels is not None else range(L))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    return image
