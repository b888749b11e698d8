"""Grouped-query attention, the key-value cache and the sliding window of code/attention.py,
against PyTorch's `enable_gqa` and against the full (uncached) computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import numerics
from attention import KVCache, MultiHeadAttention, causal_mask, repeat_kv

# Results of another computation (chunk by chunk against the whole sequence, a cache against
# none) are compared to rounding (numerics.assert_close); copies and masks exactly (assert_same).

CHUNKINGS = {  # how a sequence of 10 tokens is fed to the cache
    "whole": [10],
    "prompt, then one at a time": [4, 1, 1, 1, 1, 1, 1],
    "one at a time": [1] * 10,
    "chunks of 3": [3, 3, 3, 1],
    "one, then chunks longer than a window": [1, 5, 4],
    "two, then eight": [2, 8],
}
# The three kinds of cache (a rolling one for each window the tests try, some with sinks), as
# KVCache's arguments.
KINDS = {"concatenating": {}, "preallocated": {"capacity": 10},
         **{f"rolling, window {w}": {"window": w} for w in (1, 3, 4, 12)},
         **{f"rolling, window {w}, sinks {s}": {"window": w, "sinks": s}
            for w, s in ((1, 1), (3, 2), (2, 5), (4, 8))}}


def full_mask(kind, T=10):
    """The mask of the whole sequence that a cache of this kind must reproduce."""
    return causal_mask(T, window=KINDS[kind].get("window"), sinks=KINDS[kind].get("sinks", 0))


def kept(kind, T=10):
    """The positions a cache of this kind holds after T positions, in order."""
    window, sinks = KINDS[kind].get("window"), KINDS[kind].get("sinks", 0)
    return [p for p in range(T) if window is None or p < sinks or p >= T - window]


def mha(num_heads=4, num_kv_heads=None, d_model=16, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, dtype=dtype).eval()


def tokens(B=2, T=10, d_model=16, dtype=torch.float64, seed=1):
    return torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def decode(model, x, sizes, cache, **kwargs):
    """Feed x in chunks of the given sizes through one cache (without autograd, as a decoder
    runs); the outputs and weights."""
    outs, weights, start = [], [], 0
    for n in sizes:
        chunk = x[:, start:start + n]
        with torch.no_grad():
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
        numerics.assert_close(out, m.out_proj(m.merge_heads(heads)))

    def test_query_head_h_reads_kv_head_h_over_group(self):
        x = torch.arange(2 * 3 * 5 * 1.0).view(1, 2, 3, 5)[..., None].expand(1, 2, 3, 5, 1)
        x = x.reshape(1, 2, 15, 1)[:, :, :3]  # (B=1, G=2, S=3, d=1), heads distinguishable
        out = repeat_kv(x, 3)
        assert out.shape == (1, 6, 3, 1)
        for h in range(6):
            numerics.assert_same(out[:, h], x[:, h // 3])  # a copy

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


def full_weights_at(full_w, start, positions):
    """The rows start.. of the full weights (B, H, T, T), their columns picked in the order of
    the cache's keys: what a cached chunk's weights must equal."""
    return full_w[..., start:, :][..., positions]


class TestKVCache:
    @pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
    @pytest.mark.parametrize("chunking", CHUNKINGS, ids=list(CHUNKINGS))
    @pytest.mark.parametrize("kind", KINDS, ids=list(KINDS))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_every_cache_equals_the_full_computation(self, num_kv_heads, chunking, kind, dtype):
        """Outputs and weights of every chunk, for every kind of cache, are those of the whole
        sequence at once, under the causal mask or the sliding window's."""
        m = mha(num_kv_heads=num_kv_heads, dtype=dtype)
        x = tokens(dtype=dtype)
        full, full_w = m(x, x, x, attn_mask=full_mask(kind))
        cache = KVCache(**KINDS[kind])
        outs, start = [], 0
        for n in CHUNKINGS[chunking]:
            chunk = x[:, start:start + n]
            with torch.no_grad():
                out, w = m(chunk, chunk, chunk, is_causal=True, cache=cache)
            positions = cache.key_positions  # the position of each key the chunk was given
            assert w.shape[-1] == len(positions) and len(set(positions.tolist())) == len(positions)
            numerics.assert_close(  # each chunk's weights are the full map's rows
                w, full_weights_at(full_w, start, positions)[..., :n, :])
            if kind == "concatenating" or kind == "preallocated":  # in order: every key so far
                assert positions.tolist() == list(range(start + n))
            outs.append(out)
            start += n
        numerics.assert_close(torch.cat(outs, 1), full)
        held = kept(kind)
        assert len(cache) == len(held) and cache.seen == 10
        assert cache.keys.shape == cache.values.shape == (2, num_kv_heads, len(held), 4)
        with torch.no_grad():  # in position order, whatever the storage's order
            numerics.assert_close(cache.keys, m.split_heads(m.k_proj(x))[:, :, held])
            numerics.assert_close(cache.values, m.split_heads(m.v_proj(x))[:, :, held])

    def test_cache_holds_the_projected_keys_and_values(self):
        m, x = mha(num_kv_heads=2), tokens()
        cache = KVCache()
        decode(m, x, [6, 4], cache, is_causal=True)
        numerics.assert_close(cache.keys, m.split_heads(m.k_proj(x)))
        numerics.assert_close(cache.values, m.split_heads(m.v_proj(x)))

    def test_not_causal_sees_every_cached_and_new_key(self):
        m, x = mha(), tokens()
        cache = KVCache()
        m(x[:, :6], x[:, :6], x[:, :6], cache=cache)
        out, w = m(x[:, 6:], x[:, 6:], x[:, 6:], cache=cache)
        full, full_w = m(x[:, 6:], x, x)  # the last 4 queries, every key
        numerics.assert_close(out, full)
        numerics.assert_close(w, full_w)

    def test_without_a_cache_is_causal_stays_top_left(self):
        m, x = mha(), tokens()
        _, w = m(x[:, :3], x, x, is_causal=True)  # 3 queries, 10 keys: top-left
        numerics.assert_same(w[0, 0] > 0, causal_mask(3, 10))  # booleans

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
        numerics.assert_close(torch.cat(outs, 1), full)

    @pytest.mark.parametrize("kind", KINDS, ids=list(KINDS))
    def test_reset_starts_a_new_sequence(self, kind):
        m, x = mha(), tokens()
        cache = KVCache(**KINDS[kind])
        decode(m, x, [10], cache, is_causal=True)
        storage = cache.storage[0]
        cache.reset()
        assert len(cache) == cache.seen == 0 and cache.keys is None and cache.values is None
        # A preallocated or rolling cache keeps its storage for the next sequence.
        assert (cache.storage[0] is storage) == (kind != "concatenating")
        out, _ = decode(m, x, [2, 8], cache, is_causal=True)
        numerics.assert_close(out, m(x, x, x, attn_mask=full_mask(kind))[0])
        if kind != "concatenating":
            assert cache.storage[0].data_ptr() == storage.data_ptr()
            cache.reset(release=True)
            assert cache.storage == (None, None) and cache.slot_positions is None

    @pytest.mark.parametrize("kind", KINDS, ids=list(KINDS))
    def test_rejects_a_batch_of_another_size(self, kind):
        m, x = mha(), tokens()
        cache = KVCache(**KINDS[kind])
        with torch.no_grad():
            m(x, x, x, is_causal=True, cache=cache)
        held = len(cache)
        with pytest.raises(ValueError, match=rf"do not fit the cached keys \(2, 4, {held}, 4\)"):
            with torch.no_grad():
                m(x[:1], x[:1], x[:1], is_causal=True, cache=cache)

    @pytest.mark.parametrize("kind", ["preallocated", "rolling, window 4"])
    def test_after_reset_another_shape_needs_release(self, kind):
        cache = KVCache(**KINDS[kind])
        k = torch.zeros(2, 4, 3, 8)
        cache.update(k, k)
        cache.reset()
        with pytest.raises(ValueError, match=r"do not fit the cache's storage \(2, 4, \d+, 8\)"
                                             r".*reset\(release=True\)"):
            cache.update(k[:1], k[:1])
        cache.reset(release=True)
        cache.update(k[:1], k[:1])  # a new storage, for one sequence
        assert cache.storage[0].shape[0] == 1

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
        numerics.assert_same(causal_mask(4, window=10), causal_mask(4))  # booleans

    @pytest.mark.parametrize("L, S", [(7, 7), (3, 7), (7, 4)])
    def test_sink_mask_entries(self, L, S):
        """The first s keys stay visible (where causal) besides the window of W."""
        for window in (1, 2, 3):
            for sinks in (0, 1, 2, 9):
                m = causal_mask(L, S, window=window, sinks=sinks)
                for i in range(L):
                    for j in range(S):
                        assert bool(m[i, j]) == (j <= i and (i - j < window or j < sinks))
        numerics.assert_same(causal_mask(L, S, window=2, sinks=0), causal_mask(L, S, window=2))
        numerics.assert_same(causal_mask(L, S, sinks=3), causal_mask(L, S))  # no window
        numerics.assert_same(causal_mask(L, S, window=1, sinks=S), causal_mask(L, S))
        assert int(causal_mask(20, window=5, sinks=3).sum(-1).max()) == 5 + 3

    @pytest.mark.parametrize("sinks", [-1, 1.0, True, None])
    def test_sinks_must_be_a_non_negative_integer(self, sinks):
        with pytest.raises(ValueError, match="non-negative integer sinks, got"):
            causal_mask(4, window=2, sinks=sinks)

    @pytest.mark.parametrize("window", [0, -1, 2.0, True])
    def test_window_must_be_positive(self, window):
        with pytest.raises(ValueError, match="positive integer"):
            causal_mask(4, window=window)
        with pytest.raises(ValueError, match="window must be a positive integer"):
            KVCache(window=window)

    @pytest.mark.parametrize("window", [1, 3, 4, 12])
    def test_concatenating_and_rolling_caches_agree(self, window):
        """The same keys reach attention, in another order: the same outputs."""
        m, x = mha(num_kv_heads=1), tokens()
        ring, out_ring, start = KVCache(window=window), [], 0
        for n in [3, 1, 1, 5]:
            chunk = x[:, start:start + n]
            with torch.no_grad():
                out_ring.append(m(chunk, chunk, chunk, is_causal=True, cache=ring)[0])
            start += n
        full, _ = m(x, x, x, attn_mask=causal_mask(10, window=window))
        numerics.assert_close(torch.cat(out_ring, 1), full)


