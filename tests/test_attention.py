"""code/attention.py against PyTorch itself: golden comparisons, properties, and errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attention import (
    MultiHeadAttention,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
)

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def qkv(batch, L, S, E, Ev, dtype=torch.float32, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=g) * spread).to(dtype)  # noqa: E731
    return make(*batch, L, E), make(*batch, S, E), make(*batch, S, Ev)


def reference(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def reference_weights(q, k, attn_mask=None, is_causal=False, scale=None):
    """Weights computed the way PyTorch's math path does, in float64, for comparison."""
    q64, k64 = q.double(), k.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q64 @ k64.transpose(-2, -1) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), -math.inf)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.double())
    weights = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(weights, nan=0.0)  # PyTorch's SDPA gives zeros on empty rows


# --------------------------------------------------------------------------- softmax


class TestSoftmax:
    def test_matches_torch(self):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)) * 5
        for dim in (0, 1, -1):
            torch.testing.assert_close(softmax(x, dim=dim), torch.softmax(x, dim=dim))

    def test_finite_at_huge_logits(self):
        x = torch.tensor([[1e4, -1e4, 0.0], [1e4, 1e4, -1e4], [-1e4, -1e4, -1e4]])
        p = softmax(x)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [1 / 3] * 3]))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_huge_logits(self, dtype):
        x = torch.tensor([6e4, 0.0, -6e4], dtype=dtype)
        p = softmax(x)
        assert p.dtype == dtype and torch.isfinite(p).all()
        assert p[0] == 1 and p[1:].sum() == 0

    def test_all_minus_inf_row_is_zero_not_nan(self):
        x = torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]], requires_grad=True)
        p = softmax(x)
        torch.testing.assert_close(p[1], torch.zeros(2))
        assert torch.isfinite(p).all()
        (p * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
        assert torch.isfinite(x.grad).all()
        torch.testing.assert_close(x.grad[1], torch.zeros(2))

    def test_partially_masked_row(self):
        x = torch.tensor([-math.inf, 0.0, 0.0])
        torch.testing.assert_close(softmax(x), torch.tensor([0.0, 0.5, 0.5]))

    def test_gradient_matches_torch(self):
        x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        (softmax(x1) * w).sum().backward()
        (torch.softmax(x2, -1) * w).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad)

    def test_rejects_integer_input(self):
        with pytest.raises(TypeError, match="floating-point"):
            softmax(torch.tensor([1, 2, 3]))


# --------------------------------------------------------------------------- masks


class TestMasks:
    def test_causal_square(self):
        m = causal_mask(4)
        assert m.dtype == torch.bool and m.shape == (4, 4)
        for i in range(4):
            for j in range(4):
                assert bool(m[i, j]) == (j <= i)

    def test_causal_rectangular_matches_torch_is_causal(self):
        q, k, v = qkv((2,), 3, 5, 4, 4)
        m = causal_mask(3, 5)
        assert m.shape == (3, 5)
        torch.testing.assert_close(
            reference(q, k, v, attn_mask=m), reference(q, k, v, is_causal=True)
        )

    def test_padding(self):
        m = padding_mask([3, 1, 0], 4)
        expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
        assert m.dtype == torch.bool
        torch.testing.assert_close(m, expected)
        torch.testing.assert_close(padding_mask(torch.tensor([2, 4]), 4),
                                   torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool))

    @pytest.mark.parametrize("args", [(0,), (-1,), (2.5,), (3, 0), (True,)])
    def test_causal_rejects_bad_sizes(self, args):
        with pytest.raises(ValueError, match="positive integer"):
            causal_mask(*args)

    @pytest.mark.parametrize("lengths,S,match", [
        ([5], 4, "lie in"), ([-1], 4, "lie in"), ([[1, 2]], 4, "1-D"),
        ([1.5], 4, "1-D"), ([1], 0, "positive integer S"),
    ])
    def test_padding_rejects_bad_input(self, lengths, S, match):
        with pytest.raises(ValueError, match=match):
            padding_mask(lengths, S)


