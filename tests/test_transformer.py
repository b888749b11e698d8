"""code/transformer.py: the Transformer block against PyTorch's encoder layer."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import numerics
import stored
from attention import KVCache, causal_mask, padding_mask
from transformer import TransformerBlock

D, H, FF = 16, 4, 24


def torch_layer(norm_first: bool, activation: str, dtype=torch.float64, bias: bool = True,
                seed: int = 0) -> nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first, bias=bias,
                                       dtype=dtype)
    with torch.no_grad():  # layer norms away from their (1, 0) start, so that a swap shows
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            if norm.bias is not None:
                norm.bias.uniform_(-0.5, 0.5)
    return layer


ORDERS = pytest.mark.parametrize("norm_first", [True, False], ids=["pre-LN", "post-LN"])
ACTS = pytest.mark.parametrize("activation", ["relu", "gelu"])


@ORDERS
@ACTS
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_same_output_as_pytorch_unmasked_masked_and_causal(norm_first, activation, mode):
    layer = torch_layer(norm_first, activation)
    block = TransformerBlock.from_torch(layer)
    for module in (layer, block):
        module.train(mode == "train")
    x = torch.randn(3, 7, D, dtype=torch.float64)
    allowed = padding_mask([7, 4, 1], 7)  # (3, 7): True = may attend
    with torch.no_grad():
        torch.testing.assert_close(block(x), layer(x))
        causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
        torch.testing.assert_close(block(x, is_causal=True),
                                   layer(x, src_mask=causal, is_causal=True))
        torch.testing.assert_close(block(x, attn_mask=causal_mask(7)), layer(x, src_mask=causal))
        # PyTorch's boolean masks say True = blocked: the negation of the book's.
        torch.testing.assert_close(block(x, attn_mask=allowed[:, None, None, :]),
                                   layer(x, src_key_padding_mask=~allowed))


@ORDERS
@ACTS
def test_same_output_and_gradients_in_float32(norm_first, activation):
    layer = torch_layer(norm_first, activation, dtype=torch.float32)
    block = TransformerBlock.from_torch(layer)
    x = torch.randn(2, 5, D)
    ours, theirs = block(x, is_causal=True), layer(
        x, src_mask=nn.Transformer.generate_square_subsequent_mask(5), is_causal=True)
    torch.testing.assert_close(ours, theirs)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    torch.testing.assert_close(block.linear1.weight.grad, layer.linear1.weight.grad)
    torch.testing.assert_close(block.self_attn.q_proj.weight.grad,
                               layer.self_attn.in_proj_weight.grad[:D])


@ACTS
@pytest.mark.parametrize("bias", [True, False])
def test_same_number_of_parameters_as_pytorch(activation, bias):
    layer = torch_layer(True, activation, bias=bias)
    block = TransformerBlock(D, H, FF, activation=activation, bias=bias)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(block) == count(layer)
    # 4 D^2 + 2 D FF weights; biases 4 D + FF + D; two norms 2 D each (bias 0 without bias)
    assert count(block) == 4 * D * D + 2 * D * FF + bias * (4 * D + FF + D) + 2 * D * (1 + bias)


def test_the_two_orders_are_the_formulas_of_their_papers():
    torch.manual_seed(1)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    for norm_first in (True, False):
        b = TransformerBlock(D, H, FF, norm_first=norm_first, dtype=torch.float64)
        attn = lambda y: b.self_attn(y, y, y, is_causal=True)[0]  # noqa: E731
        mlp = lambda y: b.linear2(F.gelu(b.linear1(y)))  # noqa: E731
        if norm_first:
            y = x + attn(b.norm1(x))
            expected = y + mlp(b.norm2(y))
        else:
            y = b.norm1(x + attn(x))
            expected = b.norm2(y + mlp(y))
        torch.testing.assert_close(b(x, is_causal=True), expected)


def test_swiglu_gates_half_of_the_first_layer_with_silu():
    torch.manual_seed(2)
    b = TransformerBlock(D, H, FF, activation="swiglu", dtype=torch.float64)
    assert b.linear1.out_features == 2 * FF and b.linear2.in_features == FF
    x = torch.randn(1, 3, D, dtype=torch.float64)
    gate, value = b.linear1(x).split(FF, dim=-1)
    torch.testing.assert_close(b._mlp(x), b.linear2(F.silu(gate) * value))


def test_a_causal_block_ignores_the_future():
    torch.manual_seed(3)
    b = TransformerBlock(D, H, FF, dtype=torch.float64)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 4:] += torch.randn(1, 2, D, dtype=torch.float64)  # (a constant shift would
    # vanish in the layer norm)
    torch.testing.assert_close(b(x, is_causal=True)[:, :4], b(changed, is_causal=True)[:, :4])
    assert not torch.allclose(b(x)[:, :4], b(changed)[:, :4])


def test_weights_are_returned_on_request():
    b = TransformerBlock(D, H, FF)
    out, weights = b(torch.randn(2, 5, D), is_causal=True, need_weights=True)
    assert out.shape == (2, 5, D) and weights.shape == (2, H, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, 5))
    assert (weights.triu(1) == 0).all()


@pytest.mark.parametrize("chunks", [[6], [1] * 6, [2, 3, 1], [4, 2]])
def test_decoding_with_a_cache_equals_the_whole_sequence(chunks):
    torch.manual_seed(4)
    b = TransformerBlock(D, H, FF, dtype=torch.float64).eval()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    cache, outputs, start = KVCache(), [], 0
    for n in chunks:
        outputs.append(b(x[:, start:start + n], is_causal=True, cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(outputs, dim=1), b(x, is_causal=True))


def test_dropout_only_in_training():
    torch.manual_seed(5)
    b = TransformerBlock(D, H, FF, dropout=0.5)
    x = torch.randn(2, 5, D)
    b.eval()
    torch.testing.assert_close(b(x), b(x))
    b.train()
    assert not torch.allclose(b(x), b(x))


@pytest.mark.parametrize("x, message", [
    (torch.randn(5, D), r"\(B, T, d_model\) with d_model=16; got \(5, 16\)"),
    (torch.randn(2, 5, D + 1), r"got \(2, 5, 17\)"),
    ([[1.0] * D], r"got list"),
])
def test_bad_input_is_refused_naming_its_shape(x, message):
    with pytest.raises(ValueError, match=message):
        TransformerBlock(D, H, FF)(x)


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerBlock(D, H, FF, activation="tanh")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        TransformerBlock(D, 5, FF)
    with pytest.raises(ValueError, match="d_ff must be positive"):
        TransformerBlock(D, H, 0)


def test_from_torch_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="batch_first=True"):
        TransformerBlock.from_torch(nn.TransformerEncoderLayer(D, H, FF))
    with pytest.raises(ValueError, match="ReLU or the exact GELU"):
        TransformerBlock.from_torch(nn.TransformerEncoderLayer(
            D, H, FF, batch_first=True, activation=nn.GELU(approximate="tanh")))
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        TransformerBlock.from_torch(nn.Linear(D, D))


@ORDERS
@ACTS
def test_same_output_as_pytorchs_fused_inference_path(norm_first, activation):
    """In eval mode, under no_grad, in float32, PyTorch's encoder layer runs one fused kernel
    (its "fast path"); the block agrees with that too, with and without key padding."""
    layer = torch_layer(norm_first, activation, dtype=torch.float32).eval()
    block = TransformerBlock.from_torch(layer)
    x = torch.randn(3, 7, D)
    allowed = padding_mask([7, 4, 2], 7)
    with torch.no_grad():
        torch.testing.assert_close(block(x), layer(x))
        theirs = layer(x, src_key_padding_mask=~allowed)
        ours = block(x, attn_mask=allowed[:, None, None, :])
        if theirs.is_nested or theirs.shape != ours.shape:  # pragma: no cover - other versions
            theirs = torch.nested.to_padded_tensor(theirs, 0.0, ours.shape)
        keep = allowed[..., None]  # the fast path leaves zeros at padded positions
        torch.testing.assert_close(ours * keep, theirs * keep)


# --- DecoderLM ---------------------------------------------------------------------------------

from transformer import DecoderLM  # noqa: E402


def small_lm(norm_first=True, tie=False):
    torch.manual_seed(0)
    return DecoderLM(11, 12, D, H, FF, 3, norm_first=norm_first, tie_weights=tie,
                     dtype=torch.float64)


@ORDERS
def test_lm_is_causal_and_equals_its_blocks_by_hand(norm_first):
    lm = small_lm(norm_first)
    tokens = torch.randint(11, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = lm(tokens)
    assert logits.shape == (2, 9, 11)
    x = lm.embed.weight[tokens] + lm.position.weight[:9]
    for block in lm.blocks:
        x = block(x, attn_mask=causal_mask(9))
    want = (F.layer_norm(x, (D,), lm.final_norm.weight, lm.final_norm.bias) if norm_first
            else x) @ lm.unembed.weight.T
    torch.testing.assert_close(logits, want)
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11  # a later token changes no earlier prediction
    torch.testing.assert_close(lm(changed)[:, :5], logits[:, :5])
    assert not torch.allclose(lm(changed)[:, 5:], logits[:, 5:])


@ORDERS
def test_lm_decoding_with_caches_gives_the_full_computation_for_any_chunking(norm_first):
    lm = small_lm(norm_first)
    tokens = torch.randint(11, (2, 12), generator=torch.Generator().manual_seed(2))
    full = lm(tokens)
    for cuts in ([0, 5, 12], [0, 1, 2, 3, 7, 11, 12], [0, 12]):
        caches = lm.new_caches()
        parts = [lm(tokens[:, a:b], caches=caches) for a, b in zip(cuts, cuts[1:])]
        torch.testing.assert_close(torch.cat(parts, 1), full)


def test_lm_ties_the_unembedding_to_the_embedding():
    lm = small_lm(tie=True)
    assert lm.unembed.weight is lm.embed.weight
    n_untied = sum(p.numel() for p in small_lm().parameters())
    assert sum(p.numel() for p in lm.parameters()) == n_untied - 11 * D


@pytest.mark.parametrize("tokens, message", [
    (torch.zeros(2, 3, 4, dtype=torch.long), r"\(B, T\); got \(\(2, 3, 4\)"),
    (torch.zeros(2, 3), r"integer tokens of shape \(B, T\); got \(\(2, 3\), torch.float32"),
    (torch.zeros(1, 13, dtype=torch.long), r"positions 0..12 of tokens \(1, 13\) go past max_len=12"),
    (torch.full((1, 3), 11), r"tokens must lie in \[0, 11\); got values from 11 to 11"),
])
def test_lm_rejects_bad_tokens_naming_the_shapes(tokens, message):
    with pytest.raises(ValueError, match=message):
        small_lm()(tokens)


def test_lm_rejects_decoding_past_max_len_and_wrong_caches():
    lm = small_lm()
    caches = lm.new_caches()
    lm(torch.zeros(1, 10, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match=r"positions 10..12 of tokens \(1, 3\) go past max_len"):
        lm(torch.zeros(1, 3, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match="one KVCache per block \\(3\\), got 2"):
        lm(torch.zeros(1, 1, dtype=torch.long), caches=caches[:2])


@ORDERS
def test_lm_with_the_causal_mask_as_attn_mask_is_the_default(norm_first):
    lm = small_lm(norm_first)
    tokens = torch.randint(11, (2, 9), generator=torch.Generator().manual_seed(3))
    logits, weights = lm(tokens, need_weights=True)
    for mask in (causal_mask(9), causal_mask(9)[None, None],  # (T, T) and (1, 1, T, T)
                 torch.zeros(9, 9, dtype=torch.float64).masked_fill(~causal_mask(9),
                                                                    float("-inf"))):
        masked, masked_weights = lm(tokens, attn_mask=mask, need_weights=True)
        torch.testing.assert_close(masked, logits)
        for w, want in zip(masked_weights, weights):
            torch.testing.assert_close(w, want)


def test_lm_attn_mask_replaces_the_causal_mask_in_every_block():
    """A sliding window: the blocks by hand with the same mask, and the weights it leaves."""
    lm = small_lm()
    tokens = torch.randint(11, (2, 9), generator=torch.Generator().manual_seed(4))
    window = causal_mask(9, window=3)
    logits, weights = lm(tokens, attn_mask=window, need_weights=True)
    x = lm.embed.weight[tokens] + lm.position.weight[:9]
    for block in lm.blocks:
        x = block(x, attn_mask=window)
    want = F.layer_norm(x, (D,), lm.final_norm.weight, lm.final_norm.bias) @ lm.unembed.weight.T
    torch.testing.assert_close(logits, want)
    for w in weights:
        numerics.assert_same(w > 0, window.expand_as(w))  # exactly the window's keys (bools)
    assert not torch.allclose(logits[:, 3:], lm(tokens)[:, 3:])  # a query lost keys
    torch.testing.assert_close(logits[:, :3], lm(tokens)[:, :3])  # the first three did not
    # A per-sequence mask (B, 1, T, T): each sequence gets its own.
    both = torch.stack([causal_mask(9), window])[:, None]  # (2, 1, 9, 9)
    mixed = lm(tokens, attn_mask=both)
    torch.testing.assert_close(mixed[0], lm(tokens)[0])
    torch.testing.assert_close(mixed[1], logits[1])
    # Not causal: an earlier position now reads a later token.
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 11
    everything = torch.ones(9, 9, dtype=torch.bool)
    assert not torch.allclose(lm(changed, attn_mask=everything)[:, 0],
                              lm(tokens, attn_mask=everything)[:, 0])


@pytest.mark.parametrize("mask, message", [
    (causal_mask(8), r"must be \(T, T\) or 4-D, broadcasting to \(B, H, T, T\) = \(2, 4, 9, 9\)"
                     r" for tokens \(2, 9\); got \(8, 8\)"),
    (causal_mask(9)[None].expand(4, 9, 9), r"got \(4, 9, 9\)"),  # 3-D: refused
    (causal_mask(9)[None, None].expand(3, 1, 9, 9), r"got \(3, 1, 9, 9\)"),
    (causal_mask(9).long(), r"boolean \(True = may attend\) or floating .* got dtype torch.int64"),
    ([[True] * 9] * 9, r"must be a tensor, got list"),
])
def test_lm_rejects_a_bad_attn_mask_naming_the_shapes(mask, message):
    tokens = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        small_lm()(tokens, attn_mask=mask)


def test_lm_refuses_attn_mask_with_caches():
    lm = small_lm()
    with pytest.raises(ValueError, match="attn_mask or caches, not both"):
        lm(torch.zeros(1, 4, dtype=torch.long), caches=lm.new_caches(), attn_mask=causal_mask(4))


# --- chapter 11's experiments: the reversal task and the gradients at initialisation ---------

import transformer  # noqa: E402

TINY_REVERSAL = transformer.ReversalConfig(norm_first=False, warmup=3, vocab=5, half=3,
                                           d_model=8, num_heads=2, d_ff=16, num_layers=2,
                                           batch_size=4, steps=6, eval_size=8)
TINY_GRADIENTS = transformer.GradientConfig(depths=(1, 3), seeds=2, d_model=8, num_heads=2,
                                            n_classes=5, batch_size=2, length=3)


def test_a_reversal_sequence_is_tokens_the_separator_and_the_tokens_reversed():
    rows = transformer.reversal_batch(TINY_REVERSAL, torch.Generator().manual_seed(0))
    assert rows.shape == (4, 7) and int(rows[:, :3].max()) < 5
    numerics.assert_same(rows[:, 3], torch.full((4,), 5))  # the separator: token `vocab`
    numerics.assert_same(rows[:, 4:], rows[:, :3].flip(1))  # token ids
    assert transformer.reversal_batch(TINY_REVERSAL, torch.Generator(), batch=9).shape == (9, 7)


def test_the_reversal_rate_rises_over_the_warm_up_then_stays():
    rates = [TINY_REVERSAL.learning_rate(s) for s in range(6)]
    assert rates[:3] == pytest.approx([0.004 / 3, 0.008 / 3, 0.004]) and rates[3:] == [0.004] * 3
    at_once = transformer.ReversalConfig(warmup=0)
    assert {at_once.learning_rate(s) for s in range(60)} == {0.004}


def test_the_reversal_loss_is_the_cross_entropy_of_the_reversed_half():
    torch.manual_seed(0)
    model = transformer.reversal_model(TINY_REVERSAL)
    rows = transformer.reversal_batch(TINY_REVERSAL, torch.Generator().manual_seed(1))
    logits = model(rows[:, :-1])  # (4, 6, 6): row t predicts token t + 1
    want = F.cross_entropy(logits[:, 3:].reshape(-1, 6), rows[:, 4:].reshape(-1))
    numerics.assert_close(transformer.reversal_loss(model, rows, 3), want)
    assert model.blocks[0].linear1.weight.dtype == torch.float64 and not model.norm_first


def test_reversal_training_is_deterministic_and_until_gives_the_start_of_the_log():
    before = torch.random.get_rng_state()
    model, log = transformer.train_reversal(TINY_REVERSAL, 2)
    numerics.assert_same(torch.random.get_rng_state(), before)  # the global state: untouched
    again, log2 = transformer.train_reversal(TINY_REVERSAL, 2)
    assert log == log2 and len(log["loss"]) == len(log["lr"]) == 6
    assert log["eval"] == [{"step": 6, **transformer.evaluate_reversal(model, TINY_REVERSAL)}]
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        numerics.assert_same(a, b)  # the same computation on the same shapes, twice
    _, start = transformer.train_reversal(TINY_REVERSAL, 2, until=4)
    assert start == {"lr": log["lr"][:4], "loss": log["loss"][:4], "eval": []}
    with pytest.raises(ValueError, match=r"until must lie in \[0, 6\]"):
        transformer.train_reversal(TINY_REVERSAL, 2, until=7)


def test_the_evaluation_is_on_fixed_sequences():
    torch.manual_seed(0)
    model = transformer.reversal_model(TINY_REVERSAL)
    first = transformer.evaluate_reversal(model, TINY_REVERSAL)
    torch.randint(5, (100,))  # the global random state does not matter
    assert transformer.evaluate_reversal(model, TINY_REVERSAL) == first
    assert 0 <= first["accuracy"] <= 1 and first["accuracy"] * 24 == int(first["accuracy"] * 24)


def test_the_gradients_at_initialisation_are_one_per_block_and_deterministic():
    grads, rms = transformer.gradients_at_init(TINY_GRADIENTS, 3, True, 0)
    assert len(grads) == 3 and all(g > 0 for g in grads) and rms > 0
    assert transformer.gradients_at_init(TINY_GRADIENTS, 3, True, 0) == (grads, rms)
    measured = transformer.measure_gradients(TINY_GRADIENTS)
    assert list(measured) == ["post-LN", "pre-LN"] and list(measured["pre-LN"]) == ["1", "3"]
    assert measured["pre-LN"]["3"]["grads"][0] == grads and measured["pre-LN"]["3"]["rms"][0] == rms
    assert len(measured["post-LN"]["1"]["grads"]) == 2  # seeds


def test_scaled_initialisation_divides_the_residual_projections_by_sqrt_of_twice_the_depth():
    assert transformer.residual_scale(8) == 0.25 and transformer.residual_scale(2) == 0.5
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="depth must be a positive integer"):
            transformer.residual_scale(bad)
    scaled = dataclasses.replace(TINY_GRADIENTS, scaled=True)
    plain, rms = transformer.gradients_at_init(TINY_GRADIENTS, 3, True, 0)
    grads, scaled_rms = transformer.gradients_at_init(scaled, 3, True, 0)
    assert grads != plain and rms != scaled_rms  # another initialisation
    with pytest.raises(ValueError, match="GradientConfig.scaled must be True or False"):
        transformer.GradientConfig(scaled=1)
    # the blocks it measures: Glorot's matrices, W_O and W_down of each divided by sqrt(6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = nn.ModuleList(transformer.TransformerBlock(8, 2, 32, activation="relu",
                                                            dtype=torch.float64)
                               for _ in range(3))
        for p in blocks.parameters():
            if p.dim() > 1:
                torch.nn.init.xavier_uniform_(p)
    seen = []
    original = transformer.TransformerBlock.forward

    def spy(self, x, **kwargs):
        seen.append(self)
        return original(self, x, **kwargs)

    transformer.TransformerBlock.forward = spy
    try:
        transformer.gradients_at_init(scaled, 3, True, 0)
    finally:
        transformer.TransformerBlock.forward = original
    for ours, theirs in zip(seen, blocks):
        for name in ("self_attn.out_proj.weight", "linear2.weight"):
            numerics.assert_close(ours.get_parameter(name).detach(),
                                  theirs.get_parameter(name).detach() / math.sqrt(6))
        numerics.assert_close(ours.linear1.weight.detach(), theirs.linear1.weight.detach())


def test_the_configs_are_checked():
    with pytest.raises(ValueError, match=r"ReversalConfig.half must be a positive integer"):
        transformer.ReversalConfig(half=0)
    with pytest.raises(ValueError, match=r"warmup must be an integer >= 0"):
        transformer.ReversalConfig(warmup=-1)
    with pytest.raises(ValueError, match=r"GradientConfig.seeds must be a positive integer"):
        transformer.GradientConfig(seeds=True)
    config = transformer.ReversalConfig.from_dict({"betas": [0.9, 0.98], "norm_first": True})
    assert config.betas == (0.9, 0.98) and config.norm_first


def test_saved_experiments_load_with_their_weights_and_logs(tmp_path):
    model, log = transformer.train_reversal(TINY_REVERSAL, 0)
    with pytest.raises(ValueError, match="saved with its model"):
        transformer.save_run(tmp_path, "tiny", TINY_REVERSAL, 0, log)
    record = transformer.save_run(tmp_path, "tiny", TINY_REVERSAL, 0, log, model, cpu_seconds=1.5)
    assert record["kind"] == "reversal" and record["torch"] == torch.__version__
    run = transformer.load_run("tiny", tmp_path)
    assert (run.config, run.seed, run.log, run.cpu_seconds) == (TINY_REVERSAL, 0, log, 1.5)
    assert not run.model.training
    for a, b in zip(run.model.state_dict().values(), model.state_dict().values()):
        numerics.assert_same(a, b)  # a copy, through the file
    measured = transformer.measure_gradients(TINY_GRADIENTS)
    transformer.save_run(tmp_path, "grads", TINY_GRADIENTS, None, measured)
    run = transformer.load_run("grads", tmp_path)
    assert run.kind == "gradients" and run.model is None and run.log == measured
    state = torch.load(tmp_path / "grads.pt", weights_only=True)
    state["pre-LN/3/rms"][0] += 1.0  # tensors that are not the log's, under a matching hash
    torch.save(state, tmp_path / "grads.pt")
    record = json.loads((tmp_path / "grads.json").read_text())
    record["sha256"] = stored.sha256(tmp_path / "grads.pt")
    (tmp_path / "grads.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not hold the numbers of grads.json's log"):
        transformer.load_run("grads", tmp_path)
    with pytest.raises(TypeError, match="ReversalConfig or a GradientConfig"):
        transformer.save_run(tmp_path, "x", object(), 0, {})