class TestPreallocatedCache:
    def test_allocates_once_and_returns_views(self):
        """The storage is allocated by the first call, in its keys' dtype, and never again:
        every call writes into it and returns views of the filled part."""
        m, x = mha(num_kv_heads=2, dtype=torch.float32), tokens(dtype=torch.float32)
        cache = KVCache(capacity=16)
        assert cache.storage == (None, None) and cache.kind == "preallocated"
        addresses = set()
        start = 0
        for n in [4, 1, 1, 3, 1]:
            k, v = torch.randn(2, 2, n, 4), torch.randn(2, 2, n, 4)
            keys, values, visible = cache.update(k, v)
            storage_k, storage_v = cache.storage
            assert storage_k.shape == storage_v.shape == (2, 2, 16, 4)
            assert storage_k.dtype == torch.float32
            addresses.add((storage_k.data_ptr(), storage_v.data_ptr()))
            assert keys.data_ptr() == storage_k.data_ptr() and keys._base is storage_k  # a view
            assert values._base is storage_v and keys.shape[-2] == start + n
            numerics.assert_same(keys[..., start:, :], k)  # copies of what it was given
            numerics.assert_same(values[..., start:, :], v)
            numerics.assert_same(visible, torch.ones(n, start + n, dtype=torch.bool).tril(start))
            start += n
        assert len(addresses) == 1  # never reallocated
        assert cache.keys._base is storage_k and len(cache) == 10
        assert cache.slot_positions.tolist() == list(range(10)) + [-1] * 6

    def test_float64_storage_follows_the_first_keys(self):
        cache = KVCache(capacity=3)
        cache.update(torch.zeros(1, 1, 1, 2, dtype=torch.float64),
                     torch.zeros(1, 1, 1, 2, dtype=torch.float64))
        assert cache.storage[0].dtype == torch.float64
        with pytest.raises(ValueError, match="dtype torch.float32.*storage of dtype torch.float64"):
            cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))

    def test_exceeding_the_capacity_names_the_sizes(self):
        cache = KVCache(capacity=10)
        k = torch.zeros(1, 2, 8, 4)
        cache.update(k, k)
        with pytest.raises(ValueError, match="holds 8 positions and 3 new ones do not fit its "
                                             "capacity of 10"):
            cache.update(k[..., :3, :], k[..., :3, :])
        assert len(cache) == cache.seen == 8  # the refused call changed nothing
        cache.update(k[..., :2, :], k[..., :2, :])  # exactly full is fine
        assert len(cache) == 10
        with pytest.raises(ValueError, match="holds 0 positions and 8 new ones do not fit its "
                                             "capacity of 1"):
            KVCache(capacity=1).update(k, k)  # on the first call too

    def test_says_what_it_holds(self):
        cache = KVCache(capacity=8)
        assert repr(cache) == "KVCache(capacity=8, holds 0 positions, seen=0)"
        cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
        assert repr(cache) == "KVCache(capacity=8, holds 3 positions, seen=3)"
        assert cache.key_positions.tolist() == [0, 1, 2]
        ring = KVCache(window=2)
        ring.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
        assert repr(ring) == "KVCache(window=2, holds 2 positions, seen=3)"
        assert repr(KVCache()) == "KVCache(holds 0 positions, seen=0)"

    @pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
    def test_capacity_must_be_positive(self, capacity):
        with pytest.raises(ValueError, match="capacity must be a positive integer"):
            KVCache(capacity=capacity)


