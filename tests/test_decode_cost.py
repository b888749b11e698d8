"""code/decode_cost.py: a whole model's decoding step, counted by hand, against the book's
modules (FlopCounterMode's multiply-adds, their parameters and caches) and against published
parameter counts; the critical batch against the intensity it is defined by."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from attention import KVCache, MultiHeadAttention
from decode_cost import (A100, DecoderConfig, Machine, critical_batch, decode_step,
                         fitting_batch, longest_context, parameter_count, roofline_time)
from transformer import DecoderLM

F64 = torch.float64

# A small configuration whose counts are worked out by hand below: 2 layers, d_model 8,
# H = 2 query heads and G = 1 key-value head of width 4, a gated MLP of width 12, 10 tokens.
SMALL = DecoderConfig("small", n_layers=2, d_model=8, num_heads=2, num_kv_heads=1, d_ff=12,
                      gated=True, n_vocab=10)


def llama_hidden_width(d_model: int, multiple_of: int = 256) -> int:
    """The reference code's SwiGLU width: two thirds of 4 d_model, rounded up to 256."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def llama(name: str, n_layers: int, d_model: int, num_heads: int) -> DecoderConfig:
    """LLaMA (Touvron et al. 2023, Table 2): multi-head attention, SwiGLU, RMSNorm, untied
    readout, no biases, a vocabulary of 32,000."""
    return DecoderConfig(name, n_layers, d_model, num_heads, num_heads,
                         llama_hidden_width(d_model), True, 32000)


