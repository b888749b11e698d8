"""Tests of code/position.py against the formulas written as loops."""

import math

import pytest
import torch

import numerics
from attention import scaled_dot_product_attention
from position import (alibi_bias, alibi_slopes, interleaved_to_half_split,
                      rotary_embedding, rotary_frequencies, sinusoidal_encoding)



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
    numerics.assert_close(pe.double(), sinusoidal_loops(50, 16), dtype=dtype)


def test_sinusoidal_offset_is_a_rotation():
    pe = sinusoidal_encoding(40, 8, dtype=torch.float64)
    w = rotary_frequencies(8)
    for k in (1, 5):
        R = torch.zeros(8, 8, dtype=torch.float64)
        for i in range(4):
            c, s = math.cos(k * w[i]), math.sin(k * w[i])
            R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        numerics.assert_close(pe[k:], pe[:-k] @ R)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_matches_loops_and_rotate_half(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, generator=g, dtype=dtype)
    got = rotary_embedding(x)
    assert got.shape == x.shape and got.dtype == dtype
    pos = torch.arange(7)
    numerics.assert_close(got.double(), rope_hf(x, pos), dtype=dtype)
    numerics.assert_close(got[1, 2].double(), rope_loops(x[1, 2], pos), dtype=dtype)


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
            numerics.assert_close(got[b, h], rope_loops(x[b, h], ids[b]))
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
    numerics.assert_close(rotary_embedding(x[:, perm]), inter[:, perm])
    assert not torch.allclose(rotary_embedding(x), inter)
    two = interleaved_to_half_split(4, num_heads=2)
    assert two.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20])
def test_alibi_slopes_match_the_paper(n):
    numerics.assert_close(alibi_slopes(n), torch.tensor(slopes_paper(n), dtype=torch.float64))


def test_alibi_slopes_eight_heads():
    # Python's 2.0 ** -k on both sides (the exponent -8 * k / 8 is exact): the same computation
    numerics.assert_same(alibi_slopes(8).tolist(), [2.0 ** -k for k in range(1, 9)])


def test_alibi_bias_loops_and_attention():
    H, L, S = 3, 4, 6
    bias = alibi_bias(H, L, S, dtype=torch.float64)
    sym = alibi_bias(H, L, S, causal=False, dtype=torch.float64)
    slopes = alibi_slopes(H)
    for h in range(H):
        for i in range(L):
            for j in range(S):
                want = -float(slopes[h]) * abs(i - j)
                # one multiplication of the same two numbers on both sides: the same result
                numerics.assert_same(float(sym[h, i, j]), want)
                numerics.assert_same(float(bias[h, i, j]), want if j <= i else float("-inf"))
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


# --------------------------------------------------- scaled frequencies (PI, NTK, YaRN)


def yarn_loops(d, s, train_length, alpha=1.0, beta=32.0, base=10000.0):
    """YaRN's frequencies pair by pair, as the paper writes them (h(theta_d))."""
    out = []
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        r = train_length / (2 * math.pi / theta)  # turns over the training length
        ramp = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        out.append((1 - ramp) * theta / s + ramp * theta)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("d", [2, 8, 64, 128])
def test_scalings_with_s_one_are_the_plain_frequencies(d):
    plain = rotary_frequencies(d)
    for scaling in (("linear", 1), ("ntk", 1.0), ("yarn", 1, 4096), ("yarn", 1, 16, 1, 2)):
        numerics.assert_close(rotary_frequencies(d, scaling=scaling), plain)


def test_linear_scaling_divides_every_frequency():
    for s in (2, 4.5):
        numerics.assert_close(rotary_frequencies(64, scaling=("linear", s)),
                              rotary_frequencies(64) / s)
    # The same as positions divided by s: position s*p with PI is position p without it.
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    numerics.assert_close(rotary_embedding(x, torch.arange(5) * 4, scaling=("linear", 4)),
                          rotary_embedding(x))