class TestRollingCache:
    @pytest.mark.parametrize("window", [1, 3, 4])
    @pytest.mark.parametrize("chunking", CHUNKINGS, ids=list(CHUNKINGS))
    def test_position_p_is_in_slot_p_mod_w(self, window, chunking):
        """After every call, slot s holds the latest position p with p % W == s (or -1 while
        empty), and its row of the storage is that position's key and value."""
        m, x = mha(num_kv_heads=2), tokens()
        with torch.no_grad():
            k_all, v_all = m.split_heads(m.k_proj(x)), m.split_heads(m.v_proj(x))  # (B, G, T, 4)
        cache, start = KVCache(window=window), 0
        for n in CHUNKINGS[chunking]:
            chunk = x[:, start:start + n]
            with torch.no_grad():
                m(chunk, chunk, chunk, is_causal=True, cache=cache)
            start += n
            slots = cache.slot_positions
            expected = [max((p for p in range(start) if p % window == s), default=-1)
                        for s in range(window)]
            assert slots.tolist() == expected
            storage_k, storage_v = cache.storage
            assert storage_k.shape == (2, 2, window, 4)
            for s, p in enumerate(expected):  # projected chunk by chunk, not all at once
                if p >= 0:
                    numerics.assert_close(storage_k[:, :, s], k_all[:, :, p])
                    numerics.assert_close(storage_v[:, :, s], v_all[:, :, p])

    def test_allocates_once_and_one_token_attends_to_the_slots_themselves(self):
        cache, W = KVCache(window=4), 4
        pointers = set()
        for t in range(11):
            k = torch.full((1, 1, 1, 2), float(t))
            keys, values, visible = cache.update(k, k)
            pointers.add(cache.storage[0].data_ptr())
            assert keys._base is cache.storage[0]  # a view of the slots: nothing copied
            assert keys.shape[-2] == min(t + 1, W) and bool(visible.all())
            assert keys[0, 0, :, 0].tolist() == cache.key_positions.tolist()  # slot order
            assert cache.keys[0, 0, :, 0].tolist() == list(range(max(0, t - 3), t + 1))
        assert len(pointers) == 1
        assert cache.slot_positions.tolist() == [8, 9, 10, 7]  # 10 % 4 = 2 is the newest

    def test_a_chunk_that_wraps_attends_to_the_slots_then_its_own_keys(self):
        cache = KVCache(window=3)
        keys = [torch.full((1, 1, n, 1), 0.0) + torch.arange(a, a + n).view(1, 1, n, 1)
                for a, n in ((0, 4), (4, 2))]
        cache.update(keys[0], keys[0])
        assert cache.slot_positions.tolist() == [3, 1, 2]
        k, _, visible = cache.update(keys[1], keys[1])  # positions 4 and 5
        assert k[0, 0, :, 0].tolist() == [3, 1, 2, 4, 5] == cache.key_positions.tolist()
        # Query 4 sees 2, 3, 4; query 5 sees 3, 4, 5 (window 3): from the positions, not order.
        assert visible.tolist() == [[True, False, True, True, False],
                                    [True, False, False, True, True]]
        assert cache.slot_positions.tolist() == [3, 4, 5]

    def test_memory_stays_bounded(self):
        m, x = mha(), tokens(T=10)
        cache = KVCache(window=3)
        for t in range(10):
            with torch.no_grad():
                m(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, cache=cache)
            assert len(cache) == min(t + 1, 3) and cache.storage[0].shape[-2] == 3

    @pytest.mark.parametrize("window, sinks", [(1, 1), (3, 2), (2, 5)])
    @pytest.mark.parametrize("chunking", CHUNKINGS, ids=list(CHUNKINGS))
    def test_sinks_keep_their_slots_and_the_ring_turns_after_them(self, window, sinks, chunking):
        """After every call, slot p < s holds position p for good, and slot s + r the latest
        position p >= s with (p - s) % W == r; each row of the storage is that position's key
        and value; the keys in position order are the sinks and the last W."""
        m, x = mha(num_kv_heads=2), tokens()
        with torch.no_grad():
            k_all, v_all = m.split_heads(m.k_proj(x)), m.split_heads(m.v_proj(x))  # (B, G, T, 4)
        cache, start = KVCache(window=window, sinks=sinks), 0
        for n in CHUNKINGS[chunking]:
            chunk = x[:, start:start + n]
            with torch.no_grad():
                m(chunk, chunk, chunk, is_causal=True, cache=cache)
            start += n
            expected = [p if p < start else -1 for p in range(sinks)] + [
                max((p for p in range(sinks, start) if (p - sinks) % window == r), default=-1)
                for r in range(window)]
            assert cache.slot_positions.tolist() == expected
            storage_k, storage_v = cache.storage
            assert storage_k.shape == (2, 2, sinks + window, 4)
            for slot, p in enumerate(expected):  # projected chunk by chunk, not all at once
                if p >= 0:
                    numerics.assert_close(storage_k[:, :, slot], k_all[:, :, p])
                    numerics.assert_close(storage_v[:, :, slot], v_all[:, :, p])
            held = [p for p in range(start) if p < sinks or p >= start - window]
            assert len(cache) == len(held)
            numerics.assert_close(cache.keys, k_all[:, :, held])
            numerics.assert_close(cache.values, v_all[:, :, held])

    def test_sinks_one_token_at_a_time_attends_to_the_slots_themselves(self):
        cache = KVCache(window=3, sinks=2)
        for t in range(9):
            k = torch.full((1, 1, 1, 2), float(t))
            keys, _, visible = cache.update(k, k)
            assert keys._base is cache.storage[0] and bool(visible.all())
            assert sorted(keys[0, 0, :, 0].tolist()) == [  # the sinks and the last 3
                p for p in range(t + 1) if p < 2 or p >= t - 2]
        assert cache.slot_positions.tolist() == [0, 1, 8, 6, 7]
        assert repr(cache) == "KVCache(window=3, sinks=2, holds 5 positions, seen=9)"

    @pytest.mark.parametrize("sinks", [-1, 1.5, True])
    def test_sinks_must_be_a_non_negative_integer(self, sinks):
        with pytest.raises(ValueError, match="sinks must be a non-negative integer"):
            KVCache(window=3, sinks=sinks)

    def test_sinks_need_a_window(self):
        for kwargs in ({"sinks": 2}, {"sinks": 2, "capacity": 10}):
            with pytest.raises(ValueError, match="sinks=2 keeps the first positions of a "
                                                 "rolling cache.*give window too"):
                KVCache(**kwargs)
        assert KVCache(sinks=0).kind == "concatenating"

    def test_window_and_capacity_together_are_refused(self):
        with pytest.raises(ValueError, match=r"window or capacity, not both \(window=4, "
                                             r"capacity=100\).*4 slots"):
            KVCache(window=4, capacity=100)