# --------------------------------------------------------------------------- SDPA


SHAPES = [  # (batch, L, S, E, Ev)
    ((), 1, 1, 1, 1),
    ((), 3, 3, 4, 4),
    ((2,), 5, 7, 8, 3),
    ((2, 3), 4, 6, 16, 16),
    ((1, 2, 2), 2, 9, 5, 6),
]


class TestScaledDotProductAttention:
    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("seed", [0, 1])
    def test_no_mask(self, shape, seed):
        q, k, v = qkv(*shape, seed=seed)
        out, w = scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(out, reference(q, k, v))
        torch.testing.assert_close(w, reference_weights(q, k).float())
        assert out.shape == (*shape[0], shape[1], shape[4])
        assert w.shape == (*shape[0], shape[1], shape[2])

    @pytest.mark.parametrize("shape", SHAPES)
    def test_boolean_mask(self, shape):
        q, k, v = qkv(*shape, seed=3)
        L, S = shape[1], shape[2]
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(4)) > 0.4
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, reference(q, k, v, attn_mask=mask))
        torch.testing.assert_close(w, reference_weights(q, k, attn_mask=mask).float())
        assert (w[..., ~mask] == 0).all()

    def test_float_mask_is_added(self):
        q, k, v = qkv((2,), 4, 6, 8, 8, seed=5)
        bias = torch.randn(4, 6, generator=torch.Generator().manual_seed(6))
        bias[0, :2] = -math.inf
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.testing.assert_close(out, reference(q, k, v, attn_mask=bias))
        torch.testing.assert_close(w, reference_weights(q, k, attn_mask=bias).float())

    def test_broadcast_masks(self):
        q, k, v = qkv((2, 3), 4, 5, 8, 8, seed=7)
        for shape in [(5,), (1, 5), (4, 5), (2, 1, 1, 5), (2, 3, 4, 5), (3, 4, 5)]:
            mask = torch.rand(*shape, generator=torch.Generator().manual_seed(8)) > 0.3
            torch.testing.assert_close(
                scaled_dot_product_attention(q, k, v, attn_mask=mask)[0],
                reference(q, k, v, attn_mask=mask.expand(2, 3, 4, 5)),
            )

    @pytest.mark.parametrize("L,S", [(4, 4), (3, 6), (6, 3)])
    def test_is_causal(self, L, S):
        q, k, v = qkv((2,), L, S, 8, 4, seed=9)
        out, w = scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, reference(q, k, v, is_causal=True))
        torch.testing.assert_close(w, reference_weights(q, k, is_causal=True).float())

    def test_is_causal_and_mask_both_apply(self):
        q, k, v = qkv((2,), 5, 5, 8, 4, seed=10)
        pad = padding_mask([5, 3], 5)[:, None, :]  # (B, 1, S)
        combined = pad & causal_mask(5)
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=pad, is_causal=True)
        torch.testing.assert_close(out, reference(q, k, v, attn_mask=combined))
        assert (w[~combined.expand_as(w)] == 0).all()

    def test_is_causal_with_mask_that_empties_rows(self):
        # Query 0 may see only key 0 under the causal mask; a mask that also blocks key 0
        # leaves it nothing: zeros, not a uniform average over the future keys.
        q, k, v = qkv((1,), 4, 4, 8, 4, seed=23)
        block_first = torch.tensor([False, True, True, True])
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=block_first, is_causal=True)
        assert (w[0, 0] == 0).all() and (out[0, 0] == 0).all()
        expected = reference(q, k, v, attn_mask=block_first.expand(4, 4) & causal_mask(4))
        torch.testing.assert_close(out, expected)

    @pytest.mark.parametrize("scale", [0.1, 1.0, 2.5])
    def test_scale(self, scale):
        q, k, v = qkv((3,), 4, 4, 8, 8, seed=11)
        out, w = scaled_dot_product_attention(q, k, v, scale=scale)
        torch.testing.assert_close(out, reference(q, k, v, scale=scale))
        torch.testing.assert_close(w, reference_weights(q, k, scale=scale).float())

    def test_default_scale_is_one_over_sqrt_E(self):
        q, k, v = qkv((), 3, 3, 16, 2, seed=12)
        default = scaled_dot_product_attention(q, k, v)[1]
        explicit = scaled_dot_product_attention(q, k, v, scale=0.25)[1]
        unscaled = scaled_dot_product_attention(q, k, v, scale=1.0)[1]
        torch.testing.assert_close(default, explicit)
        assert not torch.allclose(default, unscaled)

    @pytest.mark.parametrize("mask_kind", ["bool", "float"])
    def test_fully_masked_rows_give_zeros(self, mask_kind):
        q, k, v = qkv((2,), 3, 4, 8, 5, seed=13)
        keep = torch.ones(2, 3, 4, dtype=torch.bool)
        keep[0, 1] = False
        keep[1, :] = False
        mask = keep if mask_kind == "bool" else torch.zeros(2, 3, 4).masked_fill(~keep, -math.inf)
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
        assert (out[0, 1] == 0).all() and (out[1] == 0).all()
        assert (w[0, 1] == 0).all() and (w[1] == 0).all()
        torch.testing.assert_close(out, reference(q, k, v, attn_mask=mask))

    @pytest.mark.parametrize("is_causal", [False, True])
    @pytest.mark.parametrize("L,S", [(3, 0), (0, 3), (0, 0)])
    def test_empty_sequences_match_torch(self, L, S, is_causal):
        q, k, v = qkv((2,), L, S, 4, 5, seed=24)
        out, w = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        assert out.shape == (2, L, 5) and w.shape == (2, L, S)
        # no keys: a zero output
        torch.testing.assert_close(out, reference(q, k, v, is_causal=is_causal))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision(self, dtype):
        q, k, v = qkv((2, 2), 6, 7, 16, 8, dtype=dtype, seed=14)
        mask = causal_mask(6, 7)
        mask[2] = False  # a fully masked row
        out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert out.dtype == dtype and w.dtype == dtype
        expected = reference(q.float(), k.float(), v.float(), attn_mask=mask)
        torch.testing.assert_close(out.float(), expected, **TOL[dtype])
        assert (out[..., 2, :] == 0).all()

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_large_scores_do_not_overflow(self, dtype):
        # Raw dot products near 64 * 40 * 40 = 102400 exceed float16's max (65504).
        q, k, v = qkv((1,), 4, 4, 64, 4, dtype=torch.float32, seed=15)
        q, k = (q.abs() * 40).to(dtype), (k.abs() * 40).to(dtype)
        v = v.to(dtype)
        out, w = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
        expected = reference(q.float(), k.float(), v.float(), is_causal=True)
        torch.testing.assert_close(out.float(), expected, **TOL[dtype])

    def test_float64(self):
        q, k, v = qkv((2,), 3, 4, 5, 6, dtype=torch.float64, seed=16)
        out, w = scaled_dot_product_attention(q, k, v)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, reference(q, k, v), **TOL[torch.float64])

    def test_gradients_match_torch(self):
        q, k, v = qkv((2,), 4, 5, 8, 3, dtype=torch.float64, seed=17)
        mask = causal_mask(4, 5)
        mask[0] = False  # include a fully masked row
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        g = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(18))
        (scaled_dot_product_attention(*mine, attn_mask=mask)[0] * g).sum().backward()
        (reference(*ref, attn_mask=mask) * g).sum().backward()
        for a, b in zip(mine, ref):
            assert torch.isfinite(a.grad).all()
            torch.testing.assert_close(a.grad, b.grad)

    def test_gradcheck(self):
        q, k, v = (t.requires_grad_() for t in qkv((1,), 3, 4, 2, 2, dtype=torch.float64, seed=19))
        mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
        assert torch.autograd.gradcheck(
            lambda a, b, c: scaled_dot_product_attention(a, b, c, attn_mask=mask)[0], (q, k, v)
        )

    def test_output_equals_weights_times_value(self):
        q, k, v = qkv((2,), 4, 5, 8, 3, seed=20)
        out, w = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.testing.assert_close(out, w @ v)

    def test_dropout_scales_survivors(self):
        torch.manual_seed(21)
        q, k, v = qkv((), 64, 64, 4, 4, seed=22)
        _, plain = scaled_dot_product_attention(q, k, v)
        _, dropped = scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        kept = dropped != 0
        assert 0.6 < kept.float().mean() < 0.9
        torch.testing.assert_close(dropped[kept], plain[kept] / 0.75)


