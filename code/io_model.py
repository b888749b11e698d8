"""Attention on a simulated two-level memory: how many numbers each algorithm moves.

A GPU computes in a small fast memory (on-chip SRAM) next to its arithmetic units and keeps its
tensors in a large slow one (HBM). ``TwoLevelMemory`` models that pair: a slow memory of named
tensors, of any size, and a fast memory of ``M`` elements. An algorithm ``read``s slices of slow
tensors into fast memory, ``hold``s the results it computes there, ``write``s results back and
``free``s what it no longer needs. The memory counts every element read and written, and raises
as soon as the elements held at once would exceed ``M``. This is the model of the IO analysis of
FlashAttention (Dao et al., 2022, Section 3.2 and Appendix C), where an algorithm's cost is its
number of slow-memory accesses.

Five algorithms run on it, each computing the real result (tests compare it with attention and
with autograd), so that the counts are those of a computation that works:

``standard_forward``
    the three passes of plain attention: Z = Q K^T written to slow memory tile by tile, the
    softmax of Z row by row, then Y = A V; the L x S matrices go to slow memory and back.
``flash_forward``
    the tiled forward pass of ``flash.py``: query blocks outside, key blocks inside (the same
    ``_key_tiles``, so the causal skip too), the online-softmax state kept in fast memory.
``flash_backward(order="queries")``
    the backward of ``flash.py``: query blocks outside; dQ of the block stays in fast memory,
    and the accumulators dK, dV of every key block go to slow memory and back at each visit.
``flash_backward(order="keys")``
    the loop order of the FlashAttention kernels: key blocks outside; dK, dV stay in fast
    memory, and dQ goes to slow memory and back.
``flash_decode_forward``
    Flash-Decoding (``flash.flash_decode``): the few newest queries of H heads against a cache
    of G key-value heads, the keys cut into parts, one worker per part and key-value head (or,
    unpacked, per query head), the parts' states merged by a second pass. Its tensors carry
    a head axis: Q (H, L, E), K (G, S, E), V (G, S, Ev).

A temporary that lives within one statement (a product added at once into an accumulator, a
tile of scores before it is masked) is not counted against ``M``: a kernel computes it element
by element in registers. Reads and writes are always counted. Shapes: L queries, S keys, E = d_k, Ev = d_v;
one head, 2-D tensors, except in the decoding pass, which has a head axis in front.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from flash import _causal_fill, _key_tiles, decode_splits

__all__ = ["TwoLevelMemory", "standard_forward", "flash_forward", "flash_backward",
           "flash_blocks", "standard_blocks", "standard_counts", "flash_forward_counts",
           "flash_backward_counts", "decode_blocks", "flash_decode_forward",
           "flash_decode_counts"]


class TwoLevelMemory:
    """A slow memory of named tensors and a fast memory of ``M`` elements, with counters.

    ``reads`` and ``writes`` count the elements moved from slow to fast memory and back;
    ``held`` is the number of elements in fast memory now and ``peak`` the largest it has been.
    """

    def __init__(self, M: int, **tensors: Tensor):
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ValueError(f"the fast memory needs a positive whole number of elements, got {M!r}")
        self.M = M
        self.slow = dict(tensors)
        self.reads = self.writes = self.held = self.peak = 0
        self._fast: dict[int, int] = {}  # address of a held storage -> its elements

    def __repr__(self) -> str:
        return (f"TwoLevelMemory(M={self.M}, reads={self.reads}, writes={self.writes}, "
                f"held={self.held}, peak={self.peak})")

    @property
    def accesses(self) -> int:
        """Elements read plus elements written."""
        return self.reads + self.writes

    def hold(self, t: Tensor) -> Tensor:
        """Count ``t`` as held in fast memory until ``free``; raise if M would be exceeded.
        A view of a held tensor is part of it: it may be written, and is not held again."""
        key = t.untyped_storage().data_ptr()
        if key in self._fast:
            raise ValueError("this tensor is already held in fast memory")
        n = t.untyped_storage().nbytes() // t.element_size()
        if self.held + n > self.M:
            raise MemoryError(f"fast memory of M={self.M} elements exceeded: {self.held} held, "
                              f"{n} more requested for a tensor of shape {tuple(t.shape)}")
        self._fast[key] = n
        self.held += n
        self.peak = max(self.peak, self.held)
        return t

    def free(self, *tensors: Tensor) -> None:
        """Release tensors held in fast memory (each with its views)."""
        for t in tensors:
            self.held -= self._fast.pop(t.untyped_storage().data_ptr())

    def read(self, name: str, *index) -> Tensor:
        """A copy of ``slow[name][index]`` in fast memory; its elements count as reads."""
        t = self.hold(self.slow[name][index].clone())
        self.reads += t.numel()
        return t

    def write(self, name: str, index, t: Tensor) -> None:
        """Copy ``t``, held in fast memory, into ``slow[name][index]``; count the writes."""
        if t.untyped_storage().data_ptr() not in self._fast:
            raise ValueError(f"write of a tensor that is not in fast memory, to {name!r}")
        self.slow[name][index] = t
        self.writes += t.numel()


# ----------------------------------------------------------------- choosing blocks


def flash_blocks(M: int, E: int, Ev: Optional[int] = None) -> tuple[int, int]:
    """(block_rows, block_cols) for ``flash_forward`` with a fast memory of M elements.

    As FlashAttention's Algorithm 1 (blocks of about M / 4d in the outer loop and at most d in
    the inner one), with the roles of queries and keys swapped for the book's loop order, and
    exact: the inner block takes ``min(E, M // (4 (E + Ev)))`` keys (at least one), the outer
    block the most query rows that fit beside it: each row holds its query (E), its
    unnormalised output (Ev), five numbers of state (m, ell, the new maximum, the shift, the
    rescaling factor) and its row of the tile.
    """
    Ev = E if Ev is None else Ev
    cols = max(1, min(E, M // (4 * (E + Ev))))
    rows = (M - cols * (E + Ev)) // (E + Ev + 5 + cols)
    if rows < 1:
        raise ValueError(f"a fast memory of M={M} elements cannot hold one query row, one key "
                         f"and their state for E={E}, Ev={Ev}: it needs at least "
                         f"{(E + Ev) + (E + Ev + 5 + 1)} elements")
    return rows, cols


def standard_blocks(M: int, E: int, Ev: Optional[int] = None) -> tuple[int, int]:
    """(block_rows, block_cols) for ``standard_forward``: the same inner block as
    ``flash_blocks``, and the most query rows that fit beside it in either product (a row of Q
    and of the tile for Z = Q K^T, a row of Y and of the tile for Y = A V): plain attention
    keeps no state, so its query blocks can be larger."""
    Ev = E if Ev is None else Ev
    cols = max(1, min(E, M // (4 * (E + Ev))))
    width = max(E, Ev)
    rows = (M - cols * width) // (width + cols)
    if rows < 1:
        raise ValueError(f"a fast memory of M={M} elements cannot hold one query row and one "
                         f"key for E={E}, Ev={Ev}")
    return rows, cols


def decode_blocks(M: int, rows: int, E: int, Ev: Optional[int] = None) -> int:
    """Keys per block for a worker of ``flash_decode_forward`` that holds ``rows`` query rows
    (``H // G * L`` packed, ``L`` unpacked) in a fast memory of M elements: as in
    ``flash_blocks``, each row holds its query (E), its unnormalised output (Ev), five numbers of
    state and its row of the tile, beside the block's keys and values (E + Ev each)."""
    Ev = E if Ev is None else Ev
    cols = (M - rows * (E + Ev + 5)) // (rows + E + Ev)
    if cols < 1:
        raise ValueError(f"a fast memory of M={M} elements cannot hold {rows} query rows, one "
                         f"key and their state for E={E}, Ev={Ev}: it needs at least "
                         f"{rows * (E + Ev + 6) + E + Ev} elements")
    return cols


# --------------------------------------------------------------------- algorithms


def _scale(E: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(E) if scale is None else float(scale)


def standard_forward(mem: TwoLevelMemory, block_rows: int, block_cols: int, *,
                     scale: Optional[float] = None) -> None:
    """Plain attention on ``mem`` (slow tensors Q (L, E), K (S, E), V (S, Ev)): writes Z, A and
    Y (L, Ev) to slow memory. Z = Q K^T is computed in tiles of ``block_rows x block_cols``, the
    softmax row by row, and
    Y = A V in tiles again. The softmax reads whole rows when a row of S scores fits in fast
    memory; otherwise it reads each row twice, in chunks: once for its maximum and sum (as the
    online softmax does), once to write A."""
    Q, K, V = mem.slow["Q"], mem.slow["K"], mem.slow["V"]
    L, E = Q.shape
    S, Ev = V.shape
    scale = _scale(E, scale)
    if mem.M < 3:
        raise MemoryError(f"the softmax needs at least 3 elements of fast memory, got M={mem.M}")
    mem.slow["Z"] = Q.new_empty(L, S)
    mem.slow["A"] = Q.new_empty(L, S)
    mem.slow["Y"] = Q.new_empty(L, Ev)
    for i0 in range(0, L, block_rows):  # 1. Z = Q K^T scale, tile by tile
        i1 = min(i0 + block_rows, L)
        q = mem.read("Q", slice(i0, i1))
        for j0 in range(0, S, block_cols):
            j1 = min(j0 + block_cols, S)
            k = mem.read("K", slice(j0, j1))
            z = mem.hold(q @ k.T * scale)
            mem.write("Z", (slice(i0, i1), slice(j0, j1)), z)
            mem.free(k, z)
        mem.free(q)
    if S <= mem.M:  # 2. A = softmax(Z): whole rows at a time when a row fits
        rows = mem.M // S
        for i0 in range(0, L, rows):
            i1 = min(i0 + rows, L)
            z = mem.read("Z", slice(i0, i1))
            a = torch.softmax(z, dim=-1)
            mem.free(z)  # a kernel computes the softmax in place: a takes z's place
            mem.write("A", slice(i0, i1), mem.hold(a))
            mem.free(a)
    else:  # a row does not fit: one pass for its maximum and sum, one to write A
        width = mem.M - 2  # a chunk of the row beside the row's m and ell
        for i in range(L):
            m = mem.hold(Q.new_full((), float("-inf")))
            ell = mem.hold(Q.new_zeros(()))
            for j0 in range(0, S, width):
                z = mem.read("Z", i, slice(j0, j0 + width))
                m_new = torch.maximum(m, z.max())
                ell.mul_(torch.exp(m - m_new)).add_(torch.exp(z - m_new).sum())
                m.copy_(m_new)
                mem.free(z)
            for j0 in range(0, S, width):
                z = mem.read("Z", i, slice(j0, j0 + width))
                z.sub_(m).exp_().div_(ell)
                mem.write("A", (i, slice(j0, j0 + width)), z)
                mem.free(z)
            mem.free(m, ell)
    for i0 in range(0, L, block_rows):  # 3. Y = A V, tile by tile
        i1 = min(i0 + block_rows, L)
        y = mem.hold(Q.new_zeros(i1 - i0, Ev))
        for j0 in range(0, S, block_cols):
            j1 = min(j0 + block_cols, S)
            a = mem.read("A", slice(i0, i1), slice(j0, j1))
            v = mem.read("V", slice(j0, j1))
            y += a @ v
            mem.free(a, v)
        mem.write("Y", slice(i0, i1), y)
        mem.free(y)


def flash_forward(mem: TwoLevelMemory, block_rows: int, block_cols: int, *,
                  is_causal: bool = False, scale: Optional[float] = None) -> None:
    """The tiled forward pass of ``flash.py`` on ``mem`` (slow Q, K, V as in
    ``standard_forward``): writes Y (L, Ev) and the row log-sum-exps ``lse`` (L,). Each block of
    ``block_rows`` queries is read once and keeps its state (m, ell, acc) in fast memory while
    the blocks of ``block_cols`` keys and values stream past; with ``is_causal`` the key blocks
    wholly above the diagonal are skipped, as in ``flash._key_tiles``."""
    Q, K, V = mem.slow["Q"], mem.slow["K"], mem.slow["V"]
    L, E = Q.shape
    S, Ev = V.shape
    scale = _scale(E, scale)
    mem.slow["Y"] = Q.new_zeros(L, Ev)
    mem.slow["lse"] = Q.new_full((L,), float("-inf"))
    for i0 in range(0, L, block_rows):
        i1 = min(i0 + block_rows, L)
        q = mem.read("Q", slice(i0, i1))
        m = mem.hold(Q.new_full((i1 - i0, 1), float("-inf")))
        ell = mem.hold(Q.new_zeros(i1 - i0, 1))
        acc = mem.hold(Q.new_zeros(i1 - i0, Ev))
        for j0, j1 in _key_tiles(i1, S, block_cols, is_causal):
            k = mem.read("K", slice(j0, j1))
            v = mem.read("V", slice(j0, j1))
            z = q @ k.T * scale
            z = mem.hold(_causal_fill(z, i0, j0) if is_causal else z)
            m_new = mem.hold(torch.maximum(m, z.amax(dim=-1, keepdim=True)))
            shift = mem.hold(torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)))
            rescale = mem.hold(torch.exp(m - shift))
            z.sub_(shift).exp_()  # the tile's p, in z's place
            ell.mul_(rescale).add_(z.sum(dim=-1, keepdim=True))
            acc.mul_(rescale).add_(z @ v)
            m.copy_(m_new)
            mem.free(k, v, z, m_new, shift, rescale)
        seen = ell > 0
        y = torch.where(seen, acc / torch.where(seen, ell, 1.0), 0.0)
        mem.free(acc)
        mem.hold(y)  # y takes acc's place
        lse = mem.hold((m + torch.log(ell)).squeeze(-1))
        mem.write("Y", slice(i0, i1), y)
        mem.write("lse", slice(i0, i1), lse)
        mem.free(q, m, ell, y, lse)


def flash_decode_forward(mem: TwoLevelMemory, block_cols: int, *, num_splits: int = 1,
                         packed: bool = True, scale: Optional[float] = None) -> None:
    """Flash-Decoding on ``mem``: slow Q (H, L, E), the L newest queries of H heads, and a
    cache K (G, S, E), V (G, S, Ev) of G key-value heads, G dividing H (query head h reads
    key-value head ``h // (H // G)``), causal with the bottom-right alignment as in
    ``flash.flash_decode``. Writes Y (H, L, Ev).

    The keys are cut into the ``num_splits`` parts of ``flash.decode_splits``. One worker takes
    one part and, with ``packed``, one key-value head and the ``H // G * L`` query rows of its
    group, so that the part's keys and values are read once for the group; without it, one
    query head and its L rows, so that the part is read once for every query head. A worker
    reads its query rows, streams its part's keys and values past them in blocks of
    ``block_cols``, keeping the online softmax's state in fast memory, and writes that state
    (the maximum, the sum and the unnormalised output of every row) to slow memory; a second
    pass reads the parts' states row block by row block and merges them into Y. With one part
    there is nothing to merge: the worker writes its rows of Y at once."""
    Q, K, V = mem.slow["Q"], mem.slow["K"], mem.slow["V"]
    H, L, E = Q.shape
    G, S, Ev = V.shape
    if K.shape != (G, S, E) or G < 1 or H % G or L > S:
        raise ValueError(f"Q (H, L, E), K (G, S, E), V (G, S, Ev) need G dividing H and L <= S; "
                         f"got Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}")
    scale = _scale(E, scale)
    parts = decode_splits(S, num_splits)
    group = H // G if packed else 1  # query heads per worker
    rows = group * L
    last_key = S - L + torch.arange(L).repeat(group)[:, None]  # (rows, 1): bottom right
    mem.slow["Y"] = Q.new_zeros(H, L, Ev)
    if num_splits > 1:
        for name, shape in (("m_part", (num_splits, H, L)), ("ell_part", (num_splits, H, L)),
                            ("acc_part", (num_splits, H, L, Ev))):
            mem.slow[name] = Q.new_zeros(shape)
    for h0 in range(0, H, group):  # one worker per head (group) and part
        heads, g = slice(h0, h0 + group), h0 // (H // G)
        for p, (j0, j1) in enumerate(parts):
            q = mem.read("Q", heads).view(rows, E)
            m = mem.hold(Q.new_full((rows, 1), float("-inf")))
            ell = mem.hold(Q.new_zeros(rows, 1))
            acc = mem.hold(Q.new_zeros(rows, Ev))
            for c0 in range(j0, j1, block_cols):
                c1 = min(c0 + block_cols, j1)
                k, v = mem.read("K", g, slice(c0, c1)), mem.read("V", g, slice(c0, c1))
                z = q @ k.T * scale
                seen = torch.arange(c0, c1)[None, :] <= last_key  # (rows, c1 - c0)
                z = mem.hold(z.masked_fill(~seen, float("-inf")))
                m_new = mem.hold(torch.maximum(m, z.amax(dim=-1, keepdim=True)))
                shift = mem.hold(torch.where(torch.isfinite(m_new), m_new,
                                             torch.zeros_like(m_new)))
                rescale = mem.hold(torch.exp(m - shift))
                z.sub_(shift).exp_()
                ell.mul_(rescale).add_(z.sum(dim=-1, keepdim=True))
                acc.mul_(rescale).add_(z @ v)
                m.copy_(m_new)
                mem.free(k, v, z, m_new, shift, rescale)
            if num_splits == 1:  # key 0 is in the part: every row has seen a key
                acc.div_(ell)
                mem.write("Y", heads, acc.view(group, L, Ev))
            else:
                mem.write("m_part", (p, heads), m.view(group, L))
                mem.write("ell_part", (p, heads), ell.view(group, L))
                mem.write("acc_part", (p, heads), acc.view(group, L, Ev))
            mem.free(q, m, ell, acc)
    if num_splits == 1:
        return
    for h0 in range(0, H, group):  # the merge, by log-sum-exp, as in flash.flash_decode
        heads = slice(h0, h0 + group)
        m_all = mem.hold(Q.new_full((group, L, 1), float("-inf")))
        ell = mem.hold(Q.new_zeros(group, L, 1))
        acc = mem.hold(Q.new_zeros(group, L, Ev))
        for p in range(num_splits):
            m_p = mem.read("m_part", p, heads).unsqueeze(-1)
            ell_p = mem.read("ell_part", p, heads).unsqueeze(-1)
            acc_p = mem.read("acc_part", p, heads)
            m_new = mem.hold(torch.maximum(m_all, m_p))  # finite: some part has seen a key
            to_new = mem.hold(torch.exp(m_all - m_new))
            ell.mul_(to_new)
            acc.mul_(to_new)
            to_new.copy_(torch.exp(m_p - m_new))  # the part's factor, in the same place
            ell.add_(to_new * ell_p)
            acc.add_(to_new * acc_p)
            m_all.copy_(m_new)
            mem.free(m_p, ell_p, acc_p, m_new, to_new)
        acc.div_(ell)
        mem.write("Y", heads, acc)
        mem.free(m_all, ell, acc)


def _query_tiles(j0: int, L: int, block_rows: int, is_causal: bool):
    """(i0, i1) of the query blocks that see a key of the block starting at key j0: all of
    them, or with ``is_causal`` those whose last query i1 - 1 is at or after j0."""
    for i0 in range(0, L, block_rows):
        i1 = min(i0 + block_rows, L)
        if not is_causal or i1 - 1 >= j0:
            yield i0, i1


def _tile_grads(mem, q, k, v, d_y, lse, D, i0, j0, scale, is_causal):
    """The tile's weights a (recomputed from lse) and dZ, both (r, c) and held: the scores
    become the weights in place, and dA = dY V^T becomes dZ = a (dA - D) in place."""
    a = q @ k.T * scale
    if is_causal:
        a = _causal_fill(a, i0, j0)
    mem.hold(a).sub_(lse[:, None]).exp_()
    dz = mem.hold(d_y @ v.T)
    dz.sub_(D[:, None]).mul_(a)
    return a, dz


def flash_backward(mem: TwoLevelMemory, block_rows: int, block_cols: int, *,
                   order: str = "queries", is_causal: bool = False,
                   scale: Optional[float] = None) -> None:
    """The tiled backward pass on ``mem``: from slow Q, K, V, Y, lse (as ``flash_forward``
    leaves them) and dY (L, Ev), writes dQ, dK, dV.

    A first pass computes D_i = dY_i . Y_i for every row (read dY and Y, write D). Then
    ``order="queries"`` (``flash._backward``'s loops) keeps a query block's Q, dY, lse, D and
    dQ in fast memory while the key blocks stream past, each bringing its K, V and its partial
    dK, dV, which go back to slow memory after the tile; ``order="keys"`` (the FlashAttention
    kernels' loops) keeps a key block's K, V, dK, dV while the query blocks stream past, each
    bringing Q, dY, lse, D and its partial dQ, which goes back. An accumulator's first visit
    starts from zeros in fast memory instead of reading them.
    """
    if order not in ("queries", "keys"):
        raise ValueError(f"order must be 'queries' or 'keys', got {order!r}")
    Q, K, V = mem.slow["Q"], mem.slow["K"], mem.slow["V"]
    L, E = Q.shape
    S, Ev = V.shape
    scale = _scale(E, scale)
    mem.slow["D"] = Q.new_zeros(L)
    for name, like in (("dQ", Q), ("dK", K), ("dV", V)):
        mem.slow[name] = torch.zeros_like(like)
    for i0 in range(0, L, block_rows):  # D_i = dY_i . Y_i
        i1 = min(i0 + block_rows, L)
        d_y, y = mem.read("dY", slice(i0, i1)), mem.read("Y", slice(i0, i1))
        D = mem.hold((d_y * y).sum(dim=-1))
        mem.write("D", slice(i0, i1), D)
        mem.free(d_y, y, D)

    def read_or_zero(name, index, shape, started):
        return mem.read(name, index) if started else mem.hold(Q.new_zeros(shape))

    if order == "queries":
        started = set()  # key blocks whose dK, dV are in slow memory already
        for i0 in range(0, L, block_rows):
            i1 = min(i0 + block_rows, L)
            rows = slice(i0, i1)
            q, d_y = mem.read("Q", rows), mem.read("dY", rows)
            lse, D = mem.read("lse", rows), mem.read("D", rows)
            dq = mem.hold(Q.new_zeros(i1 - i0, E))
            for j0, j1 in _key_tiles(i1, S, block_cols, is_causal):
                cols = slice(j0, j1)
                k, v = mem.read("K", cols), mem.read("V", cols)
                dk = read_or_zero("dK", cols, (j1 - j0, E), j0 in started)
                dv = read_or_zero("dV", cols, (j1 - j0, Ev), j0 in started)
                started.add(j0)
                a, dz = _tile_grads(mem, q, k, v, d_y, lse, D, i0, j0, scale, is_causal)
                dv += a.T @ d_y
                dq += dz @ k * scale
                dk += dz.T @ q * scale
                mem.write("dK", cols, dk)
                mem.write("dV", cols, dv)
                mem.free(k, v, dk, dv, a, dz)
            mem.write("dQ", rows, dq)
            mem.free(q, d_y, lse, D, dq)
    else:
        started = set()  # query blocks whose dQ is in slow memory already
        for j0 in range(0, S, block_cols):
            j1 = min(j0 + block_cols, S)
            cols = slice(j0, j1)
            k, v = mem.read("K", cols), mem.read("V", cols)
            dk = mem.hold(K.new_zeros(j1 - j0, E))
            dv = mem.hold(V.new_zeros(j1 - j0, Ev))
            for i0, i1 in _query_tiles(j0, L, block_rows, is_causal):
                rows = slice(i0, i1)
                q, d_y = mem.read("Q", rows), mem.read("dY", rows)
                lse, D = mem.read("lse", rows), mem.read("D", rows)
                dq = read_or_zero("dQ", rows, (i1 - i0, E), i0 in started)
                started.add(i0)
                a, dz = _tile_grads(mem, q, k, v, d_y, lse, D, i0, j0, scale, is_causal)
                dv += a.T @ d_y
                dq += dz @ k * scale
                dk += dz.T @ q * scale
                mem.write("dQ", rows, dq)
                mem.free(q, d_y, lse, D, dq, a, dz)
            mem.write("dK", cols, dk)
            mem.write("dV", cols, dv)
            mem.free(k, v, dk, dv)


# ------------------------------------------------------------------ the counts, in closed form


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def standard_counts(L: int, S: int, E: int, Ev: int, block_rows: int,
                    M: Optional[int] = None) -> dict:
    """Elements ``standard_forward`` reads and writes: Q once and K once per block of query
    rows, then Z read (twice if a row of S scores does not fit in ``M``) and A written, then A
    read and V once per block of query rows."""
    n = _blocks(L, block_rows)
    softmax_reads = L * S * (2 if M is not None and S > M else 1)
    reads = L * E + n * S * E + softmax_reads + L * S + n * S * Ev
    writes = L * S + L * S + L * Ev
    return {"reads": reads, "writes": writes, "accesses": reads + writes}


def flash_forward_counts(L: int, S: int, E: int, Ev: int, block_rows: int) -> dict:
    """Elements ``flash_forward`` reads and writes without a mask: Q once, K and V once per
    block of query rows; Y and one log-sum-exp per row written."""
    n = _blocks(L, block_rows)
    reads = L * E + n * S * (E + Ev)
    writes = L * Ev + L
    return {"reads": reads, "writes": writes, "accesses": reads + writes}


def flash_backward_counts(L: int, S: int, E: int, Ev: int, block_rows: int, block_cols: int,
                          order: str = "queries") -> dict:
    """Elements ``flash_backward`` reads and writes without a mask, in either loop order."""
    n_r, n_c = _blocks(L, block_rows), _blocks(S, block_cols)
    reads, writes = 2 * L * Ev, L  # D = rowsum(dY * Y)
    if order == "queries":
        reads += L * (E + Ev + 2) + n_r * S * (E + Ev) + (n_r - 1) * S * (E + Ev)
        writes += L * E + n_r * S * (E + Ev)
    elif order == "keys":
        reads += S * (E + Ev) + n_c * L * (E + Ev + 2) + (n_c - 1) * L * E
        writes += S * (E + Ev) + n_c * L * E
    else:
        raise ValueError(f"order must be 'queries' or 'keys', got {order!r}")
    return {"reads": reads, "writes": writes, "accesses": reads + writes}


def flash_decode_counts(H: int, G: int, L: int, S: int, E: int, Ev: int, *,
                        num_splits: int = 1, packed: bool = True) -> dict:
    """Elements ``flash_decode_forward`` reads and writes. Every worker reads its query rows
    (so all H L of them once per part) and each key and value of its part once: with
    ``packed`` there are G workers per part, so each of the G cached heads is read once, and
    unpacked there are H, so each is read H / G times. With more than one part, each part's
    state (Ev + 2 numbers per row) is written and read back by the merge; Y is written once."""
    workers = G if packed else H
    state = num_splits * H * L * (Ev + 2) if num_splits > 1 else 0
    reads = num_splits * H * L * E + workers * S * (E + Ev) + state
    writes = H * L * Ev + state
    return {"reads": reads, "writes": writes, "accesses": reads + writes}