class TestCacheInputs:
    @pytest.mark.parametrize("kind", KINDS, ids=list(KINDS))
    def test_bad_shapes_are_refused_with_their_shapes(self, kind):
        cache = KVCache(**KINDS[kind])
        with pytest.raises(ValueError, match=r"4-D \(B, G, n, head_dim\).*key tensor of shape "
                                             r"\(2, 5, 4\).*value tensor of shape \(2, 5, 4\)"):
            cache.update(torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))
        with pytest.raises(ValueError, match=r"agree in \(B, G, n\).*\(1, 2, 5, 4\).*"
                                             r"\(1, 2, 4, 4\)"):
            cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 4, 4))
        cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
        with pytest.raises(ValueError, match=rf"new keys \(1, 2, 1, 8\) do not fit the cached "
                                             rf"keys \(1, 2, {len(cache)}, 4\)"):
            cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
        assert cache.seen == 3  # nothing was stored by the refused calls

    @pytest.mark.parametrize("kind", ["preallocated", "rolling, window 3", "rolling, window 12"])
    def test_in_place_caches_refuse_autograd_clearly(self, kind):
        """A write in place would change tensors that earlier steps saved for the backward pass
        (autograd then fails deep inside backward()); the cache says so on the first call."""
        m, x = mha(), tokens()
        with pytest.raises(RuntimeError, match=r"in place and is for inference.*torch.no_grad"):
            m(x, x, x, is_causal=True, cache=KVCache(**KINDS[kind]))
        with torch.inference_mode():  # as under no_grad
            m(x, x, x, is_causal=True, cache=KVCache(**KINDS[kind]))

    def test_the_concatenating_cache_gives_the_full_gradient(self):
        m = mha(num_kv_heads=2)
        x = tokens().requires_grad_()
        full, _ = m(x, x, x, is_causal=True)
        cache, outs = KVCache(), []
        for a, b in ((0, 4), (4, 5), (5, 10)):
            outs.append(m(x[:, a:b], x[:, a:b], x[:, a:b], is_causal=True, cache=cache)[0])
        grad_full, = torch.autograd.grad(full.square().sum(), x)
        grad_cached, = torch.autograd.grad(torch.cat(outs, 1).square().sum(), x)
        numerics.assert_close(grad_cached, grad_full)