# --------------------------------------------------------------------------- bad input


class TestErrors:
    def test_query_key_width_mismatch_names_shapes(self):
        q, k, v = torch.randn(3, 4), torch.randn(5, 6), torch.randn(5, 2)
        with pytest.raises(ValueError, match=r"\(3, 4\).*\(5, 6\).*\(5, 2\)"):
            scaled_dot_product_attention(q, k, v)

    def test_key_value_length_mismatch(self):
        with pytest.raises(ValueError, match=r"same length S.*\(5, 4\).*\(6, 4\)"):
            scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4), torch.randn(6, 4))

    def test_too_few_dims(self):
        with pytest.raises(ValueError, match="at least 2 dims"):
            scaled_dot_product_attention(torch.randn(4), torch.randn(5, 4), torch.randn(5, 4))

    def test_batch_dims_do_not_broadcast(self):
        with pytest.raises(ValueError, match="batch dims"):
            scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(3, 5, 4),
                                         torch.randn(3, 5, 4))

    def test_mixed_dtypes(self):
        with pytest.raises(ValueError, match="dtype"):
            scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4).double(),
                                         torch.randn(5, 4))

    def test_integer_inputs(self):
        with pytest.raises(ValueError, match="floating point"):
            scaled_dot_product_attention(torch.ones(3, 4, dtype=torch.long),
                                         torch.ones(5, 4, dtype=torch.long),
                                         torch.ones(5, 4, dtype=torch.long))

    @pytest.mark.parametrize("mask_shape", [(5, 3), (3, 4), (4, 3, 5), (2, 1, 3, 5)])
    def test_mask_that_does_not_broadcast(self, mask_shape):
        q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)
        mask = torch.ones(*mask_shape, dtype=torch.bool)
        with pytest.raises(ValueError, match=rf"attn_mask of shape {tuple(mask_shape)}".replace("(", r"\(").replace(")", r"\)")):
            scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def test_integer_mask(self):
        q, k, v = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4)
        with pytest.raises(ValueError, match="boolean.*or floating"):
            scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.long))

    @pytest.mark.parametrize("p", [-0.1, 1.0, 2.0])
    def test_bad_dropout(self, p):
        q, k, v = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4)
        with pytest.raises(ValueError, match="dropout_p"):
            scaled_dot_product_attention(q, k, v, dropout_p=p)

    def test_mha_bad_heads(self):
        with pytest.raises(ValueError, match="multiple of num_heads"):
            MultiHeadAttention(10, 3)

    @pytest.mark.parametrize("shapes,match", [
        (((2, 3, 8), (2, 4, 8), (2, 5, 8)), "same length S"),
        (((2, 3, 8), (1, 4, 8), (1, 4, 8)), "batch size"),
        (((2, 3, 6), (2, 4, 8), (2, 4, 8)), r"\(d_model, kdim, vdim\) = \(8, 8, 8\)"),
        (((3, 8), (4, 8), (4, 8)), "3-D"),
    ])
    def test_mha_bad_shapes(self, shapes, match):
        mha = MultiHeadAttention(8, 2)
        with pytest.raises(ValueError, match=match):
            mha(*(torch.randn(*s) for s in shapes))

    def test_mha_3d_mask_that_is_not_batch_times_heads(self):
        # (B, L, S) with B == H would otherwise broadcast over the heads, silently.
        mha = MultiHeadAttention(8, 2)
        x = torch.randn(2, 3, 8)
        with pytest.raises(ValueError, match=r"\(B \* num_heads, L, S\) = \(4, 3, 3\)"):
            mha(x, x, x, attn_mask=torch.ones(2, 3, 3, dtype=torch.bool))

    def test_mha_mask_that_does_not_broadcast(self):
        mha = MultiHeadAttention(8, 2)
        x = torch.randn(2, 3, 8)
        with pytest.raises(ValueError, match="attn_mask"):
            mha(x, x, x, attn_mask=torch.ones(2, 3, dtype=torch.bool))


