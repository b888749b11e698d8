"""FlashAttention on the CPU, written to be read: exact attention in tiles.

``flash_attention(q, k, v)`` returns what ``scaled_dot_product_attention``
returns, but it never holds the ``(L, S)`` matrix of scores or weights. It
visits the scores one tile of ``block_size`` queries by ``block_size`` keys
at a time and keeps, for every query row, three running quantities of the
online softmax (Milakov and Gimelshein, 2018):

    m      the largest score seen so far in the row          (..., L)
    ell    the sum of exp(score - m) over the keys seen so far (..., L)
    acc    the sum of exp(score - m) * value, unnormalised   (..., L, Ev)

When a tile raises the maximum from ``m`` to ``m_new``, the old ``ell`` and
``acc`` are multiplied by ``exp(m - m_new)``; the division by ``ell`` happens
once, after the last tile (the loop order of FlashAttention-2, Dao 2023).

The backward pass is a ``torch.autograd.Function`` of its own. It saves the
inputs, the output and one number per query row, the log-sum-exp
``lse = m + log(ell)``, and recomputes each tile of weights as
``exp(score - lse)`` when the gradient needs it, so no tensor saved for
backward has ``L * S`` entries (Dao et al., 2022).

Shape legend as in ``attention.py``: L queries, S keys, E query/key width,
Ev value width; ``...`` are leading (batch, head) axes, which broadcast as
in PyTorch's ``scaled_dot_product_attention``.

``flash_decode(q, k, v)`` is the decoding counterpart (Flash-Decoding, Dao et al.,
2023): the few newest queries against a long cache, the keys split into
``num_splits`` parts that separate workers could take, each part's partial
result merged by its log-sum-exp; the query heads of a grouped-query group are
packed into one matrix, so that each shared key-value head is read once for
the whole group.

This is a teaching implementation: Python loops over tiles, each tile an
ordinary PyTorch matrix product. It shows *what* the GPU kernels compute,
not how fast they compute it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention import _check_qkv

__all__ = ["flash_attention", "visited_tiles", "tile_count", "saved_tensor_bytes",
           "flash_decode", "decode_splits"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------- tiles


def _check_sizes(L: int, S: int, block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    for name, n in (("L", L), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {n!r}")


def _key_tiles(i1: int, S: int, block_size: int, is_causal: bool) -> Iterator[tuple]:
    """Yield (j0, j1) for the key tiles that a query tile ending at row i1 - 1 visits. With
    ``is_causal`` (query i sees keys 0..i) the loop stops at the first tile whose first key
    j0 comes after the tile's last query: that tile and all to its right are fully masked."""
    for j0 in range(0, S, block_size):
        if is_causal and j0 > i1 - 1:
            return
        yield j0, min(j0 + block_size, S)


def _tiles(L: int, S: int, block_size: int, is_causal: bool) -> Iterator[tuple]:
    """Yield (i0, i1, j0, j1) for every tile of queries i0:i1 and keys j0:j1 that is
    visited, query tiles in the outer loop."""
    for i0 in range(0, L, block_size):
        i1 = min(i0 + block_size, L)
        for j0, j1 in _key_tiles(i1, S, block_size, is_causal):
            yield i0, i1, j0, j1


