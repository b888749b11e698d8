"""code/induction.py: the data, the scores on hand-made attention patterns, the ablation, the
losses, training's determinism, loading a run (its hash checked, fetched when not here), and
bad input refused with a message that names the shapes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import induction as ind
import numerics
from attention import scaled_dot_product_attention

torch.set_num_threads(1)

CONFIG = ind.Config()
FIXED = ind.Config(train_lengths=(12, 12), heldout_lengths=(3, 8))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def model(config=CONFIG, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ind.AttentionOnly(config)


# --- the data -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, lengths", [(CONFIG, (3, 8)), (CONFIG, (9, 12)), (FIXED, (12, 12)),
                                             (ind.Config(n_tokens=10, train_lengths=(2, 5),
                                                         heldout_lengths=(2, 5)), (2, 5))])
def test_the_second_copy_equals_the_first_and_everything_is_within_range(config, lengths):
    batch = ind.make_batch(500, config, lengths, gen(1))
    tokens, first, second, length = batch.tokens, batch.first, batch.second, batch.length
    assert tokens.shape == (500, config.n_tokens + 1)
    assert (tokens[:, 0] == config.vocab_size).all()  # BOS
    assert ((tokens[:, 1:] >= 0) & (tokens[:, 1:] < config.vocab_size)).all()
    assert ((length >= lengths[0]) & (length <= lengths[1])).all()
    assert set(length.tolist()) == set(range(lengths[0], lengths[1] + 1))  # every length drawn
    assert (first >= 1).all() and (second >= first + length).all()
    assert (second + length - 1 <= config.n_tokens).all()  # the last copied token is in
    for row, p1, p2, n in zip(tokens, first.tolist(), second.tolist(), length.tolist()):
        numerics.assert_same(row[p1:p1 + n], row[p2:p2 + n])  # token ids
    if lengths[1] < config.n_tokens // 2:  # room to move: the positions and the gap vary
        assert len(set(first.tolist())) > 3 and len(set((second - first - length).tolist())) > 3


def test_a_segment_of_half_the_sequence_sits_at_fixed_positions():
    batch = ind.make_batch(100, FIXED, (12, 12), gen(2))
    assert set(batch.first.tolist()) == {1} and set(batch.second.tolist()) == {13}


def test_each_copyable_target_is_the_token_after_the_earlier_occurrence():
    batch = ind.make_batch(300, CONFIG, (3, 8), gen(3))
    copyable = batch.copyable()
    numerics.assert_same(copyable.sum(1), batch.length - 1)  # counts
    b, i = copyable.nonzero(as_tuple=True)
    key = i - (batch.second - batch.first)[b] + 1
    numerics.assert_same(batch.targets[b, i], batch.tokens[b, key])  # token ids
    numerics.assert_same(batch.inputs[b, i], batch.tokens[b, key - 1])  # the earlier occurrence


def test_batches_and_evaluation_sets_are_deterministic():
    one, two = ind.make_batch(8, CONFIG, (3, 8), gen(4)), ind.make_batch(8, CONFIG, (3, 8), gen(4))
    for f in dataclasses.fields(ind.Batch):  # integers, drawn alike
        numerics.assert_same(getattr(one, f.name), getattr(two, f.name))
    sets = ind.evaluation_sets(CONFIG)
    assert len(sets["train"]) == len(sets["heldout"]) == CONFIG.eval_size
    assert sets["heldout"].length.min() >= 9 and sets["train"].length.max() <= 8
    numerics.assert_same(sets["train"].tokens, ind.evaluation_sets(CONFIG)["train"].tokens)


# --- the scores on hand-made patterns -----------------------------------------------------------

def causal_uniform(B, H, T):
    w = torch.ones(T, T, dtype=torch.float64).tril()
    return (w / w.sum(-1, keepdim=True)).expand(B, H, T, T).clone()


def previous_token_pattern(T):
    w = torch.zeros(T, T, dtype=torch.float64)
    w[0, 0] = 1.0
    w[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    return w


def test_previous_token_score_on_hand_made_patterns():
    T = 7
    weights = torch.stack([previous_token_pattern(T), torch.eye(T, dtype=torch.float64),
                           causal_uniform(1, 1, T)[0, 0]])[None].expand(3, 3, T, T)
    score = ind.previous_token_score(weights)
    expected_uniform = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    torch.testing.assert_close(score, torch.tensor([1.0, 0.0, expected_uniform],
                                                   dtype=torch.float64))


def test_induction_score_on_hand_made_patterns():
    batch = ind.make_batch(40, CONFIG, (3, 8), gen(5))
    B, T = len(batch), CONFIG.n_tokens
    induction = causal_uniform(B, 1, T)
    duplicate = causal_uniform(B, 1, T)  # on the earlier occurrence itself, one too early
    b, i = batch.copyable().nonzero(as_tuple=True)
    key = i - (batch.second - batch.first)[b] + 1
    for w, k in ((induction, key), (duplicate, key - 1)):
        w[b, 0, i, :] = 0.0
        w[b, 0, i, k] = 1.0
    weights = torch.cat([induction, duplicate, causal_uniform(B, 1, T)], dim=1)  # (B, 3, T, T)
    score = ind.induction_score(weights, batch.first, batch.second, batch.length)
    assert score.shape == (3,)
    numerics.assert_close(score[:2], torch.tensor([1.0, 0.0], dtype=torch.float64))
    # uniform weights: each copyable query i puts 1 / (i + 1) on its key; one mean over all
    torch.testing.assert_close(score[2], (1.0 / (i + 1).double()).mean())


def test_induction_score_by_loops_on_random_weights():
    batch = ind.make_batch(12, CONFIG, (3, 8), gen(6))
    weights = torch.rand(12, 2, CONFIG.n_tokens, CONFIG.n_tokens, generator=gen(7),
                         dtype=torch.float64)
    total, count = torch.zeros(2, dtype=torch.float64), 0
    for s in range(12):
        p1, p2, n = int(batch.first[s]), int(batch.second[s]), int(batch.length[s])
        for i in range(p2, p2 + n - 1):
            total += weights[s, :, i, i - (p2 - p1) + 1]
            count += 1
    torch.testing.assert_close(ind.induction_score(weights, batch.first, batch.second,
                                                   batch.length), total / count)


def test_scores_of_a_real_layer_are_one_number_per_head():
    m = model(ind.Config(n_heads=2))
    batch = ind.make_batch(5, m.config, (3, 8), gen(8))
    _, weights = m(batch.inputs)
    assert [tuple(w.shape) for w in weights] == [(5, 2, 24, 24)] * 2
    for w in weights:
        assert ind.previous_token_score(w).shape == (2,)
        assert ind.induction_score(w, batch.first, batch.second, batch.length).shape == (2,)


# --- the model and the ablation -----------------------------------------------------------------

def test_the_model_is_attention_added_to_the_stream():
    m = model()
    tokens = ind.make_batch(3, CONFIG, (3, 8), gen(9)).inputs
    logits, weights = m(tokens)
    x = m.stream(tokens)
    for layer, w in zip(m.layers, weights):
        q, k, v = (layer.split_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        heads, expected = scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(w, expected)
        x = x + layer.out_proj(layer.merge_heads(heads))
    torch.testing.assert_close(logits, m.unembed(x))
    assert logits.dtype == torch.float64 and logits.shape == (3, 24, CONFIG.vocab_size)
    assert sum(p.numel() for p in m.parameters()) == (33 + 24) * 32 + 2 * 4 * 32 * 32 + 32 * 32


def test_ablating_a_layers_only_head_removes_the_layer():
    m = model()
    tokens = ind.make_batch(4, CONFIG, (3, 8), gen(10)).inputs
    without = ind.ablate(m, [(0, 0)])
    logits, weights = without(tokens)
    x = m.stream(tokens)
    out, w1 = m.layers[1](x, x, x, is_causal=True)  # layer 1 reads the embeddings alone
    torch.testing.assert_close(logits, m.unembed(x + out))
    torch.testing.assert_close(weights[1], w1)
    torch.testing.assert_close(weights[0], m(tokens)[1][0])  # its pattern is unchanged
    assert m.layers[0].out_proj.weight.abs().sum() > 0  # the original is untouched


def test_ablating_one_of_two_heads_zeroes_that_heads_output_only():
    m = model(ind.Config(n_heads=2, n_layers=1))
    tokens = ind.make_batch(4, m.config, (3, 8), gen(11)).inputs
    layer = m.layers[0]
    x = m.stream(tokens)
    q, k, v = (layer.split_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    heads, _ = scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, 2, T, 16)
    heads = heads * torch.tensor([1.0, 0.0], dtype=torch.float64)[:, None, None]
    expected = m.unembed(x + layer.out_proj(layer.merge_heads(heads)))
    torch.testing.assert_close(ind.ablate(m, [(0, 1)])(tokens)[0], expected)


def test_repeated_loss_and_the_copy_reference():
    batch = ind.make_batch(16, CONFIG, (3, 8), gen(12))
    logits = torch.randn(16, 24, 32, generator=gen(13), dtype=torch.float64)
    mask = batch.copyable()
    expected = F.cross_entropy(logits[mask], batch.targets[mask])
    torch.testing.assert_close(ind.repeated_loss(logits, batch), expected)
    # a sequence whose tokens never recur by chance: copying is certain, the reference is 0
    tokens = torch.tensor([[32, 0, 1, 2, 3, 4, 5, 0, 1, 2, 6]])
    clean = ind.Batch(tokens, torch.tensor([1]), torch.tensor([7]), torch.tensor([3]))
    assert ind.copy_reference_loss(clean) == 0.0
    # token 0 also at position 5, followed by 9: two candidates after it, one right
    tokens = torch.tensor([[32, 0, 1, 2, 3, 0, 9, 0, 1, 2, 6]])
    twice = ind.Batch(tokens, torch.tensor([1]), torch.tensor([7]), torch.tensor([3]))
    assert math.isclose(ind.copy_reference_loss(twice), math.log(2) / 2)


def test_training_is_deterministic_and_logs_every_record():
    config = ind.Config(steps=25, log_every=25, eval_size=32)
    (m1, log1), (m2, log2) = ind.train(config, 3), ind.train(config, 3)
    assert log1 == log2 and [r["step"] for r in log1] == [0, 25]
    assert set(log1[0]) == {"step", "loss", "heldout_loss", "previous_token", "induction"}
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        numerics.assert_same(a, b)  # the same computation on the same shapes, twice
    assert ind.phase_change_step(log1, 10.0) == 0 and ind.phase_change_step(log1, 0.0) is None


# --- saving and loading a run -------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("repo") / "models" / "induction"
    config = ind.Config(steps=0, eval_size=8)
    m, log = ind.train(config, 0)
    ind.save_run(folder, "tiny", config, 0, m, log)
    return folder, m, log


def test_a_saved_run_loads_with_its_weights_and_log(saved):
    folder, m, log = saved
    run = ind.load_run("tiny", folder)
    assert run.log == log and run.seed == 0 and run.config.steps == 0
    for a, b in zip(run.model.state_dict().values(), m.state_dict().values()):
        numerics.assert_same(a, b)  # a copy, through the file
    record = json.loads((folder / "tiny.json").read_text())
    assert record["torch"] == torch.__version__ and len(record["sha256"]) == 64


def test_a_run_is_fetched_from_beside_the_code_folder(saved, tmp_path, monkeypatch):
    folder, m, log = saved
    here = tmp_path / "alone"
    monkeypatch.setenv(ind.CODE_URL, (folder.parent.parent / "code").as_uri())
    run = ind.load_run("tiny", here)  # fetched into an empty folder
    assert run.log == log and sorted(p.name for p in here.iterdir()) == ["tiny.json", "tiny.pt"]
    monkeypatch.delenv(ind.CODE_URL)
    assert ind.load_run("tiny", here).log == log  # there now: no fetch
    with pytest.raises(RuntimeError, match="ATTENTION_CODE_URL is not set"):
        ind.load_run("other", here)
    monkeypatch.setenv(ind.CODE_URL, (tmp_path / "nowhere" / "code").as_uri())
    with pytest.raises(RuntimeError, match=r"could not fetch .*nowhere/models/induction/other"):
        ind.load_run("other", here)


def test_weights_that_do_not_match_their_hash_are_refused(saved, tmp_path):
    folder, _, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    state = torch.load(copy / "tiny.pt", weights_only=True)
    state["unembed.weight"][0, 0] += 1.0
    torch.save(state, copy / "tiny.pt")
    with pytest.raises(ValueError, match="SHA-256 .* but tiny.json records"):
        ind.load_run("tiny", copy)


# --- bad input ----------------------------------------------------------------------------------

def test_bad_input_is_refused_naming_the_shapes():
    w = causal_uniform(2, 1, 6)
    one = torch.tensor([1, 1])
    cases = [
        (lambda: ind.previous_token_score(w[0]), "\\(B, H, T, T\\) .* shape \\(1, 6, 6\\)"),
        (lambda: ind.previous_token_score(w[..., :5]), "shape \\(2, 1, 6, 5\\)"),
        (lambda: ind.previous_token_score(w[:, :, :1, :1]), "no previous position"),
        (lambda: ind.induction_score(w, torch.tensor([1]), one + 2, one + 1),
         "first \\(1,\\), second \\(2,\\)"),
        (lambda: ind.induction_score(w, one, one + 1, one + 1), "first \\+ length <= second"),
        (lambda: ind.induction_score(w, one, one + 3, one + 3), "second \\+ length - 1 <= T"),
        (lambda: ind.ablate(model(), [(2, 0)]), "no head \\(2, 0\\): the model has 2 layers"),
        (lambda: model()(torch.zeros(2, 25, dtype=torch.long)), "T must lie in 1..24"),
        (lambda: model()(torch.full((1, 3), 33)), "tokens must lie in 0..32"),
        (lambda: model()(torch.zeros(2, 3)), "integer tokens of shape \\(B, T\\)"),
        (lambda: ind.Config(train_lengths=(3, 13)), "two copies of the longest"),
        (lambda: ind.Config(steps=810), "multiple of log_every"),
        (lambda: ind.Config(d_model=30, n_heads=4), "multiple of n_heads"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# --- the OV circuit and the copying score ---------------------------------------------------------

def test_ov_circuit_is_embedding_value_output_unembedding_by_loops():
    import induction as ind
    torch.manual_seed(0)
    config = ind.Config(n_layers=2, n_heads=2, d_model=8, vocab_size=5)
    model = ind.AttentionOnly(config)
    for layer in range(2):
        for head in range(2):
            circuit = ind.ov_circuit(model, layer, head)
            assert circuit.shape == (5, 5)
            attn = model.layers[layer]
            for a in range(5):  # attend with weight 1 to token a: the head's output, unembedded
                e = model.embed.weight[a].detach()
                value = attn.v_proj(e)  # all heads' values
                keep = torch.zeros(8, dtype=torch.float64)
                keep[head * 4:(head + 1) * 4] = 1  # this head's features only
                out = attn.out_proj(value * keep) - attn.out_proj(torch.zeros(8, dtype=torch.float64))
                logits = model.unembed(out).detach()
                numerics.assert_close(circuit[a], logits)


def test_copying_score_is_one_for_a_copier_and_minus_one_for_its_opposite():
    import induction as ind
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    positive = basis @ torch.diag(torch.tensor([1.0, 2, 3, 4, 5, 6], dtype=torch.float64)) @ basis.T
    assert abs(ind.copying_score(positive) - 1) < 1e-12
    assert abs(ind.copying_score(-positive) + 1) < 1e-12
    rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)  # eigenvalues +-i
    assert abs(ind.copying_score(rotation)) < 1e-12
    with pytest.raises(ValueError, match="square matrix"):
        ind.copying_score(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="the model has 2 layers of 1 heads"):
        ind.ov_circuit(ind.AttentionOnly(ind.Config()), 2, 0)


# --- activation patching --------------------------------------------------------------------

from transformer import DecoderLM  # noqa: E402

TWO_HEADS = ind.Config(n_heads=2)


def decoder(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DecoderLM(11, 10, 16, 2, 32, 3, dtype=torch.float64).eval()


def sites(n_layers, n_heads):
    return ([("stream", l) for l in range(n_layers + 1)]
            + [(kind, l) for kind in ("query", "key", "value") for l in range(n_layers)]
            + [("head", l, h) for l in range(n_layers) for h in range(n_heads)])


def no_hooks_left(m):
    return all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())


def attention_only_cases():
    m = model(TWO_HEADS)
    tokens = ind.make_batch(5, TWO_HEADS, (3, 8), gen(20)).inputs
    other = ind.make_batch(5, TWO_HEADS, (3, 8), gen(21)).inputs
    return m, tokens, other, lambda out: out[0]


def decoder_cases():
    m = decoder()
    tokens = torch.randint(0, 11, (4, 10), generator=gen(22))
    other = torch.randint(0, 11, (4, 10), generator=gen(23))
    return m, tokens, other, lambda out: out


def layers_of(m) -> int:
    return len(m.layers) if isinstance(m, ind.AttentionOnly) else len(m.blocks)


@pytest.mark.parametrize("cases", [attention_only_cases, decoder_cases])
def test_patching_a_runs_own_activation_into_it_changes_nothing(cases):
    m, tokens, _, logits_of = cases()
    with torch.no_grad():
        expected = logits_of(m(tokens))
    n_layers = layers_of(m)
    for site in sites(n_layers, 2):
        numerics.assert_same(logits_of(ind.patch_activation(m, tokens, tokens, site)), expected)
        recorded = ind.record_activation(m, tokens, site)  # the same, given as the activation
        numerics.assert_same(logits_of(ind.patch_activation(m, recorded, tokens, site)), expected)
    assert no_hooks_left(m)


@pytest.mark.parametrize("cases", [attention_only_cases, decoder_cases])
def test_patching_all_of_the_first_or_last_stream_reproduces_the_source_run(cases):
    m, tokens, other, logits_of = cases()
    with torch.no_grad():
        source = logits_of(m(other))
    n_layers = layers_of(m)
    for layer in (0, n_layers):
        patched = logits_of(ind.patch_activation(m, other, tokens, ("stream", layer)))
        numerics.assert_same(patched, source)
    if isinstance(m, ind.AttentionOnly):  # the attention weights too, from the first stream
        _, weights = ind.patch_activation(m, other, tokens, ("stream", 0))
        for w, expected in zip(weights, m(other)[1]):
            numerics.assert_same(w, expected)


@pytest.mark.parametrize("cases", [attention_only_cases, decoder_cases])
def test_patching_where_the_two_runs_do_not_differ_changes_nothing(cases):
    m, tokens, _, logits_of = cases()
    late = tokens.clone()
    late[:, 6:] = (tokens[:, 6:] + 1) % 11  # the runs differ from position 6 on
    with torch.no_grad():
        expected = logits_of(m(late))
    n_layers = layers_of(m)
    for site in sites(n_layers, 2):  # causal: positions 0..5 are the same in both runs
        patched = ind.patch_activation(m, tokens, late, site, positions=range(6))
        numerics.assert_same(logits_of(patched), expected)
    # and the same site at a later position does change what follows it
    patched = logits_of(ind.patch_activation(m, tokens, late, ("stream", 0), positions=[7]))
    numerics.assert_same(patched[:, :7], expected[:, :7])
    assert not numerics.close(patched, expected)


def test_patching_a_head_or_the_keys_is_the_computation_by_hand():
    m, tokens, other, _ = attention_only_cases()
    layer0, layer1 = m.layers
    with torch.no_grad():
        def first_two(t):
            x0 = m.stream(t)
            return x0, x0 + layer0(x0, x0, x0, is_causal=True)[0]
        x0, x1 = first_two(tokens)
        # layer 1's keys from the other run's stream X1
        _, x1_other = first_two(other)
        out, w = layer1(x1, x1_other, x1, is_causal=True)
        logits, weights = ind.patch_activation(m, other, tokens, ("key", 1))
        numerics.assert_same(logits, m.unembed(x1 + out))  # the same computation
        numerics.assert_same(weights[1], w)
        # head 1 of layer 1 from the other run, head 0 from this one
        def heads(x):
            q, k, v = (layer1.split_heads(p(x)) for p in (layer1.q_proj, layer1.k_proj,
                                                          layer1.v_proj))
            return scaled_dot_product_attention(q, k, v, is_causal=True)[0]  # (B, 2, T, 16)
        mixed = torch.stack([heads(x1)[:, 0], heads(x1_other)[:, 1]], dim=1)
        expected = m.unembed(x1 + layer1.out_proj(layer1.merge_heads(mixed)))
        logits, _ = ind.patch_activation(m, other, tokens, ("head", 1, 1))
        torch.testing.assert_close(logits, expected)
        recorded = ind.record_activation(m, other, ("head", 1, 1))
        torch.testing.assert_close(recorded, layer1.merge_heads(heads(x1_other))[..., 16:])


def test_positions_as_a_mask_or_a_list_are_the_same():
    m, tokens, other, _ = attention_only_cases()
    mask = torch.zeros(5, 24, dtype=torch.bool)
    mask[:, [3, 9]] = True
    by_list, _ = ind.patch_activation(m, other, tokens, ("head", 0, 1), positions=[3, 9])
    by_mask, _ = ind.patch_activation(m, other, tokens, ("head", 0, 1), positions=mask)
    by_row, _ = ind.patch_activation(m, other, tokens, ("head", 0, 1), positions=mask[0])
    numerics.assert_same(by_list, by_mask)
    numerics.assert_same(by_list, by_row)


def test_the_hook_points_add_no_weights():
    assert not any(k.startswith("streams") for k in model().state_dict())


def test_bad_sites_and_shapes_are_refused_and_no_hook_is_left():
    m, tokens, other, _ = attention_only_cases()
    bad = {("stream", 3): "layer must lie in 0..2; the model has 2 layers of 2 heads",
           ("key", 2): "layer must lie in 0..1; the model has 2 layers of 2 heads",
           ("head", 1, 2): "head must lie in 0..1; the model has 2 layers of 2 heads",
           ("head", 1): "a site is", ("weights", 0): "a site is", "key": "a site is"}
    for site, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ind.patch_activation(m, other, tokens, site)
        with pytest.raises(ValueError, match=re.escape(message)):
            ind.record_activation(m, tokens, site)
    with pytest.raises(ValueError, match=re.escape("source tokens (5, 10) and target tokens "
                                                   "(5, 24)")):
        ind.patch_activation(m, other[:, :10], tokens, ("key", 1))
    # an activation of the wrong shape is refused inside the run: the hook goes all the same
    wrong = torch.zeros(5, 24, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("is (5, 24, 16); the target's is "
                                                   "(5, 24, 32)")):
        ind.patch_activation(m, wrong, tokens, ("key", 1))
    with pytest.raises(ValueError, match="positions in 0..23"):
        ind.patch_activation(m, other, tokens, ("key", 1), positions=[24])
    with pytest.raises(ValueError, match=re.escape("broadcast to (B, T) = (5, 24)")):
        ind.patch_activation(m, other, tokens, ("key", 1),
                             positions=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="AttentionOnly or a DecoderLM"):
        ind.patch_activation(torch.nn.Linear(2, 2), other, tokens, ("key", 1))
    assert no_hooks_left(m)