# --------------------------------------------------------------------------- multi-head


def torch_mha(d_model, num_heads, bias=True, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True).eval()
    if bias:  # PyTorch initialises biases to zero; make them matter in the comparison
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m


class TestMultiHeadAttention:
    @pytest.mark.parametrize("d_model,num_heads", [(8, 1), (8, 2), (12, 3), (16, 4)])
    @pytest.mark.parametrize("bias", [True, False])
    def test_parameter_count(self, d_model, num_heads, bias):
        ref = torch.nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True)
        mine = MultiHeadAttention(d_model, num_heads, bias=bias)
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        assert count(mine) == count(ref) == 4 * d_model**2 + (4 * d_model if bias else 0)

    @pytest.mark.parametrize("num_heads", [1, 2, 4])
    @pytest.mark.parametrize("bias", [True, False])
    def test_self_attention_matches_torch(self, num_heads, bias):
        ref = torch_mha(16, num_heads, bias=bias, seed=num_heads)
        mine = MultiHeadAttention.from_torch(ref)
        x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(30))
        out_ref, w_ref = ref(x, x, x, average_attn_weights=False)
        out, w = mine(x, x, x)
        assert out.shape == (3, 5, 16) and w.shape == (3, num_heads, 5, 5)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_cross_attention_matches_torch(self):
        ref = torch_mha(12, 3, seed=31)
        mine = MultiHeadAttention.from_torch(ref)
        g = torch.Generator().manual_seed(32)
        x, z = torch.randn(2, 4, 12, generator=g), torch.randn(2, 7, 12, generator=g)
        out_ref, w_ref = ref(x, z, z, average_attn_weights=False)
        out, w = mine(x, z, z)
        assert w.shape == (2, 3, 4, 7)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_causal_mask_matches_torch(self):
        ref = torch_mha(8, 2, seed=33)
        mine = MultiHeadAttention.from_torch(ref)
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(34))
        keep = causal_mask(6)
        out_ref, w_ref = ref(x, x, x, attn_mask=~keep, average_attn_weights=False)  # True = blocked
        for kwargs in (dict(attn_mask=keep), dict(is_causal=True)):
            out, w = mine(x, x, x, **kwargs)
            torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_padding_mask_matches_torch_key_padding_mask(self):
        ref = torch_mha(8, 2, seed=35)
        mine = MultiHeadAttention.from_torch(ref)
        g = torch.Generator().manual_seed(36)
        x, z = torch.randn(3, 4, 8, generator=g), torch.randn(3, 6, 8, generator=g)
        keep = padding_mask([6, 2, 4], 6)  # (B, S)
        out_ref, w_ref = ref(x, z, z, key_padding_mask=~keep, average_attn_weights=False)
        out, w = mine(x, z, z, attn_mask=keep[:, None, None, :])
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_3d_mask_is_batch_times_heads_as_in_torch(self):
        ref = torch_mha(8, 2, seed=45)
        mine = MultiHeadAttention.from_torch(ref)
        g = torch.Generator().manual_seed(46)
        x = torch.randn(3, 4, 8, generator=g)
        keep = torch.rand(3 * 2, 4, 4, generator=g) > 0.3
        keep[..., 0] = True  # no empty rows: PyTorch's module gives NaN there
        out_ref, w_ref = ref(x, x, x, attn_mask=~keep, average_attn_weights=False)
        out, w = mine(x, x, x, attn_mask=keep)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_causal_and_padding_match_torch(self):
        ref = torch_mha(8, 4, seed=37)
        mine = MultiHeadAttention.from_torch(ref)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(38))
        pad = padding_mask([5, 3], 5)
        out_ref, w_ref = ref(x, x, x, attn_mask=~causal_mask(5), key_padding_mask=~pad,
                             average_attn_weights=False)
        out, w = mine(x, x, x, attn_mask=pad[:, None, None, :], is_causal=True)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)

    def test_fully_masked_query_gives_zero_attention(self):
        mha = MultiHeadAttention(8, 2).eval()
        x = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(39))
        keep = torch.ones(3, 3, dtype=torch.bool)
        keep[1] = False
        out, w = mha(x, x, x, attn_mask=keep)
        assert torch.isfinite(out).all()
        assert (w[:, :, 1] == 0).all()
        # The attended vector is zero, so the output row is just the output bias.
        torch.testing.assert_close(out[0, 1], mha.out_proj.bias)

    def test_gradients_match_torch(self):
        ref = torch_mha(8, 2, seed=40)
        mine = MultiHeadAttention.from_torch(ref)
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(41))
        ref(x, x, x, attn_mask=~causal_mask(4))[0].square().sum().backward()
        mine(x, x, x, is_causal=True)[0].square().sum().backward()
        D = 8
        for i, proj in enumerate((mine.q_proj, mine.k_proj, mine.v_proj)):
            torch.testing.assert_close(proj.weight.grad, ref.in_proj_weight.grad[i * D:(i + 1) * D])
            torch.testing.assert_close(proj.bias.grad, ref.in_proj_bias.grad[i * D:(i + 1) * D])
        torch.testing.assert_close(mine.out_proj.weight.grad, ref.out_proj.weight.grad)

    def test_from_torch_copies_not_shares(self):
        ref = torch_mha(8, 2, seed=42)
        mine = MultiHeadAttention.from_torch(ref)
        with torch.no_grad():
            mine.q_proj.weight.zero_()
        assert ref.in_proj_weight.abs().sum() > 0

    @pytest.mark.parametrize("kdim,vdim", [(6, 6), (6, 10), (8, 10)])
    def test_kdim_vdim_match_torch(self, kdim, vdim):
        torch.manual_seed(46)
        ref = torch.nn.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim, batch_first=True).eval()
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
        mine = MultiHeadAttention.from_torch(ref)
        assert (mine.k_proj.in_features, mine.v_proj.in_features) == (kdim, vdim)
        assert sum(p.numel() for p in mine.parameters()) == sum(
            p.numel() for p in ref.parameters())
        g = torch.Generator().manual_seed(47)
        q = torch.randn(2, 3, 8, generator=g)
        k = torch.randn(2, 5, kdim, generator=g)
        v = torch.randn(2, 5, vdim, generator=g)
        keep = torch.rand(2, 5, generator=g) > 0.3
        keep[:, 0] = True
        out, w = mine(q, k, v, attn_mask=keep[:, None, None, :])
        out_ref, w_ref = ref(q, k, v, key_padding_mask=~keep, average_attn_weights=False)
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(w, w_ref)

    def test_kdim_vdim_wrong_width_names_the_shapes(self):
        mha = MultiHeadAttention(8, 2, kdim=6, vdim=10)
        q, k = torch.randn(1, 3, 8), torch.randn(1, 5, 6)
        with pytest.raises(ValueError, match=r"\(d_model, kdim, vdim\) = \(8, 6, 10\)"):
            mha(q, k, torch.randn(1, 5, 8))

    def test_from_torch_rejects_unsupported(self):
        with pytest.raises(ValueError):
            MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
        with pytest.raises(TypeError):
            MultiHeadAttention.from_torch(torch.nn.Linear(8, 8))

    def test_arguments_after_num_heads_and_value_are_keyword_only(self):
        # nn.MultiheadAttention's fourth argument is key_padding_mask, ours would have been
        # attn_mask: a positional mask would silently mean something else.
        with pytest.raises(TypeError):
            MultiHeadAttention(8, 2, 0.1)
        mha = MultiHeadAttention(8, 2)
        x = torch.randn(1, 3, 8)
        with pytest.raises(TypeError):
            mha(x, x, x, torch.ones(3, 3, dtype=torch.bool))

    def test_dtype_and_device_place_the_parameters(self):
        mha = MultiHeadAttention(8, 2, dtype=torch.float64, device="cpu")
        assert {p.dtype for p in mha.parameters()} == {torch.float64}
        ref = torch_mha(8, 2, seed=44).double()
        mine = MultiHeadAttention.from_torch(ref)
        assert {p.dtype for p in mine.parameters()} == {torch.float64}
        x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(45))
        out, _ = mine(x, x, x)
        out_ref, _ = ref(x, x, x, need_weights=False)
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)

    def test_dropout_only_in_training(self):
        mha = MultiHeadAttention(8, 2, dropout=0.5)
        x = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(43))
        mha.eval()
        a, _ = mha(x, x, x)
        b, _ = mha(x, x, x)
        torch.testing.assert_close(a, b)
        mha.train()
        torch.manual_seed(44)
        _, w = mha(x, x, x)
        assert (w == 0).any()