@pytest.mark.parametrize("d, base", [(8, 100.0), (64, 10000.0), (128, 500000.0)])
def test_ntk_keeps_the_fastest_pair_and_interpolates_the_slowest(d, base):
    s = 4.0
    plain = rotary_frequencies(d, base=base)
    ntk = rotary_frequencies(d, base=base, scaling=("ntk", s))
    assert float(ntk[0]) == float(plain[0]) == 1.0
    numerics.assert_close(ntk[-1], plain[-1] / s)
    c = torch.arange(d // 2, dtype=torch.float64)  # 0-based pair index
    numerics.assert_close(ntk, plain / s ** (2 * c / (d - 2)))
    assert bool((ntk <= plain).all()) and bool((ntk >= plain / s).all())


@pytest.mark.parametrize("d, s, L, alpha, beta", [
    (128, 4.0, 4096, 1.0, 32.0), (64, 8.0, 2048, 1.0, 32.0), (8, 2.0, 16, 1.0, 2.0)])
def test_yarn_matches_the_paper_pair_by_pair(d, s, L, alpha, beta):
    got = rotary_frequencies(d, scaling=("yarn", s, L, alpha, beta))
    numerics.assert_close(got, yarn_loops(d, s, L, alpha, beta))
    plain = rotary_frequencies(d)
    turns = L * plain / (2 * math.pi)
    fast, slow = turns > beta, turns < alpha
    # left alone: the plain frequencies' own computation, times 1, plus 0
    numerics.assert_same(got[fast], plain[fast])
    numerics.assert_close(got[slow], plain[slow] / s)  # interpolated
    ratio = got / plain  # from 1 for the fastest pairs down to 1/s, never rising
    assert bool((ratio[1:] <= ratio[:-1] + 1e-15).all())


def test_yarn_default_bounds_are_the_papers():
    torch.testing.assert_close(rotary_frequencies(128, scaling=("yarn", 4, 4096)),
                               rotary_frequencies(128, scaling=("yarn", 4, 4096, 1, 32)))


def test_rotary_embedding_uses_the_scaled_frequencies():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(6) * 5
    for scaling in (("linear", 2), ("ntk", 3), ("yarn", 2, 16, 1, 2)):
        freq = rotary_frequencies(8, scaling=scaling)
        want = torch.zeros_like(x)
        for t in range(6):
            for i in range(4):
                a = int(pos[t]) * float(freq[i])
                u, v = float(x[t, i]), float(x[t, i + 4])
                want[t, i] = u * math.cos(a) - v * math.sin(a)
                want[t, i + 4] = v * math.cos(a) + u * math.sin(a)
        numerics.assert_close(rotary_embedding(x, pos, scaling=scaling), want)


def test_yarn_attention_scale():
    from position import yarn_attention_scale
    assert yarn_attention_scale(1) == 1.0
    assert abs(yarn_attention_scale(math.e) - 1.1) < 1e-15
    assert abs(yarn_attention_scale(16) - (0.1 * math.log(16) + 1)) < 1e-15


@pytest.mark.parametrize("scaling, match", [
    (("cubic", 2), "scaling must be"), ("linear", "scaling must be"),
    (("linear", 0.5), ">= 1"), (("ntk", float("nan")), ">= 1"), (("ntk", True), ">= 1"),
    (("linear", 2, 3), "entries"), (("yarn", 2), "entries"),
    (("yarn", 2, 0), "train_length"), (("yarn", 2, 16, 2, 1), "alpha < beta"),
    (("llama3", 8, 8192, 4, 1), "low_freq_factor < high_freq_factor"),
    (("llama3", 8, 8192, 1), "entries"), (("dynamic", 2, 16), "entries"),
    (("dynamic", 2, 16, 0), "length must be a positive integer"),
    (("dynamic", 0.5, 16, 32), ">= 1")])
def test_bad_scalings_raise_a_clear_value_error(scaling, match):
    with pytest.raises(ValueError, match=match):
        rotary_frequencies(8, scaling=scaling)


def hf_llama3(d, base, factor, old_context_len, low_freq_factor, high_freq_factor):
    """transformers' _compute_llama3_parameters (modeling_rope_utils.py), transcribed, with
    the default inverse frequencies in float64 instead of the library's float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def hf_dynamic(d, base, factor, max_position_embeddings, seq_len):
    """transformers' _compute_dynamic_ntk_parameters, transcribed (float64, as above)."""
    seq_len = seq_len if seq_len > max_position_embeddings else max_position_embeddings
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))


@pytest.mark.parametrize("d, base, s, L, low, high", [
    (128, 500000.0, 8.0, 8192, 1.0, 4.0),  # Llama 3.1's released values
    (64, 10000.0, 4.0, 2048, 1.0, 4.0), (128, 500000.0, 32.0, 8192, 1.0, 4.0),
    (16, 10000.0, 2.0, 16, 0.5, 3.0)])
def test_llama3_scaling_is_transformers_llama3_rope_type(d, base, s, L, low, high):
    got = rotary_frequencies(d, base=base, scaling=("llama3", s, L, low, high))
    numerics.assert_close(got, hf_llama3(d, base, s, L, low, high))
    # and YaRN's frequencies with the bounds alpha = low, beta = high
    numerics.assert_close(got, rotary_frequencies(d, base=base, scaling=("yarn", s, L, low,
                                                                         high)))


