"""Position information for attention: sinusoidal, rotary (RoPE) and ALiBi.

Attention without position is permutation equivariant: shuffle the tokens and
the outputs are shuffled the same way (chapter "Position"). The functions here
put order back in the three ways that the book compares.

- ``sinusoidal_encoding``: the fixed table of Vaswani et al. (2017), added to
  the token vectors.
- ``rotary_embedding``: rotary position embedding (RoPE, Su et al. 2024),
  applied to queries and keys; the half-split layout of GPT-NeoX and Hugging
  Face. ``interleaved_to_half_split`` gives the feature permutation that
  converts weights written for the interleaved layout (RoFormer, Meta's
  original Llama code) into it. ``rotary_frequencies(..., scaling=)`` gives
  the stretched frequencies of position interpolation, "NTK-aware" scaling
  and YaRN, and ``yarn_attention_scale`` YaRN's factor on queries and keys.
- ``alibi_slopes`` and ``alibi_bias``: attention with linear biases (ALiBi,
  Press et al. 2022), a float ``attn_mask`` added to the scores.

Shape legend as in ``attention.py``: B batch, H heads, L queries, S keys,
d the width that is rotated (a head's width).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "sinusoidal_encoding",
    "rotary_frequencies",
    "rotary_embedding",
    "yarn_attention_scale",
    "interleaved_to_half_split",
    "alibi_slopes",
    "alibi_bias",
]


def _positive_int(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return n


def _even_width(name: str, d) -> int:
    _positive_int(name, d)
    if d % 2:
        raise ValueError(
            f"{name} must be even (features are rotated in pairs), got {d}")
    return d


# ------------------------------------------------------------------ sinusoidal


def sinusoidal_encoding(
    num_positions: int, d_model: int, *, base: float = 10000.0,
    dtype: torch.dtype = torch.float32, device=None,
) -> Tensor:
    """The ``(num_positions, d_model)`` table of sinusoidal encodings.

    Row p (0-based position) holds, for i = 0 .. d_model/2 - 1,
    ``PE[p, 2i] = sin(p / base**(2i/d_model))`` and
    ``PE[p, 2i+1] = cos(p / base**(2i/d_model))``.
    Computed in float64 and returned in ``dtype``.
    """
    _positive_int("num_positions", num_positions)
    _even_width("d_model", d_model)
    p = torch.arange(num_positions, dtype=torch.float64, device=device)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
    angles = p[:, None] / base ** (two_i / d_model)  # (P, d_model/2)
    table = torch.empty(num_positions, d_model, dtype=torch.float64,
                        device=device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.to(dtype)  # (num_positions, d_model)


# ---------------------------------------------------------------------- rotary


def _scale_factor(s) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) \
            or not math.isfinite(s) or s < 1:
        raise ValueError(
            f"the scale factor s of a RoPE scaling must be a finite number "
            f">= 1 (test length over training length), got {s!r}")
    return float(s)


def rotary_frequencies(
    d: int, *, base: float = 10000.0, scaling=None,
    dtype: torch.dtype = torch.float64, device=None,
) -> Tensor:
    """The ``(d/2,)`` frequencies ``base**(-2i/d)``, i = 0 .. d/2 - 1.

    Pair i of a rotated vector turns by the angle ``p * freq[i]`` at
    position p: the first pair fastest (one radian per position), the last
    slowest.

    ``scaling`` stretches the frequencies for sequences ``s`` times longer
    than those of training (``s >= 1``; ``s = 1`` changes nothing):

    - ``None``: the plain frequencies above.
    - ``("linear", s)``: position interpolation (Chen et al., 2023): every
      frequency divided by s, the same as positions divided by s.
    - ``("ntk", s)``: "NTK-aware" scaling (as written in Peng et al., 2024):
      the base multiplied by ``s**(d/(d-2))``, so that the first pair keeps
      its frequency and the last one is divided by s; pair i is divided by
      ``s**(2i/(d-2))``.
    - ``("yarn", s, train_length)`` or ``("yarn", s, train_length, alpha,
      beta)``: YaRN's "NTK-by-parts" frequencies (Peng et al., 2024), with
      ``alpha=1, beta=32`` by default (the paper's values for Llama). With
      the wavelength ``lam = 2 pi / freq`` and the number of turns over the
      training length ``r = train_length / lam``, the ramp
      ``k = clamp((r - alpha) / (beta - alpha), 0, 1)`` gives
      ``(1 - k) * freq / s + k * freq``: pairs that turn fewer than alpha
      times are interpolated, pairs that turn more than beta times are left
      alone. YaRN's attention temperature is ``yarn_attention_scale``.
    - ``("llama3", s, train_length, low_freq_factor, high_freq_factor)``:
      Llama 3.1's bands (``transformers``' rope type ``"llama3"``; the
      released model: s = 8, 8192, 1, 4). Pairs whose wavelength exceeds
      ``train_length / low_freq_factor`` are divided by s, pairs whose
      wavelength is below ``train_length / high_freq_factor`` are left alone,
      and between them ``(1 - k) * freq / s + k * freq`` with
      ``k = (train_length / wavelength - low) / (high - low)``: YaRN's ramp
      with ``alpha = low_freq_factor``, ``beta = high_freq_factor``.
    - ``("dynamic", s, train_length, length)``: dynamic NTK scaling
      (``transformers``' rope type ``"dynamic"``), for a sequence of
      ``length`` positions so far: the NTK-aware base with the factor
      ``s * max(length, train_length) / train_length - (s - 1)``, which is 1
      (nothing changes) up to the training length and grows with the length.

    Bad input (unknown kind, ``s < 1``, wrong number of entries,
    ``train_length < 1``, ``alpha >= beta``, ``low_freq_factor >=
    high_freq_factor``, ``length < 1``) raises ``ValueError``.
    """
    _even_width("d", d)
    two_i = torch.arange(0, d, 2, dtype=torch.float64, device=device)
    freq = base ** (-two_i / d)  # (d/2,)
    if scaling is None:
        return freq.to(dtype)
    kinds = {"linear": 2, "ntk": 2, "yarn": (3, 5), "llama3": 5, "dynamic": 4}
    if (not isinstance(scaling, (tuple, list)) or not scaling
            or scaling[0] not in kinds):
        raise ValueError(
            "scaling must be None, ('linear', s), ('ntk', s), "
            "('yarn', s, train_length[, alpha, beta]), ('llama3', s, train_length, "
            "low_freq_factor, high_freq_factor) or ('dynamic', s, train_length, length); "
            f"got {scaling!r}")
    kind, sizes = scaling[0], kinds[scaling[0]]
    if len(scaling) not in (sizes if isinstance(sizes, tuple) else (sizes,)):
        raise ValueError(
            f"scaling {kind!r} takes {sizes} entries in all, got {scaling!r}")
    s = _scale_factor(scaling[1])
    if kind == "linear":
        return (freq / s).to(dtype)
    if kind == "ntk":
        if d == 2:  # one pair, the fastest: nothing to change
            return freq.to(dtype)
        return ((base * s ** (d / (d - 2))) ** (-two_i / d)).to(dtype)
    train_length = _positive_int("train_length", scaling[2])
    if kind == "dynamic":
        length = _positive_int("length", scaling[3])
        factor = s * max(length, train_length) / train_length - (s - 1)  # 1 up to training
        return rotary_frequencies(d, base=base, scaling=("ntk", factor), dtype=dtype,
                                  device=device)
    if kind == "llama3":
        alpha, beta = scaling[3:]
        if not 0 <= alpha < beta:
            raise ValueError(f"llama3 needs 0 <= low_freq_factor < high_freq_factor, got "
                             f"{alpha!r} and {beta!r}")
    else:
        alpha, beta = (1.0, 32.0) if len(scaling) == 3 else scaling[3:]
        if not 0 <= alpha < beta:
            raise ValueError(
                f"YaRN needs 0 <= alpha < beta, got alpha={alpha!r}, beta={beta!r}")
    turns = train_length * freq / (2 * math.pi)  # r = L / wavelength, (d/2,)
    keep = ((turns - alpha) / (beta - alpha)).clamp(0, 1)  # (d/2,)
    return ((1 - keep) * freq / s + keep * freq).to(dtype)


def yarn_attention_scale(s: float) -> float:
    """YaRN's factor ``0.1 ln(s) + 1`` (Peng et al., 2024).

    The paper divides the scores by a temperature t with
    ``sqrt(1/t) = 0.1 ln(s) + 1``; its code multiplies both the queries and
    the keys by this factor, so the scores grow by its square. ``s >= 1``.
    """
    return 0.1 * math.log(_scale_factor(s)) + 1.0


def rotary_embedding(
    x: Tensor, positions: Optional[Tensor] = None, *, base: float = 10000.0,
    scaling=None, rotary_dim: Optional[int] = None,
) -> Tensor:
    """Rotate the queries or keys ``x`` ``(..., L, d)`` by their positions.

    Half-split layout (GPT-NeoX, Hugging Face's ``rotate_half``): feature i
    is paired with feature i + d/2. With ``freq[i] = base**(-2i/d)`` and the
    angle ``a = p * freq[i]`` at position p, the pair
    ``(x_i, x_{i+d/2})`` becomes
    ``(x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a)``.

    ``positions``: integer tensor broadcastable to ``x.shape[:-1]``, e.g.
    ``(L,)`` shared by the batch, or ``(B, 1, L)`` for one row of position
    ids per sequence of an ``(B, H, L, d)`` input (left padding). Default
    ``arange(L)``. Returns a tensor of x's shape and dtype; the angles are
    computed in float64 and the rotation in float32 or wider.

    ``scaling``: the frequencies of ``rotary_frequencies(..., scaling=)``
    (position interpolation, NTK-aware, YaRN); default the plain ones.
    ``rotary_dim``: rotate only the first ``rotary_dim`` features (even,
    at most d), half-split among themselves (feature i with
    i + rotary_dim/2) with the frequencies of width ``rotary_dim``, and pass
    the others through unchanged, as GPT-NeoX's ``rotary_pct`` does.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(
            "rotary_embedding expects a floating-point tensor (..., L, d), "
            f"got {type(x).__name__ if not isinstance(x, Tensor) else x.dtype}")
    if x.dim() < 2:
        raise ValueError(
            f"rotary_embedding expects x of shape (..., L, d), got {tuple(x.shape)}")
    L, d = x.shape[-2], x.shape[-1]
    if rotary_dim is None:
        if d % 2:
            raise ValueError(
                f"rotary_embedding rotates pairs of features: the last dim d of x "
                f"must be even, got x of shape {tuple(x.shape)}")
        r = d
    else:
        if (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)
                or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d):
            raise ValueError(
                f"rotary_dim must be an even integer from 2 to the last dim d "
                f"of x, got rotary_dim={rotary_dim!r} for x of shape "
                f"{tuple(x.shape)}")
        r = rotary_dim
    if positions is None:
        positions = torch.arange(L, device=x.device)
    positions = torch.as_tensor(positions, device=x.device)
    if positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(
            f"positions must be an integer tensor, got dtype {positions.dtype}")
    try:
        ok = (torch.broadcast_shapes(positions.shape, x.shape[:-1])
              == x.shape[:-1])
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} do not broadcast to "
            f"x.shape[:-1] = {tuple(x.shape[:-1])} of x {tuple(x.shape)}; use "
            "(L,) for one row of positions, (B, 1, L) for one per sequence")
    freq = rotary_frequencies(r, base=base, scaling=scaling,
                              device=x.device)  # (r/2,)
    angles = positions.to(torch.float64)[..., None] * freq  # (..., L, r/2)
    work = torch.promote_types(x.dtype, torch.float32)
    cos = torch.cos(angles).to(work)
    sin = torch.sin(angles).to(work)
    wide = x.to(work)
    x1, x2 = wide[..., : r // 2], wide[..., r // 2:r]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, wide[..., r:]],
                    dim=-1)
    return out.to(x.dtype)  # (..., L, d)