def macs_of(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2


def test_the_small_configuration_counted_by_hand():
    # Attention: W_Q and W_O 8 x 8 = 64 each, W_K and W_V 8 x 4 = 32 each: 192.
    # MLP: three 8 x 12 matrices: 288. Readout: 8 x 10 = 80. Model: 2 (192 + 288) + 80 = 1040.
    assert (SMALL.head_dim, SMALL.attention_weights, SMALL.mlp_weights) == (4, 192, 288)
    assert (SMALL.readout_weights, SMALL.weights) == (80, 1040)
    # B = 3 sequences of t = 5 keys, 2 bytes a number. Attention of one layer: 3 * 192 projection
    # multiply-adds and 2 * 3 * 5 * 2 * 4 = 240 for the scores and the sum; its cache 2 * 3 * 5
    # * 1 * 4 = 120 numbers.
    attention = decode_step(SMALL, 3, 5, scope="attention")
    assert (attention.macs, attention.weight_bytes, attention.cache_bytes) == (816, 384, 240)
    mlp = decode_step(SMALL, 3, 5, scope="mlp")
    assert (mlp.macs, mlp.weight_bytes, mlp.cache_bytes) == (864, 576, 0)
    layer = decode_step(SMALL, 3, 5, scope="layer")
    assert (layer.macs, layer.weight_bytes, layer.cache_bytes) == (1680, 960, 240)
    model = decode_step(SMALL, 3, 5)
    assert (model.macs, model.weight_bytes, model.cache_bytes) == (2 * 1680 + 240, 2080, 480)
    assert model.bytes == 2560 and model.intensity == Fraction(3600, 2560)
    # Parameters: per layer 192 + 288 + two RMSNorm gains of 8; a final gain; embedding 80 and an
    # untied readout 80.
    assert parameter_count(SMALL) == 2 * (192 + 288 + 16) + 8 + 80 + 80
    assert SMALL.cache_per_position() == 2 * 2 * 1 * 4 * 2


def test_a_plain_mlp_has_two_matrices_and_biases_and_norms_count_as_stated():
    plain = DecoderConfig("plain", 1, 8, 2, 2, 32, False, 10, tied=True, norm_params=2,
                          bias=True, n_positions=6)
    assert plain.mlp_weights == 2 * 8 * 32 and plain.attention_weights == 4 * 64
    # 4 d^2 + 4 d (attention) + 2 d d_ff + d_ff + d (MLP) + 4 d (norms), as chapter 11's
    # eq-block-params; a final LayerNorm 2 d; tokens and positions (10 + 6) d; the readout tied.
    assert parameter_count(plain) == (4 * 64 + 32 + 2 * 8 * 32 + 32 + 8 + 32) + 16 + 16 * 8


@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("B,t", [(1, 1), (2, 9), (3, 30)])
def test_one_layers_attention_is_what_the_module_computes(G, B, t):
    config = DecoderConfig("layer", 1, 16, 4, G, 8, False, 5)
    layer = MultiHeadAttention(16, 4, num_kv_heads=G, bias=False, dtype=F64)
    x = torch.randn(B, t, 16, dtype=F64, generator=torch.Generator().manual_seed(t))
    cache = KVCache()
    with torch.no_grad():
        if t > 1:
            layer(x[:, :-1], x[:, :-1], x[:, :-1], is_causal=True, cache=cache)
    new = x[:, -1:]
    macs = macs_of(lambda: layer(new, new, new, is_causal=True, cache=cache))
    step = decode_step(config, B, t, n_bytes=8, scope="attention")
    assert macs == step.macs
    assert step.weight_bytes == sum(p.nbytes for p in layer.parameters())
    assert step.cache_bytes == cache.keys.nbytes + cache.values.nbytes


@pytest.mark.parametrize("activation,gated", [("swiglu", True), ("gelu", False)])
@pytest.mark.parametrize("tied", [False, True])
def test_a_whole_decoder_step_and_its_parameters_are_what_the_module_has(activation, gated, tied):
    vocab, max_len, d, H, d_ff, layers = 40, 16, 24, 3, 64, 2
    torch.manual_seed(0)
    net = DecoderLM(vocab, max_len, d, H, d_ff, layers, activation=activation,
                    tie_weights=tied, dtype=F64).eval()
    config = DecoderConfig("lm", layers, d, H, H, d_ff, gated, vocab, tied=tied, norm_params=2,
                           bias=True, n_positions=max_len)
    assert parameter_count(config) == sum(p.numel() for p in net.parameters())
    tokens = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    caches = net.new_caches()
    with torch.no_grad():
        net(tokens[:, :-1], caches=caches)
    macs = macs_of(lambda: net(tokens[:, -1:], caches=caches))
    step = decode_step(config, 3, 9, n_bytes=8)
    matrices = sum(m.weight.numel() for m in net.modules() if isinstance(m, nn.Linear))
    assert (macs, step.weight_bytes) == (step.macs, 8 * matrices)
    assert step.cache_bytes == sum(c.keys.nbytes + c.values.nbytes for c in caches)


def test_llama_parameter_counts_are_those_of_its_table():
    """Touvron et al. (2023), Table 2, prints 6.7B, 13.0B, 32.5B and 65.2B: the counts cut off
    after the first decimal (65.29 billion is printed 65.2)."""
    table = {("7B", 32, 4096, 32): "6.7", ("13B", 40, 5120, 40): "13.0",
             ("33B", 60, 6656, 52): "32.5", ("65B", 80, 8192, 64): "65.2"}
    for (name, layers, d, H), printed in table.items():
        config = llama(name, layers, d, H)
        count = parameter_count(config)
        assert f"{count // 10**8 / 10:.1f}" == printed, (name, count)
    # By hand for the 7B model (the size of Llama 2 7B too): 32 layers of 4 * 4096^2 attention,
    # 3 * 4096 * 11008 MLP and two gains of 4096, a final gain, embedding and readout
    # 32000 x 4096 each.
    seven = llama("7B", 32, 4096, 32)
    assert seven.d_ff == 11008 and llama("65B", 80, 8192, 64).d_ff == 22016
    assert parameter_count(seven) == (32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096)
                                      + 4096 + 2 * 32000 * 4096) == 6_738_415_616


def test_the_critical_batch_is_the_first_batch_at_the_balance():
    machines = [A100, Machine("TPU v4", 275 * 10**12, 1200 * 10**9, 32 * 2**30),
                Machine("slow memory", 10**12, 10**9, 10**9)]
    configs = [SMALL, llama("7B", 32, 4096, 32),
               DecoderConfig("gqa", 32, 4096, 32, 8, 14336, True, 128000)]
    for machine in machines:
        for config in configs:
            for t in (1, 64, 512, 4096, 65536):
                for cache in (True, False):
                    B = critical_batch(config, t, machine, cache=cache)

                    def reaches(batch):
                        step = decode_step(config, batch, t)
                        read = step.bytes if cache else step.weight_bytes
                        return Fraction(step.macs, read) >= machine.balance

                    if B is None:
                        assert cache and not reaches(10**9)
                    else:
                        assert reaches(B) and (B == 1 or not reaches(B - 1))
            longest = longest_context(config, machine)
            if longest is not None:  # a batch exists up to `longest`, none after it
                assert longest == 0 or critical_batch(config, longest, machine) is not None
                assert critical_batch(config, longest + 1, machine) is None