def visited_tiles(L: int, S: int, block_size: int, is_causal: bool = False) -> list:
    """The tiles (I, J) that ``flash_attention`` visits, as 0-based tile indices: I numbers
    the blocks of ``block_size`` queries, J the blocks of keys."""
    _check_sizes(L, S, block_size)
    return [(i0 // block_size, j0 // block_size)
            for i0, _, j0, _ in _tiles(L, S, block_size, is_causal)]


def tile_count(L: int, S: int, block_size: int, is_causal: bool = False) -> int:
    """How many tiles of at most ``block_size x block_size`` scores are computed: all
    ceil(L / block_size) * ceil(S / block_size) of them, or, with ``is_causal``, only those
    with at least one score on or below the diagonal."""
    return len(visited_tiles(L, S, block_size, is_causal))


def _causal_fill(z: Tensor, i0: int, j0: int) -> Tensor:
    """Scores z (..., r, c) of the tile whose first query is i0 and first key j0, with -inf
    where key j > query i; unchanged if the tile lies wholly on or below the diagonal."""
    r, c = z.shape[-2:]
    if j0 + c - 1 <= i0:  # the last key is not after the first query: nothing to mask
        return z
    rows = torch.arange(i0, i0 + r, device=z.device)[:, None]  # (r, 1)
    cols = torch.arange(j0, j0 + c, device=z.device)[None, :]  # (1, c)
    return z.masked_fill(cols > rows, float("-inf"))


# --------------------------------------------------------------------- forward


def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float, block_size: int,
             is_causal: bool) -> tuple[Tensor, Tensor]:
    """q (N, L, E), k (N, S, E), v (N, S, Ev) -> output (N, L, Ev), lse (N, L)."""
    N, L, _ = q.shape
    S, Ev = v.shape[-2], v.shape[-1]
    out = q.new_zeros(N, L, Ev)
    lse = q.new_full((N, L), float("-inf"))
    for i0 in range(0, L, block_size):
        i1 = min(i0 + block_size, L)
        q_tile = q[:, i0:i1] * scale  # (N, r, E)
        m = q.new_full((N, i1 - i0, 1), float("-inf"))  # running row maximum
        ell = q.new_zeros(N, i1 - i0, 1)  # running sum of exp(z - m)
        acc = q.new_zeros(N, i1 - i0, Ev)  # running sum of exp(z - m) v, unnormalised
        for j0, j1 in _key_tiles(i1, S, block_size, is_causal):
            z = q_tile @ k[:, j0:j1].transpose(-2, -1)  # (N, r, c) scores of the tile
            if is_causal:
                z = _causal_fill(z, i0, j0)
            m_new = torch.maximum(m, z.amax(dim=-1, keepdim=True))  # (N, r, 1)
            # A row with no visible key yet keeps m = -inf; shift it by 0, not by -inf.
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            rescale = torch.exp(m - shift)  # (N, r, 1): exp(old max - new max), 0 at the start
            p = torch.exp(z - shift)  # (N, r, c)
            ell = rescale * ell + p.sum(dim=-1, keepdim=True)
            acc = rescale * acc + p @ v[:, j0:j1]  # (N, r, Ev)
            m = m_new
        seen = ell > 0  # False only for a row that saw no key (S == 0)
        out[:, i0:i1] = torch.where(seen, acc / torch.where(seen, ell, 1.0), 0.0)
        lse[:, i0:i1] = (m + torch.log(ell)).squeeze(-1)  # -inf where no key was seen
    return out, lse


# -------------------------------------------------------------------- backward


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              scale: float, block_size: int, is_causal: bool):
    """Gradients (dq, dk, dv) from dout (N, L, Ev): each tile of weights is recomputed as
    exp(z - lse), and dZ = A * (dA - D) with D_i = dout_i . out_i."""
    L, S = q.shape[-2], k.shape[-2]
    D = (dout * out).sum(dim=-1, keepdim=True)  # (N, L, 1): D_i = dY_i . Y_i
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1, j0, j1 in _tiles(L, S, block_size, is_causal):
        z = (q[:, i0:i1] * scale) @ k[:, j0:j1].transpose(-2, -1)  # (N, r, c)
        if is_causal:
            z = _causal_fill(z, i0, j0)
        a = torch.exp(z - lse[:, i0:i1, None])  # (N, r, c): the weights, recomputed
        dv[:, j0:j1] += a.transpose(-2, -1) @ dout[:, i0:i1]  # (N, c, Ev)
        da = dout[:, i0:i1] @ v[:, j0:j1].transpose(-2, -1)  # (N, r, c)
        dz = a * (da - D[:, i0:i1])  # (N, r, c): the softmax's backward, row by row
        dq[:, i0:i1] += (dz @ k[:, j0:j1]) * scale  # (N, r, E)
        dk[:, j0:j1] += (dz.transpose(-2, -1) @ q[:, i0:i1]) * scale  # (N, c, E)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Tiled attention whose backward recomputes the weights from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale, block_size, is_causal):
        out, lse = _forward(q, k, v, scale, block_size, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)  # nothing with L * S entries
        ctx.config = (scale, block_size, is_causal)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.config)
        return dq, dk, dv, None, None, None