def interleaved_to_half_split(
    head_dim: int, num_heads: int = 1, *, rotary_dim: Optional[int] = None,
) -> Tensor:
    """Index ``(num_heads * head_dim,)``: the output feature of an
    interleaved-layout projection that goes to each half-split position.

    The interleaved layout (RoFormer, Meta's Llama code) rotates the pairs
    ``(2i, 2i+1)`` of each head, the half-split layout the pairs
    ``(i, i + head_dim/2)``. Within every head the index is
    ``[0, 2, 4, ..., head_dim-2, 1, 3, ..., head_dim-1]``: a model whose
    ``W_Q`` and ``W_K`` (``d_model x d``, row vectors) have their columns
    taken in this order, ``W[:, index]`` (``weight[index]`` for an
    ``nn.Linear``, and ``bias[index]`` for its bias), computes the same
    scores with half-split RoPE as the original with interleaved RoPE.

    ``rotary_dim``: when only the first ``rotary_dim`` features of each head
    are rotated (GPT-J's ``rotary_dim``), only they are reordered,
    ``[0, 2, ..., rotary_dim-2, 1, 3, ..., rotary_dim-1]``, and the features
    from ``rotary_dim`` on keep their places; it must be even and at most
    ``head_dim``.
    """
    _positive_int("head_dim", head_dim)
    _positive_int("num_heads", num_heads)
    r = head_dim if rotary_dim is None else rotary_dim
    if (isinstance(r, bool) or not isinstance(r, int) or r < 2 or r % 2
            or r > head_dim):
        raise ValueError(
            f"the rotated width must be an even integer from 2 to head_dim="
            f"{head_dim}, got {r!r}")
    one = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2),
                     torch.arange(r, head_dim)])  # (head_dim,)
    offsets = torch.arange(num_heads)[:, None] * head_dim  # (H, 1)
    return (offsets + one).reshape(-1)  # (num_heads * head_dim,)


