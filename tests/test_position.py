"""Tests of code/position.py against the formulas written as loops."""

import math

import pytest
import torch

from attention import scaled_dot_product_attention
from position import (alibi_bias, alibi_slopes, interleaved_to_half_split,
                      rotary_embedding, rotary_frequencies, sinusoidal_encoding)

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def sinusoidal_loops(P, d):
    pe = torch.zeros(P, d, dtype=torch.float64)
    for p in range(P):
        for i in range(d // 2):
            a = p / 10000 ** (2 * i / d)
            pe[p, 2 * i], pe[p, 2 * i + 1] = math.sin(a), math.cos(a)
    return pe


def rotate_half(x):
    """Hugging Face's helper: (x1, x2) -> (-x2, x1) on the two halves."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_hf(x, positions, base=10000.0):
    """Hugging Face style: cos/sin of (positions x inv_freq), duplicated."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    x64 = x.double()
    return x64 * emb.cos() + rotate_half(x64) * emb.sin()


def rope_loops(x, positions, base=10000.0):
    """(L, d) rotated pair by pair, half-split layout."""
    L, d = x.shape
    out = torch.zeros(L, d, dtype=torch.float64)
    for t in range(L):
        p = int(positions[t])
        for i in range(d // 2):
            a = p * base ** (-2 * i / d)
            u, v = float(x[t, i]), float(x[t, i + d // 2])
            out[t, i] = u * math.cos(a) - v * math.sin(a)
            out[t, i + d // 2] = v * math.cos(a) + u * math.sin(a)
    return out


def rope_interleaved_loops(x, base=10000.0):
    L, d = x.shape
    out = torch.zeros(L, d, dtype=torch.float64)
    for p in range(L):
        for i in range(d // 2):
            a = p * base ** (-2 * i / d)
            u, v = float(x[p, 2 * i]), float(x[p, 2 * i + 1])
            out[p, 2 * i] = u * math.cos(a) - v * math.sin(a)
            out[p, 2 * i + 1] = v * math.cos(a) + u * math.sin(a)
    return out


def slopes_paper(n):
    """Press et al.'s reference get_slopes."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + slopes_paper(2 * c)[0::2][: n - c]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sinusoidal_matches_loops(dtype):
    pe = sinusoidal_encoding(50, 16, dtype=dtype)
    assert pe.shape == (50, 16) and pe.dtype == dtype
    torch.testing.assert_close(pe.double(), sinusoidal_loops(50, 16),
                               atol=TOL[dtype], rtol=0)


def test_sinusoidal_offset_is_a_rotation():
    pe = sinusoidal_encoding(40, 8, dtype=torch.float64)
    w = rotary_frequencies(8)
    for k in (1, 5):
        R = torch.zeros(8, 8, dtype=torch.float64)
        for i in range(4):
            c, s = math.cos(k * w[i]), math.sin(k * w[i])
            R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        torch.testing.assert_close(pe[k:], pe[:-k] @ R, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_matches_loops_and_rotate_half(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, generator=g, dtype=dtype)
    got = rotary_embedding(x)
    assert got.shape == x.shape and got.dtype == dtype
    pos = torch.arange(7)
    torch.testing.assert_close(got.double(), rope_hf(x, pos), atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(got[1, 2].double(), rope_loops(x[1, 2], pos),
                               atol=TOL[dtype], rtol=0)


def test_rotary_relative_offset():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 16, generator=g, dtype=torch.float64)
    for offset in (0, 3, -4):
        scores = []
        for i in range(5, 40, 7):
            qi = rotary_embedding(q, torch.tensor([i]))
            kj = rotary_embedding(k, torch.tensor([i - offset]))
            scores.append(float(qi @ kj.T))
        ref = float(rotary_embedding(q, torch.tensor([offset])) @ k.T)
        assert max(abs(s - ref) for s in scores) < 1e-12


def test_rotary_positions_broadcast():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])  # (B, L)
    got = rotary_embedding(x, ids[:, None, :])  # (B, 1, L)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(got[b, h], rope_loops(x[b, h], ids[b]),
                                       atol=1e-12, rtol=0)
    torch.testing.assert_close(rotary_embedding(x, torch.arange(5)), rotary_embedding(x))


def test_rotary_keeps_half_precision_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert rotary_embedding(x).dtype == torch.bfloat16


def test_layouts_convert_by_permutation():
    g = torch.Generator().manual_seed(3)
    d = 8
    x = torch.randn(6, d, generator=g, dtype=torch.float64)
    perm = interleaved_to_half_split(d)
    inter = rope_interleaved_loops(x)
    torch.testing.assert_close(rotary_embedding(x[:, perm]), inter[:, perm],
                               atol=1e-12, rtol=0)
    assert not torch.allclose(rotary_embedding(x), inter)
    two = interleaved_to_half_split(4, num_heads=2)
    assert two.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20])
def test_alibi_slopes_match_the_paper(n):
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(slopes_paper(n), dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_alibi_slopes_eight_heads():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]


def test_alibi_bias_loops_and_attention():
    H, L, S = 3, 4, 6
    bias = alibi_bias(H, L, S, dtype=torch.float64)
    sym = alibi_bias(H, L, S, causal=False, dtype=torch.float64)
    slopes = alibi_slopes(H)
    for h in range(H):
        for i in range(L):
            for j in range(S):
                want = -float(slopes[h]) * abs(i - j)
                assert sym[h, i, j] == want
                assert bias[h, i, j] == (want if j <= i else float("-inf"))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, H, L, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, H, S, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, H, S, 8, generator=g, dtype=torch.float64)
    ours, _ = scaled_dot_product_attention(q, k, v, attn_mask=bias)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours, theirs)


def test_errors_name_the_shapes():
    with pytest.raises(ValueError, match="even"):
        sinusoidal_encoding(4, 5)
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        rotary_embedding(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        rotary_embedding(torch.randn(2, 4, 6), torch.arange(3))
    with pytest.raises(TypeError, match="integer"):
        rotary_embedding(torch.randn(4, 6), torch.arange(4.0))
    with pytest.raises(ValueError, match="positive"):
        alibi_bias(0, 4)
    with pytest.raises(ValueError, match="positive"):
        alibi_slopes(2.5)