# ----------------------------------------------------------------------- entry


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                    scale: Optional[float] = None, block_size: int = 64) -> Tensor:
    """softmax(q @ k^T * scale) @ v computed tile by tile -> output ``(..., L, Ev)``.

    Shapes: q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``. The leading axes
    broadcast against each other as in ``torch.nn.functional.scaled_dot_product_attention``
    (a key and value shared by all heads may have a 1 there, or no axis at all).
    ``scale`` defaults to ``1 / sqrt(E)``. ``is_causal=True`` lets query i see keys 0..i
    (the diagonal starts at the top-left corner, as in PyTorch) and skips the tiles that lie
    wholly above it. ``block_size`` is the number of queries and of keys per tile; L and S
    need not be multiples of it. With no keys (S == 0) the output is zeros, as PyTorch's.

    Equal to PyTorch's math backend up to rounding. Differentiable, through a backward pass
    that recomputes the weights tile by tile: the tensors saved for it are q, k, v (broadcast
    to the common leading shape), the output and the ``(..., L)`` row log-sum-exp. float16
    and bfloat16 inputs are computed in float32 and the output cast back.
    """
    _check_qkv(q, k, v)
    L, E = q.shape[-2], q.shape[-1]
    S, Ev = k.shape[-2], v.shape[-1]
    _check_sizes(L, S, block_size)
    if E == 0:
        raise ValueError(f"queries and keys need a positive width E; got query {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    dtype = q.dtype
    compute = torch.float32 if dtype in _HALF_DTYPES else dtype
    N = math.prod(batch)  # the leading axes, flattened into one
    q3, k3, v3 = (t.to(compute).expand(*batch, *t.shape[-2:]).reshape(N, *t.shape[-2:])
                  for t in (q, k, v))  # (N, L, E), (N, S, E), (N, S, Ev)
    out = _FlashAttention.apply(q3, k3, v3, scale, block_size, bool(is_causal))
    return out.reshape(*batch, L, Ev).to(dtype)


# ------------------------------------------------------------------ measuring


def saved_tensor_bytes(fn: Callable, *args, **kwargs) -> int:
    """Bytes of the tensors that autograd keeps for the backward pass of ``fn(*args,
    **kwargs)``, counted through ``torch.autograd.graph.saved_tensors_hooks``. A storage saved
    several times (a tensor, or views of it) counts once, with its full size."""
    storages = {}

    def pack(t: Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(storages.values())


# --------------------------------------------------------------------- decoding


def decode_splits(S: int, num_splits: int) -> list[tuple[int, int]]:
    """The ``num_splits`` parts ``[(j0, j1), ...]`` of keys 0 .. S - 1 that ``flash_decode``
    gives its workers: contiguous, in order, their sizes differing by at most one."""
    for name, n in (("S", S), ("num_splits", num_splits)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"{name} must be an integer, got {n!r}")
    if not 1 <= num_splits <= S:
        raise ValueError(f"num_splits must be between 1 and S = {S} (the keys), got "
                         f"{num_splits}")
    edges = [S * i // num_splits for i in range(num_splits + 1)]
    return list(zip(edges[:-1], edges[1:]))


def flash_decode(q: Tensor, k: Tensor, v: Tensor, *, num_splits: int = 4,
                 scale: Optional[float] = None) -> Tensor:
    """Attention of the ``L`` newest queries ``q`` ``(B, H, L, d)`` over a cache of ``S`` keys
    and values ``k``, ``v`` ``(B, G, S, d)``, with G dividing H (query head h reads key-value
    head ``h // (H // G)``), causal with the bottom-right alignment: query i of the L sees
    keys 0 .. S - L + i. Returns ``(B, H, L, d)``: what ``scaled_dot_product_attention(q, k,
    v, enable_gqa=True)`` gives with that mask.

    The keys are cut into ``num_splits`` contiguous parts (``decode_splits``); for each part
    and each key-value head, the ``H // G`` query heads of its group and their L queries are
    packed into one ``(H // G * L, d)`` matrix, so the part's keys and values are read once
    for the whole group; each part yields the online softmax's state (the maximum, the sum of
    exponentials and the unnormalised output of every row), and the states are merged by
    their log-sum-exp. Sizes that do not fit (``num_splits`` outside 1 .. S, G not dividing
    H, L > S, other shapes) raise ValueError naming them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, (B, H, L, d) for q and (B, G, S, d) "
                             f"for k and v; got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    B, H, L, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[-1] != d:
        raise ValueError(f"k and v must be (B, G, S, d) = ({B}, G, S, {d}) like q (B, H, L, d) "
                         f"= {tuple(q.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    G, S = k.shape[1], k.shape[2]
    if G < 1 or H % G:
        raise ValueError(f"the key-value heads G = {G} must divide the query heads H = {H}")
    if L > S:
        raise ValueError(f"the L = {L} newest queries must be among the S = {S} cached "
                         "positions (their own keys included): L <= S")
    parts = decode_splits(S, num_splits)
    scale = 1 / math.sqrt(d) if scale is None else scale
    r = H // G
    packed = q.reshape(B, G, r * L, d)  # a group's r heads, each with its L queries
    row = torch.arange(L, device=q.device).repeat(r)  # (r*L,): each packed row's query index
    last_key = S - L + row  # (r*L,): the last key each row may see
    states = []
    for j0, j1 in parts:  # each part is one worker's
        z = packed @ k[:, :, j0:j1].transpose(-2, -1) * scale  # (B, G, r*L, j1 - j0)
        allowed = torch.arange(j0, j1, device=q.device)[None, :] <= last_key[:, None]
        z = z.masked_fill(~allowed, float("-inf"))
        m = z.amax(dim=-1, keepdim=True)  # (B, G, r*L, 1), -inf where no key is seen
        p = torch.exp(z - m.nan_to_num(neginf=0.0))  # exp(-inf) = 0 for the masked keys
        states.append((m, p.sum(dim=-1, keepdim=True), p @ v[:, :, j0:j1]))
    m_all = torch.stack([m for m, _, _ in states]).amax(dim=0)  # finite: key 0 is always seen
    ell = sum(torch.exp(m - m_all) * l for m, l, _ in states)
    acc = sum(torch.exp(m - m_all) * y for m, _, y in states)
    return (acc / ell).reshape(B, H, L, d)