# ----------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> Tensor:
    """The ``(num_heads,)`` float64 slopes of ALiBi (Press et al., 2022).

    For n heads, n a power of two: the geometric sequence that starts at
    ``2**(-8/n)`` with that ratio, ``2**(-8/n), 2**(-16/n), ..., 2**(-8)``.
    Otherwise, with ``c`` the largest power of two below n: the c slopes
    for c heads, followed by the first ``n - c`` of the odd-numbered
    (1st, 3rd, 5th, ...) slopes for ``2c`` heads.
    """
    _positive_int("num_heads", num_heads)

    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    c = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(c)
    if c < num_heads:
        slopes += power_of_two(2 * c)[0::2][: num_heads - c]
    return torch.tensor(slopes, dtype=torch.float64)  # (H,)


def alibi_bias(
    num_heads: int, L: int, S: Optional[int] = None, *, causal: bool = True,
    dtype: torch.dtype = torch.float32, device=None,
) -> Tensor:
    """The ``(num_heads, L, S)`` ALiBi bias, added to the scores.

    Query i sits at position i and key j at position j (0-based, top-left,
    as ``attention.causal_mask``). On and below the diagonal (j <= i) the
    bias of head h is ``-slope[h] * (i - j)``: 0 for the query's own
    position, more negative the further back the key. Above the diagonal
    (j > i), ``causal=True`` (the paper's decoder setting) gives ``-inf``,
    so the bias is also the causal mask; ``causal=False`` gives
    ``-slope[h] * (j - i)``, the symmetric distance some encoders use.
    Pass it as a float ``attn_mask``; it broadcasts over the batch.
    """
    S = L if S is None else S
    _positive_int("L", L)
    _positive_int("S", S)
    slopes = alibi_slopes(num_heads).to(device)  # (H,)
    i = torch.arange(L, device=device)[:, None]  # (L, 1)
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = (i - j).to(torch.float64)  # (L, S)
    bias = -slopes[:, None, None] * distance.abs()  # (H, L, S)
    if causal:
        bias = bias.masked_fill(j > i, float("-inf"))
    return bias.to(dtype)  # (H, L, S)