# --------------------------------------------------------------------------- properties


dims = st.integers(min_value=1, max_value=6)


@settings(max_examples=40, deadline=None)
@given(L=dims, S=dims, E=dims, Ev=dims, seed=st.integers(0, 2**16))
def test_rows_sum_to_one(L, S, E, Ev, seed):
    q, k, v = qkv((2,), L, S, E, Ev, seed=seed, spread=3.0)
    _, w = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, L))
    assert (w >= 0).all()


@settings(max_examples=40, deadline=None)
@given(T=st.integers(2, 7), E=dims, seed=st.integers(0, 2**16))
def test_self_attention_is_permutation_equivariant(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g, dtype=torch.float64)
    perm = torch.randperm(T, generator=g)
    out, w = scaled_dot_product_attention(x, x, x)
    out_p, w_p = scaled_dot_product_attention(x[perm], x[perm], x[perm])
    torch.testing.assert_close(out_p, out[perm])
    torch.testing.assert_close(w_p, w[perm][:, perm])


@settings(max_examples=40, deadline=None)
@given(T=st.integers(2, 8), t=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_causal_outputs_ignore_future_tokens(T, t, seed):
    t = t % (T - 1)  # keep at least one future token to change
    g = torch.Generator().manual_seed(seed)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, T, 8, generator=g)
    changed = x.clone()
    changed[:, t + 1:] = torch.randn(1, T - t - 1, 8, generator=g) * 10
    with torch.no_grad():
        out, _ = mha(x, x, x, is_causal=True)
        out_changed, _ = mha(changed, changed, changed, is_causal=True)
    torch.testing.assert_close(out_changed[:, : t + 1], out[:, : t + 1])
    assert not torch.allclose(out_changed[:, t + 1:], out[:, t + 1:])


@settings(max_examples=30, deadline=None)
@given(L=dims, S=dims, seed=st.integers(0, 2**16))
def test_random_masks_match_torch(L, S, seed):
    q, k, v = qkv((2,), L, S, 4, 3, seed=seed)
    mask = torch.rand(2, L, S, generator=torch.Generator().manual_seed(seed)) > 0.5
    out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, reference(q, k, v, attn_mask=mask))
    assert torch.isfinite(w).all()
