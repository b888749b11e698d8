"""Grouped-query attention, the key-value cache and the sliding window of code/attention.py,
against PyTorch's `enable_gqa` and against the full (uncached) computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import KVCache, MultiHeadAttention, causal_mask, repeat_kv

# "Equal" in this file: to float rounding.
EQUAL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}

CHUNKINGS = {  # how a sequence of 10 tokens is fed to the cache
    "whole": [10],
    "prompt, then one at a time": [4, 1, 1, 1, 1, 1, 1],
    "one at a time": [1] * 10,
    "chunks of 3": [3, 3, 3, 1],
}


def mha(num_heads=4, num_kv_heads=None, d_model=16, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, dtype=dtype).eval()


def tokens(B=2, T=10, d_model=16, dtype=torch.float64, seed=1):
    return torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def decode(model, x, sizes, cache, **kwargs):
    """Feed x in chunks of the given sizes through one cache; the outputs and weights."""
    outs, weights, start = [], [], 0
    for n in sizes:
        chunk = x[:, start:start + n]
        out, w = model(chunk, chunk, chunk, cache=cache, **kwargs)
        outs.append(out)
        weights.append(w)
        start += n
    assert start == x.shape[1]
    return torch.cat(outs, dim=1), weights


class TestGroupedQueryAttention:
    @pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
    def test_projection_widths_and_parameters(self, num_kv_heads):
        m = mha(num_kv_heads=num_kv_heads)
        assert m.k_proj.weight.shape == m.v_proj.weight.shape == (num_kv_heads * 4, 16)
        assert m.q_proj.weight.shape == m.out_proj.weight.shape == (16, 16)
        weights = sum(p.numel() for name, p in m.named_parameters() if name.endswith("weight"))
        assert weights == 2 * 16 * 16 + 2 * 16 * num_kv_heads * 4

    @pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_matches_torch_enable_gqa(self, num_kv_heads, dtype):
        m = mha(num_kv_heads=num_kv_heads, dtype=dtype)
        x = tokens(dtype=dtype)
        out, w = m(x, x, x, is_causal=True)
        assert w.shape == (2, 4, 10, 10)  # one map per query head
        q = m.split_heads(m.q_proj(x))
        k, v = m.split_heads(m.k_proj(x)), m.split_heads(m.v_proj(x))
        assert k.shape == (2, num_kv_heads, 10, 4)
        with sdpa_kernel(SDPBackend.MATH):
            heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, m.out_proj(m.merge_heads(heads)), **EQUAL[dtype])

    def test_query_head_h_reads_kv_head_h_over_group(self):
        x = torch.arange(2 * 3 * 5 * 1.0).view(1, 2, 3, 5)[..., None].expand(1, 2, 3, 5, 1)
        x = x.reshape(1, 2, 15, 1)[:, :, :3]  # (B=1, G=2, S=3, d=1), heads distinguishable
        out = repeat_kv(x, 3)
        assert out.shape == (1, 6, 3, 1)
        for h in range(6):
            assert torch.equal(out[:, h], x[:, h // 3])

    def test_one_kv_head_per_query_head_is_mha(self):
        m = mha(num_kv_heads=None)
        assert m.num_kv_heads == m.num_heads == 4

    @pytest.mark.parametrize("num_kv_heads", [0, 3, 5, -2])
    def test_rejects_a_non_divisor(self, num_kv_heads):
        with pytest.raises(ValueError, match="divisor of num_heads=4"):
            mha(num_kv_heads=num_kv_heads)

    def test_repeat_kv_rejects_bad_counts(self):
        with pytest.raises(ValueError, match="positive integer n_rep"):
            repeat_kv(torch.zeros(1, 2, 3, 4), 0)


class TestKVCache:
    @pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
    @pytest.mark.parametrize("chunking", CHUNKINGS, ids=list(CHUNKINGS))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_cached_decoding_equals_full_causal_attention(self, num_kv_heads, chunking, dtype):
        m = mha(num_kv_heads=num_kv_heads, dtype=dtype)
        x = tokens(dtype=dtype)
        full, full_w = m(x, x, x, is_causal=True)
        cache = KVCache()
        out, weights = decode(m, x, CHUNKINGS[chunking], cache, is_causal=True)
        torch.testing.assert_close(out, full, **EQUAL[dtype])
        start = 0
        for w in weights:  # each chunk's weights are the full map's rows, up to the chunk's end
            n, S = w.shape[-2:]
            assert S == start + n
            torch.testing.assert_close(w, full_w[..., start:start + n, :S], **EQUAL[dtype])
            start += n
        assert len(cache) == cache.seen == 10
        assert cache.keys.shape == cache.values.shape == (2, num_kv_heads, 10, 4)

    def test_cache_holds_the_projected_keys_and_values(self):
        m, x = mha(num_kv_heads=2), tokens()
        cache = KVCache()
        decode(m, x, [6, 4], cache, is_causal=True)
        torch.testing.assert_close(cache.keys, m.split_heads(m.k_proj(x)), **EQUAL[torch.float64])
        torch.testing.assert_close(cache.values, m.split_heads(m.v_proj(x)),
                                   **EQUAL[torch.float64])

    def test_not_causal_sees_every_cached_and_new_key(self):
        m, x = mha(), tokens()
        cache = KVCache()
        m(x[:, :6], x[:, :6], x[:, :6], cache=cache)
        out, w = m(x[:, 6:], x[:, 6:], x[:, 6:], cache=cache)
        full, full_w = m(x[:, 6:], x, x)  # the last 4 queries, every key
        torch.testing.assert_close(out, full, **EQUAL[torch.float64])
        torch.testing.assert_close(w, full_w, **EQUAL[torch.float64])

    def test_without_a_cache_is_causal_stays_top_left(self):
        m, x = mha(), tokens()
        _, w = m(x[:, :3], x, x, is_causal=True)  # 3 queries, 10 keys: top-left
        assert torch.equal(w[0, 0] > 0, causal_mask(3, 10))

    def test_a_padding_mask_applies_with_the_cache(self):
        m, x = mha(), tokens()
        keep = torch.ones(2, 10, dtype=torch.bool)
        keep[1, :3] = False  # sequence 1 is left-padded by three positions
        full, _ = m(x, x, x, attn_mask=keep[:, None, None, :] & causal_mask(10))
        cache, outs = KVCache(), []
        for start, end in [(0, 5), (5, 6), (6, 10)]:
            chunk = x[:, start:end]
            out, _ = m(chunk, chunk, chunk, is_causal=True, cache=cache,
                       attn_mask=keep[:, None, None, :end])
            outs.append(out)
        # Sequence 1's first three queries see no key at all: both give zero weights there.
        torch.testing.assert_close(torch.cat(outs, 1), full, **EQUAL[torch.float64])

    def test_reset_starts_a_new_sequence(self):
        m, x = mha(), tokens()
        cache = KVCache()
        decode(m, x, [10], cache, is_causal=True)
        cache.reset()
        assert len(cache) == cache.seen == 0 and cache.keys is None
        out, _ = decode(m, x, [2, 8], cache, is_causal=True)
        torch.testing.assert_close(out, m(x, x, x, is_causal=True)[0], **EQUAL[torch.float64])

    def test_rejects_a_batch_of_another_size(self):
        m, x = mha(), tokens()
        cache = KVCache()
        m(x, x, x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match=r"do not fit the cached keys \(2, 4, 10, 4\)"):
            m(x[:1], x[:1], x[:1], is_causal=True, cache=cache)

    def test_rejects_cross_attention(self):
        m, x = mha(), tokens()
        with pytest.raises(ValueError, match="self-attention"):
            m(x[:, :2], x, x, cache=KVCache())


class TestSlidingWindow:
    def test_window_mask_entries(self):
        m = causal_mask(6, window=3)
        for i in range(6):
            for j in range(6):
                assert bool(m[i, j]) == (0 <= i - j < 3)
        assert torch.equal(causal_mask(4, window=10), causal_mask(4))

    @pytest.mark.parametrize("window", [0, -1, 2.0, True])
    def test_window_must_be_positive(self, window):
        with pytest.raises(ValueError, match="positive integer"):
            causal_mask(4, window=window)
        with pytest.raises(ValueError, match="positive integer"):
            KVCache(window=window)

    @pytest.mark.parametrize("num_kv_heads", [4, 1])
    @pytest.mark.parametrize("window", [1, 3, 4, 12])
    @pytest.mark.parametrize("chunking", CHUNKINGS, ids=list(CHUNKINGS))
    def test_rolling_cache_equals_the_window_mask(self, num_kv_heads, window, chunking):
        m, x = mha(num_kv_heads=num_kv_heads), tokens()
        full, _ = m(x, x, x, attn_mask=causal_mask(10, window=window))
        cache = KVCache(window=window)
        out, _ = decode(m, x, CHUNKINGS[chunking], cache, is_causal=True)
        torch.testing.assert_close(out, full, **EQUAL[torch.float64])
        assert len(cache) == min(window, 10) and cache.seen == 10
        torch.testing.assert_close(cache.keys, m.split_heads(m.k_proj(x))[:, :, -len(cache):],
                                   **EQUAL[torch.float64])

    def test_memory_stays_bounded(self):
        m, x = mha(), tokens(T=10)
        cache = KVCache(window=3)
        for t in range(10):
            m(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache)
            assert len(cache) == min(t + 1, 3)
