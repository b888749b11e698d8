"""code/flash.py against PyTorch's math backend and autograd through plain attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash
import numerics
from attention import scaled_dot_product_attention
from flash import flash_attention, saved_tensor_bytes, tile_count, visited_tiles

torch.set_num_threads(1)

# Flash attention against the math backend or autograd is the same sums in another order: equal
# to rounding (numerics.assert_close).
# (L, S, E, Ev, block_size): multiples and non-multiples, L == S, L > S, L < S, one tile,
# one key, one query, tiles of one row.
SIZES = [(16, 16, 8, 8, 4), (7, 13, 4, 5, 4), (13, 7, 4, 5, 4), (48, 80, 8, 3, 16),
         (80, 48, 8, 3, 16), (5, 5, 3, 3, 64), (33, 1, 2, 2, 8), (1, 33, 2, 2, 8),
         (20, 20, 6, 6, 1), (50, 37, 5, 4, 7)]


def math_sdpa(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def inputs(L, S, E, Ev, dtype, batch=(2, 3), seed=0, size=1.0):
    g = torch.Generator().manual_seed(seed)
    return (size * torch.randn(*batch, L, E, generator=g, dtype=dtype),
            size * torch.randn(*batch, S, E, generator=g, dtype=dtype),
            torch.randn(*batch, S, Ev, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L, S, E, Ev, block_size", SIZES)
def test_forward_equals_math_backend(L, S, E, Ev, block_size, is_causal, dtype):
    q, k, v = inputs(L, S, E, Ev, dtype)
    got = flash_attention(q, k, v, is_causal=is_causal, block_size=block_size)
    numerics.assert_close(got, math_sdpa(q, k, v, is_causal=is_causal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_scores_and_explicit_scale(dtype):
    q, k, v = inputs(9, 21, 4, 3, dtype, size=30.0)  # scores in the hundreds
    for scale in (None, 0.1, 2.0):
        for is_causal in (False, True):
            got = flash_attention(q, k, v, scale=scale, is_causal=is_causal, block_size=4)
            assert got.isfinite().all()
            want = math_sdpa(q, k, v, scale=scale, is_causal=is_causal)
            # Scores near 1000 are themselves rounded by about 1000 ulps (of 1) whichever
            # order computes them, and their exp turns that into a relative error of the
            # weights: a tolerance of 1000 ulps, not numerics' 16.
            numerics.assert_close(got, want, factor=1000 / 16)


@pytest.mark.parametrize("shapes", [
    ((5, 4), (7, 4), (7, 3)),  # no leading axes
    ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 3)),  # (B, H, ...)
    ((2, 3, 5, 4), (1, 3, 7, 4), (3, 7, 3)),  # keys shared over the batch
    ((5, 4), (2, 7, 4), (2, 7, 3)),  # one set of queries for two key sets
    ((2, 1, 5, 4), (1, 4, 7, 4), (1, 4, 7, 3)),
])
def test_leading_axes_broadcast_like_torch(shapes):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)
    got = flash_attention(q, k, v, block_size=3)
    want = math_sdpa(q, k, v)
    assert got.shape == want.shape
    numerics.assert_close(got, want)


@pytest.mark.parametrize("L, S", [(3, 0), (0, 3), (0, 0)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_sequences_as_torch(L, S, is_causal):
    q, k, v = inputs(L, S, 4, 5, torch.float32)
    got = flash_attention(q, k, v, is_causal=is_causal, block_size=2)
    want = math_sdpa(q, k, v, is_causal=is_causal)  # zeros when S == 0 (torch 2.13.0)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    assert not got.isnan().any()


def test_half_precision_is_computed_in_float32():
    q, k, v = inputs(10, 12, 8, 8, torch.float32, size=3.0)
    got = flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_size=4)
    assert got.dtype == torch.bfloat16
    want = math_sdpa(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float())
    numerics.assert_close(got.float(), want, dtype=torch.bfloat16)  # rounded once to bfloat16


def test_block_size_does_not_change_the_result_beyond_rounding():
    q, k, v = inputs(37, 29, 5, 6, torch.float64)
    outs = [flash_attention(q, k, v, is_causal=True, block_size=b) for b in (1, 2, 5, 16, 64)]
    for out in outs[1:]:
        numerics.assert_close(out, outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L, S, E, Ev, block_size",
                         [(7, 13, 4, 5, 4), (13, 7, 4, 5, 4), (48, 80, 8, 3, 16), (16, 16, 8, 8, 4)])
def test_gradients_equal_autograd_through_plain_attention(L, S, E, Ev, block_size, is_causal,
                                                          dtype):
    base = inputs(L, S, E, Ev, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(2, 3, L, Ev, generator=g, dtype=dtype)
    ours = [t.clone().requires_grad_() for t in base]
    theirs = [t.clone().requires_grad_() for t in base]
    flash_attention(*ours, is_causal=is_causal, block_size=block_size).backward(dout)
    scaled_dot_product_attention(*theirs, is_causal=is_causal)[0].backward(dout)
    for mine, ref in zip(ours, theirs):
        numerics.assert_close(mine.grad, ref.grad)
    math_ref = [t.clone().requires_grad_() for t in base]  # and PyTorch's math path
    math_sdpa(*math_ref, is_causal=is_causal).backward(dout)
    for mine, ref in zip(ours, math_ref):
        numerics.assert_close(mine.grad, ref.grad)


def test_gradients_of_broadcast_keys_are_summed():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 9, 2, generator=g, dtype=torch.float64, requires_grad=True)
    flash_attention(q, k, v, block_size=4).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    math_sdpa(q, k, v).sum().backward()
    for mine, t in zip(grads, (q, k, v)):
        assert mine.shape == t.shape
        numerics.assert_close(mine, t.grad)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L, S, block_size", [(5, 7, 2), (7, 5, 3), (6, 6, 4)])
def test_gradcheck(L, S, block_size, is_causal):
    q, k, v = (t.requires_grad_() for t in inputs(L, S, 3, 2, torch.float64, batch=(2,), seed=5))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, is_causal=is_causal, block_size=block_size),
        (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True])
def test_nothing_saved_for_backward_has_L_times_S_entries(is_causal):
    L, S, E, Ev = 48, 80, 8, 8  # q, k, v and the output have fewer than L * S = 3840 entries
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    q, k, v = (t.requires_grad_() for t in inputs(L, S, E, Ev, torch.float32, batch=(1,)))
    assert max(q.numel(), k.numel(), v.numel(), L * Ev) < L * S
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flash_attention(q, k, v, is_causal=is_causal, block_size=16)
    assert saved, "the hook saw no saved tensor"
    for shape in saved:
        assert math.prod(shape) < L * S, f"a saved tensor of shape {shape} has >= L * S entries"
    out.sum().backward()  # and the backward still works from what was saved
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # plain attention does
        scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert any(math.prod(shape) >= L * S for shape in saved)


def test_saved_tensor_bytes():
    L, S, E, Ev = 48, 80, 8, 8
    q, k, v = (t.requires_grad_() for t in inputs(L, S, E, Ev, torch.float32, batch=(1,)))
    # q, k, v, output: float32; lse: one float32 per query row
    assert saved_tensor_bytes(flash_attention, q, k, v, block_size=16) == 4 * (
        L * E + S * E + S * Ev + L * Ev + L)
    plain = saved_tensor_bytes(lambda *a: scaled_dot_product_attention(*a)[0], q, k, v)
    assert plain >= 4 * 2 * L * S
    with torch.no_grad():
        assert saved_tensor_bytes(flash_attention, q, k, v) == 0


def test_tile_counts():
    assert tile_count(64, 64, 16) == 16
    assert tile_count(64, 64, 16, is_causal=True) == 10  # 4 * 5 / 2
    assert tile_count(65, 64, 16, is_causal=True) == 14  # a fifth row of tiles, all 4 visited
    assert tile_count(7, 13, 4) == 2 * 4
    assert tile_count(0, 13, 4) == 0 and tile_count(7, 0, 4) == 0
    for L, S, b in [(64, 64, 16), (100, 100, 8), (37, 53, 5), (53, 37, 5), (1, 9, 2)]:
        n_r, n_c = math.ceil(L / b), math.ceil(S / b)
        assert tile_count(L, S, b) == n_r * n_c
        # causal: row of tiles I visits the key tiles J with J * b <= its last query
        want = sum(min(n_c, (min((I + 1) * b, L) - 1) // b + 1) for I in range(n_r))
        assert tile_count(L, S, b, is_causal=True) == want
        if L == S:
            assert want == n_r * (n_r + 1) // 2
        # a skipped tile has every score masked, a visited one at least one visible
        for I in range(n_r):
            for J in range(n_c):
                visible = J * b <= min((I + 1) * b, L) - 1
                assert ((I, J) in visited_tiles(L, S, b, True)) == visible


def test_tiles_visited_are_the_tiles_computed(monkeypatch):
    """The forward pass computes exactly the tiles that visited_tiles lists."""
    computed = []
    original = flash._causal_fill

    def spy(z, i0, j0):
        computed.append((i0 // 4, j0 // 4))
        return original(z, i0, j0)

    monkeypatch.setattr(flash, "_causal_fill", spy)
    q, k, v = inputs(13, 10, 2, 2, torch.float32, batch=(1,))
    flash_attention(q, k, v, is_causal=True, block_size=4)
    assert computed == visited_tiles(13, 10, 4, is_causal=True)


@pytest.mark.parametrize("args, match", [
    (((2, 5, 4), (2, 7, 3), (2, 7, 3)), r"same last dim E.*query \(2, 5, 4\)"),
    (((2, 5, 4), (2, 7, 4), (2, 6, 3)), r"same length S.*value \(2, 6, 3\)"),
    (((2, 5, 4), (3, 7, 4), (3, 7, 3)), r"batch dims.*key \(3, 7, 4\)"),
    (((5,), (7, 4), (7, 3)), r"at least 2 dims"),
])
def test_bad_shapes_are_named(args, match):
    q, k, v = (torch.randn(*s) for s in args)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v)


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_bad_block_size(block_size):
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="block_size"):
        flash_attention(q, q, q, block_size=block_size)


# --- decoding: flash_decode ---------------------------------------------------------------------

from torch.overrides import TorchFunctionMode  # noqa: E402

from flash import decode_splits, flash_decode  # noqa: E402


def _decode_inputs(B, H, G, L, S, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, d, generator=g, dtype=dtype)
    k, v = (torch.randn(B, G, S, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _bottom_right(L, S):
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)  # query i sees 0..S-L+i


@pytest.mark.parametrize("B, H, G, L, S, d, splits", [
    (2, 8, 2, 1, 37, 16, 4), (1, 4, 4, 3, 10, 8, 3), (2, 6, 1, 5, 5, 4, 5), (1, 2, 1, 1, 1, 4, 1),
    (3, 4, 2, 2, 64, 8, 7), (1, 8, 8, 1, 100, 32, 16)])
def test_flash_decode_is_pytorchs_grouped_attention_with_the_bottom_right_mask(
        B, H, G, L, S, d, splits):
    q, k, v = _decode_inputs(B, H, G, L, S, d)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_bottom_right(L, S), enable_gqa=True)
    numerics.assert_close(flash_decode(q, k, v, num_splits=splits), want)


def test_flash_decode_gives_the_same_result_for_every_split_and_a_given_scale():
    q, k, v = _decode_inputs(2, 4, 2, 2, 23, 8, seed=1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_bottom_right(2, 23),
                                          enable_gqa=True, scale=0.3)
    for splits in range(1, 24):
        numerics.assert_close(flash_decode(q, k, v, num_splits=splits, scale=0.3), want)


def test_flash_decode_in_float32_is_close_to_float64():
    q, k, v = _decode_inputs(1, 4, 1, 1, 300, 16, seed=2)
    got = flash_decode(q.float(), k.float(), v.float(), num_splits=6)
    numerics.assert_close(got, flash_decode(q, k, v, num_splits=6).float())


class _Products(TorchFunctionMode):
    """The shapes of every matrix product, and how often the keys are sliced."""

    def __init__(self, keys):
        super().__init__()
        self.keys, self.shapes, self.key_slices = keys, [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.shapes.append(tuple(out.shape))
        if func is torch.Tensor.__getitem__ and args[0] is self.keys:
            self.key_slices += 1
        return out


def test_flash_decode_reads_each_shared_head_once_per_split_for_its_whole_group():
    B, H, G, L, S, d, splits = 2, 8, 2, 1, 40, 16, 4
    q, k, v = _decode_inputs(B, H, G, L, S, d)
    with _Products(k) as seen:
        flash_decode(q, k, v, num_splits=splits)
    assert seen.key_slices == splits  # each part of the keys taken once
    assert len(seen.shapes) == 2 * splits  # scores and outputs, one product each per part
    # every product is over the G key-value heads, with the group's H/G heads packed as rows
    assert all(shape[:3] == (B, G, H // G * L) for shape in seen.shapes), seen.shapes


def test_decode_splits_cover_the_keys_in_near_equal_parts():
    for S in (1, 7, 64, 100):
        for n in range(1, min(S, 9) + 1):
            parts = decode_splits(S, n)
            assert len(parts) == n and parts[0][0] == 0 and parts[-1][1] == S
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            sizes = [j1 - j0 for j0, j1 in parts]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("args, kwargs, message", [
    ((2, 8, 3, 1, 10, 4), {}, "G = 3 must divide the query heads H = 8"),
    ((1, 4, 2, 1, 10, 4), {"num_splits": 0}, "num_splits must be between 1 and S = 10"),
    ((1, 4, 2, 1, 10, 4), {"num_splits": 11}, "num_splits must be between 1 and S = 10"),
    ((1, 4, 2, 12, 10, 4), {}, "L = 12 newest queries must be among the S = 10"),
])
def test_flash_decode_names_the_sizes_that_do_not_fit(args, kwargs, message):
    q, k, v = _decode_inputs(*args)
    with pytest.raises(ValueError, match=message):
        flash_decode(q, k, v, **kwargs)


def test_flash_decode_refuses_shapes_that_do_not_match():
    q, k, v = _decode_inputs(1, 4, 2, 1, 10, 4)
    with pytest.raises(ValueError, match="must be a 4-D tensor"):
        flash_decode(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must be"):
        flash_decode(q, k[..., :3], v)