def test_without_the_cache_the_critical_batch_is_at_most_the_weights_one():
    """Each weight does one multiply-add per sequence: the weights alone reach the balance at
    B = ceil(n_bytes I_hw), whatever the model; attention's multiply-adds only lower it."""
    weights_batch = math.ceil(2 * A100.balance)
    assert weights_batch == 154  # 312 TFLOP/s over 2 x 2,039 GB/s, in 2-byte numbers
    seven = llama("7B", 32, 4096, 32)
    previous = None
    for t in (1, 16, 256, 4096, 65536):
        B = critical_batch(seven, t, A100, cache=False)
        assert B <= weights_batch and (previous is None or B <= previous)
        previous = B
    assert critical_batch(seven, 1, A100, scope="mlp") == weights_batch


def test_the_longest_context_vanishes_with_few_key_value_heads_and_is_none_with_enough():
    seven = llama("7B", 32, 4096, 32)
    t_max = longest_context(seven, A100)
    # c_model / (2 n_layers d_h (I_hw n_bytes G - H)), the first length with no batch.
    bound = Fraction(seven.weights) / (2 * 32 * 128 * (2 * A100.balance * 32 - 32))
    assert t_max == math.ceil(bound) - 1 and critical_batch(seven, t_max + 1, A100) is None
    # A machine whose balance attention alone reaches (H >= I_hw n_bytes G): every length.
    light = Machine("light", 2 * 10**12, 10**12, 10**12)  # balance 1 multiply-add per byte
    assert longest_context(DecoderConfig("mqa", 2, 64, 8, 1, 128, True, 10), light) is None


def test_roofline_time_and_fitting_batch():
    c = DecoderConfig("gqa", 32, 4096, 32, 8, 14336, True, 128000)
    compute, memory = roofline_time(c, A100, 1, 1)
    step = decode_step(c, 1, 1)
    assert compute == 2 * step.macs / A100.flops and memory == step.bytes / A100.bandwidth
    one, big = (max(roofline_time(c, A100, B, 8192)) for B in (1, 4096))
    assert big / 4096 < one  # a batch shares the weights' reading ...
    ceiling = A100.bandwidth / (c.cache_per_position() * 8192)
    assert 4096 / big < ceiling  # ... but each sequence reads its own cache
    B = fitting_batch(c, A100, 8192)
    room = A100.memory - 2 * parameter_count(c)
    assert B * c.cache_per_position() * 8192 <= room < (B + 1) * c.cache_per_position() * 8192
    huge = DecoderConfig("huge", 126, 16384, 128, 8, 53248, True, 128000)
    assert fitting_batch(huge, A100, 1) == 0  # 800 GB of weights in 80 GB


@pytest.mark.parametrize("field,value,message", [
    ("n_layers", 0, "n_layers must be a positive integer, got 0"),
    ("d_model", 7.5, "d_model must be a positive integer, got 7.5"),
    ("num_heads", True, "num_heads must be a positive integer, got True"),
    ("num_kv_heads", 3, "num_kv_heads=3 must divide num_heads=2"),
    ("d_ff", -4, "d_ff must be a positive integer, got -4"),
    ("gated", 1, "gated must be True or False, got 1"),
    ("norm_params", 3, r"norm_params must be 1 \(RMSNorm\) or 2 \(LayerNorm\), got 3"),
    ("n_positions", -1, "n_positions must be a whole number >= 0, got -1"),
])
def test_a_bad_configuration_is_refused_naming_the_value(field, value, message):
    sizes = dict(name="bad", n_layers=2, d_model=8, num_heads=2, num_kv_heads=1, d_ff=12,
                 gated=True, n_vocab=10)
    sizes[field] = value
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**sizes)
    with pytest.raises(ValueError, match="d_model=10 is not a multiple of num_heads=4"):
        DecoderConfig("odd", 1, 10, 4, 4, 8, True, 5)


@pytest.mark.parametrize("kwargs,message", [
    ({"batch": 0}, "batch must be a positive integer, got 0"),
    ({"length": 2.0}, "length must be a positive integer, got 2.0"),
    ({"n_bytes": 0}, "n_bytes must be a positive integer, got 0"),
    ({"scope": "block"}, "scope must be one of .*, got 'block'"),
])
def test_a_bad_step_is_refused_naming_the_value(kwargs, message):
    args = {"batch": 1, "length": 1, **kwargs}
    scope = {"scope": args.pop("scope")} if "scope" in args else {}
    with pytest.raises(ValueError, match=message):
        decode_step(SMALL, args.pop("batch"), args.pop("length"), **args, **scope)
    with pytest.raises(ValueError, match="bandwidth must be a positive integer, got 0"):
        Machine("none", 10**12, 0, 10**9)