@pytest.mark.parametrize("d, base, s, L, length", [
    (128, 10000.0, 2.0, 4096, 1), (128, 10000.0, 2.0, 4096, 4096),
    (128, 10000.0, 2.0, 4096, 6000), (64, 500000.0, 4.0, 2048, 16384), (8, 10000.0, 1.5, 16, 40)])
def test_dynamic_scaling_is_transformers_dynamic_rope_type(d, base, s, L, length):
    got = rotary_frequencies(d, base=base, scaling=("dynamic", s, L, length))
    numerics.assert_close(got, hf_dynamic(d, base, s, L, length))
    if length <= L:  # nothing changes within the training length
        numerics.assert_close(got, rotary_frequencies(d, base=base))


def test_yarn_attention_scale_rejects_shrinking():
    from position import yarn_attention_scale
    with pytest.raises(ValueError, match=">= 1"):
        yarn_attention_scale(0.5)


# --------------------------------------------------------------------- partial rotary


def test_partial_rotary_rotates_the_first_features_only():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 7, 10, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 4, 5]])[:, None, :]
    got = rotary_embedding(x, ids, rotary_dim=4)
    torch.testing.assert_close(got[..., :4], rotary_embedding(x[..., :4], ids))
    numerics.assert_same(got[..., 4:], x[..., 4:])  # copies of the features not rotated
    torch.testing.assert_close(rotary_embedding(x, rotary_dim=10), rotary_embedding(x))
    odd = torch.randn(5, 7, generator=g, dtype=torch.float64)  # odd width, even rotary part
    numerics.assert_same(rotary_embedding(odd, rotary_dim=6)[:, 6], odd[:, 6])  # a copy


def test_partial_rotary_scores_split_into_rotated_and_content_terms():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(9, 12, generator=g, dtype=torch.float64)
    k = torch.randn(9, 12, generator=g, dtype=torch.float64)
    scores = rotary_embedding(q, rotary_dim=4) @ rotary_embedding(k, rotary_dim=4).T
    rotated = rotary_embedding(q[:, :4]) @ rotary_embedding(k[:, :4]).T
    numerics.assert_close(scores - rotated, q[:, 4:] @ k[:, 4:].T)


@pytest.mark.parametrize("rotary_dim, match", [(3, "even"), (0, "even"), (12, "even"),
                                               (2.0, "even")])
def test_partial_rotary_rejects_bad_widths(rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        rotary_embedding(torch.randn(4, 10), rotary_dim=rotary_dim)


def test_partial_layouts_convert_by_permutation_with_biases():
    """GPT-J style (interleaved pairs on the first r features of each head, biases on the
    projections) against half-split on the same r features after the permutation."""
    g = torch.Generator().manual_seed(10)
    H, d_h, r, d_model, T = 2, 6, 4, 8, 5
    w_q, w_k = (torch.randn(d_model, H * d_h, generator=g, dtype=torch.float64) for _ in "qk")
    b_q, b_k = (torch.randn(H * d_h, generator=g, dtype=torch.float64) for _ in "qk")
    x = torch.randn(T, d_model, generator=g, dtype=torch.float64)

    def interleaved_partial(u):  # (T, H * d_h), per head: loops on the first r features
        out = u.clone()
        for h in range(H):
            part = u[:, h * d_h:h * d_h + r]
            out[:, h * d_h:h * d_h + r] = rope_interleaved_loops(part)
        return out

    def per_head(u):
        return u.view(T, H, d_h).transpose(0, 1)  # (H, T, d_h)

    q_a, k_a = interleaved_partial(x @ w_q + b_q), interleaved_partial(x @ w_k + b_k)
    scores_a = per_head(q_a) @ per_head(k_a).transpose(-2, -1)
    perm = interleaved_to_half_split(d_h, num_heads=H, rotary_dim=r)
    assert perm.tolist() == [0, 2, 1, 3, 4, 5, 6, 8, 7, 9, 10, 11]
    q_b = rotary_embedding(per_head(x @ w_q[:, perm] + b_q[perm]), rotary_dim=r)
    k_b = rotary_embedding(per_head(x @ w_k[:, perm] + b_k[perm]), rotary_dim=r)
    numerics.assert_close(q_b @ k_b.transpose(-2, -1), scores_a)
    # Without permuting the biases the scores change.
    q_c = rotary_embedding(per_head(x @ w_q[:, perm] + b_q), rotary_dim=r)
    k_c = rotary_embedding(per_head(x @ w_k[:, perm] + b_k), rotary_dim=r)
    assert float((q_c @ k_c.transpose(-2, -1) - scores_a).abs().max()) > 1e-3


def test_permutation_rejects_bad_widths():
    with pytest.raises(ValueError, match="even"):
        interleaved_to_half_split(5)
    with pytest.raises(ValueError, match="even"):
        interleaved_to_half_split(8, rotary_dim=10)
