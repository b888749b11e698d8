"""code/lm.py, the language model on real text of chapter 13: the text, the baselines, training,
sampling with and without the cache, the head scores and ablation, saving and loading a run.
The committed run itself is tested in test_models.py."""

from __future__ import annotations

import hashlib
import math
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import checking
import lm
import numerics
import stored

torch.set_num_threads(1)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = lm.load_text()
VOCAB = lm.Vocabulary(TEXT)
TOKENS = VOCAB.encode(TEXT)
TINY = lm.Config(context=16, d_model=16, num_heads=2, d_ff=32, num_layers=2, batch_size=4,
                 steps=6, eval_every=3, warmup=2)
SMALL_TEXT = TEXT[:3000]
SMALL = lm.Vocabulary(SMALL_TEXT)  # the vocabulary of the models trained on SMALL_TEXT


# --- the text ----------------------------------------------------------------------------------

def test_the_text_is_the_one_data_readme_describes():
    readme = (ROOT / "data" / "README.md").read_text()
    digest = hashlib.sha256((ROOT / "data" / lm.TEXT).read_bytes()).hexdigest()
    assert digest in readme, "data/README.md must give the text's SHA-256"
    count = int(re.search(r"first ([\d,]+) characters", readme).group(1).replace(",", ""))
    assert len(TEXT) == count and TEXT.isascii() and TEXT.endswith("\n")
    assert f"{len(VOCAB)} distinct characters" in readme
    assert "public domain" in readme and "MIT" in readme


def test_the_vocabulary_numbers_sorted_characters_and_round_trips():
    assert VOCAB.chars == sorted(set(TEXT)) and VOCAB.decode(VOCAB.encode("KING:\n")) == "KING:\n"
    assert VOCAB.encode("\n").tolist() == [0]  # the smallest character
    with pytest.raises(ValueError, match=r"not in the vocabulary: \['@'\]"):
        VOCAB.encode("a@")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 62\)"):
        VOCAB.decode([62])


def test_the_split_is_contiguous_and_keeps_every_token():
    train, held = lm.split(TOKENS)
    assert len(train) == int(0.9 * len(TOKENS))
    numerics.assert_same(torch.cat([train, held]), TOKENS)  # token ids
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        lm.split(TOKENS, 1.0)


def test_the_text_is_fetched_from_beside_the_code_folder(tmp_path, monkeypatch):
    (tmp_path / "repo" / "data").mkdir(parents=True)
    (tmp_path / "repo" / "data" / lm.TEXT).write_text("To be.\n")
    monkeypatch.setenv(stored.CODE_URL, (tmp_path / "repo" / "code").as_uri())
    here = tmp_path / "alone"
    assert lm.load_text(here) == "To be.\n" and (here / lm.TEXT).is_file()
    monkeypatch.delenv(stored.CODE_URL)
    with pytest.raises(RuntimeError, match="ATTENTION_CODE_URL is not set"):
        lm.load_text(tmp_path / "empty")


# --- the baselines ----------------------------------------------------------------------------

def bigram_by_loops(train, held, V, alpha):
    counts = [[alpha] * V for _ in range(V)]
    for a, b in zip(train.tolist(), train[1:].tolist()):
        counts[a][b] += 1
    total = 0.0
    for a, b in zip(held.tolist(), held[1:].tolist()):
        total -= math.log(counts[a][b] / sum(counts[a]))
    return total / (len(held) - 1)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_bigram_loss_is_the_counting_model_by_loops(alpha):
    g = torch.Generator().manual_seed(0)
    train, held = torch.randint(5, (200,), generator=g), torch.randint(5, (50,), generator=g)
    assert math.isclose(lm.bigram_loss(train, held, 5, alpha),
                        bigram_by_loops(train, held, 5, alpha), rel_tol=1e-12)


def test_the_unigram_loss_is_the_frequency_model():
    train, held = torch.tensor([0, 0, 0, 1]), torch.tensor([1, 0, 1])
    # add-one counts 4 and 2 of 6: held[1:] = 0, 1
    assert math.isclose(lm.unigram_loss(train, held, 2), -(math.log(4 / 6) + math.log(2 / 6)) / 2)


def test_without_smoothing_an_unseen_pair_costs_infinity():
    train, held = torch.tensor([0, 1, 0, 1]), torch.tensor([1, 1])
    assert lm.bigram_loss(train, held, 2, alpha=0.0) == math.inf
    assert math.isfinite(lm.bigram_loss(train, held, 2, alpha=1.0))


def test_counts_beat_every_other_one_character_model_on_their_own_text():
    """The chapter's proposition: on the text the pairs were counted in, the count model's loss
    (alpha = 0) is at most that of any model that sees one character."""
    train = TOKENS[:20000]
    best = lm.bigram_loss(train, train, len(VOCAB), alpha=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        table = torch.log_softmax(torch.randn(len(VOCAB), len(VOCAB), generator=g,
                                              dtype=torch.float64), dim=-1)
        assert best <= float(-table[train[:-1], train[1:]].mean())
    smoothed = lm.bigram_loss(train, train, len(VOCAB), alpha=1.0)
    assert best < smoothed  # smoothing moves probability to pairs that never occur


def test_the_baselines_reject_bad_tokens_with_their_shapes():
    with pytest.raises(ValueError, match=r"held_out must be a \(N,\) tensor of int64.*\(2, 3\)"):
        lm.bigram_loss(TOKENS[:10], torch.zeros(2, 3, dtype=torch.long), len(VOCAB))
    with pytest.raises(ValueError, match=r"train must lie in \[0, 4\), got values from 0 to"):
        lm.unigram_loss(TOKENS[:100], TOKENS[:10], 4)


# --- the model and its training ----------------------------------------------------------------

def test_the_config_is_checked():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        lm.Config(d_model=10, num_heads=4)
    with pytest.raises(ValueError, match="multiple of eval_every"):
        lm.Config(steps=150)
    with pytest.raises(ValueError, match="Config.context must be a positive integer"):
        lm.Config(context=0)
    assert lm.Config.from_dict({"betas": [0.9, 0.95]}).betas == (0.9, 0.95)


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    c = lm.Config()
    rates = [c.learning_rate(s) for s in range(c.steps + 1)]
    assert rates[0] == pytest.approx(c.lr / c.warmup)
    numerics.assert_close(rates[c.warmup - 1], rates[c.warmup])  # two formulas meet at lr
    assert rates[c.warmup] == pytest.approx(c.lr)
    assert rates[-1] == pytest.approx(c.min_lr)
    assert all(a < b for a, b in zip(rates[:c.warmup - 1], rates[1:c.warmup]))
    assert all(a >= b for a, b in zip(rates[c.warmup:], rates[c.warmup + 1:]))


def test_windows_cut_the_text_into_shifted_pairs():
    x, y = lm.windows(torch.arange(10), 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="hold no window"):
        lm.windows(torch.arange(3), 3)


def test_evaluate_is_the_mean_cross_entropy_over_the_windows():
    torch.manual_seed(0)
    model = lm.build(TINY, len(VOCAB)).eval()
    tokens = TOKENS[:200]
    x, y = lm.windows(tokens, TINY.context)
    with torch.no_grad():
        want = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert lm.evaluate(model, tokens, batch=5) == pytest.approx(float(want), rel=1e-12)


def test_training_is_deterministic_and_until_gives_the_start_of_the_log():
    model, log = lm.train(TINY, 3, SMALL_TEXT)
    again, log2 = lm.train(TINY, 3, SMALL_TEXT)
    assert log == log2 and set(log) == {"lr", "loss", "grad_norm", "eval"}
    assert len(log["loss"]) == len(log["lr"]) == TINY.steps
    assert [r["step"] for r in log["eval"]] == [0, 3, 6]
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        numerics.assert_same(a, b)  # the same computation on the same shapes, twice
    _, start = lm.train(TINY, 3, SMALL_TEXT, until=4)
    assert start["loss"] == log["loss"][:4] and start["lr"] == log["lr"][:4]
    assert start["eval"] == log["eval"][:2]
    assert log["eval"][-1]["held_out"] < log["eval"][0]["held_out"]  # it learns
    with pytest.raises(ValueError, match="until must lie in"):
        lm.train(TINY, 3, SMALL_TEXT, until=7)


def test_the_logged_gradient_norm_is_the_norm_before_clipping():
    clipped = lm.Config(**{**TINY.__dict__, "clip": 1e-3})  # every step clipped
    _, log = lm.train(clipped, 3, SMALL_TEXT, until=1)
    train_part, _ = lm.split(SMALL.encode(SMALL_TEXT), clipped.fraction)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = lm.build(clipped, len(SMALL))
    x, y = lm._batch(train_part, clipped, torch.Generator().manual_seed(3))
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    numerics.assert_close(torch.tensor(log["grad_norm"], dtype=torch.float64),
                          norm[None])  # another summation order
    assert log["grad_norm"][0] > 100 * clipped.clip  # so the step was clipped: before it


def test_a_repeat_window_holds_a_passage_twice_and_repeat_0_draws_as_before():
    train_part, _ = lm.split(TOKENS)
    g0, g1 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    x0, _ = lm._batch(train_part, TINY, g0)
    twice = lm.Config(**{**TINY.__dict__, "repeat": 1.0})
    x1, y1 = lm._batch(train_part, twice, g1)
    numerics.assert_same(x1[:, :9], x0[:, :9])  # token ids: the same starts, 9 kept
    rows = torch.cat([x1, y1[:, -1:]], dim=1)  # (B, 17): c, a passage of 8, the passage
    numerics.assert_same(rows[:, 9:], rows[:, 1:9])
    numerics.assert_same(y1[:, :-1], x1[:, 1:])  # targets: the inputs shifted by one
    starts_only = torch.Generator().manual_seed(5)
    torch.randint(len(train_part) - TINY.context, (TINY.batch_size,), generator=starts_only)
    numerics.assert_same(g0.get_state(), starts_only.get_state())  # repeat = 0: no more drawn
    half = lm.Config(**{**TINY.__dict__, "repeat": 0.5, "batch_size": 400})
    x, y = lm._batch(train_part, half, torch.Generator().manual_seed(0))
    rows = torch.cat([x, y[:, -1:]], dim=1)
    share = float((rows[:, 9:] == rows[:, 1:9]).all(dim=1).double().mean())
    assert 0.4 < share < 0.6  # about half, as drawn
    with pytest.raises(ValueError, match=r"Config.repeat must lie in \[0, 1\]"):
        lm.Config(repeat=1.5)


def test_a_varied_repeat_puts_the_second_copy_repeat_min_to_half_a_context_later():
    train_part, _ = lm.split(TOKENS)
    varied = lm.Config(**{**TINY.__dict__, "repeat": 1.0, "repeat_min": 3, "batch_size": 200})
    g = torch.Generator().manual_seed(1)
    x, y = lm._batch(train_part, varied, g)
    rows = torch.cat([x, y[:, -1:]], dim=1)  # (B, 17)
    found = []
    for row in rows.tolist():  # the passage of n after the first character, then again
        lengths = [n for n in range(3, 9) if row[1 + n:1 + 2 * n] == row[1:1 + n]]
        assert lengths, row
        found.append(lengths[0])
    assert set(found) == set(range(3, 9))  # every length from repeat_min to context // 2
    with pytest.raises(ValueError, match=r"Config.repeat_min must be an integer in \[0, "):
        lm.Config(repeat_min=33)


def test_the_in_context_score_compares_one_character_read_from_late_and_from_early():
    model, _ = lm.train(TINY, 0, SMALL_TEXT)
    tokens = SMALL.encode(SMALL_TEXT[2000:2400])
    score = lm.in_context_score(model, tokens, 3, 12)
    late, _ = lm.predictions(model, tokens)  # (N, 16)
    early, _ = lm.predictions(model, tokens[9:])  # windows 9 characters later
    n = len(score)
    assert n == min(len(late), len(early))
    numerics.assert_close(score, late[:n, 11] - early[:n, 2])  # a shorter pass: another path
    y_late, y_early = lm.windows(tokens, 16)[1], lm.windows(tokens[9:], 16)[1]
    numerics.assert_same(y_late[:n, 11], y_early[:n, 2])  # token ids: the same characters
    with pytest.raises(ValueError, match="need 1 <= early < late <= context = 16"):
        lm.in_context_score(model, tokens, 5, 17)


def test_a_traced_run_is_the_same_run_with_more_measured():
    model, log = lm.train(TINY, 3, SMALL_TEXT)
    traced_model, traced = lm.train(TINY, 3, SMALL_TEXT, traced=True)
    for key in ("lr", "loss", "grad_norm"):
        assert traced[key] == log[key]  # the same computation: measuring touches nothing
    for a, b in zip(model.state_dict().values(), traced_model.state_dict().values()):
        numerics.assert_same(a, b)  # the same computation on the same shapes, twice
    _, held_out = lm.split(SMALL.encode(SMALL_TEXT), TINY.fraction)
    for plain, record in zip(log["eval"], traced["eval"], strict=True):
        assert record["held_out"] == plain["held_out"]
        assert len(record["by_position"]) == TINY.context and len(record["icl"]) == 2
        numerics.assert_close(torch.tensor(record["by_position"]).mean(),
                              torch.tensor(record["held_out"]))  # another summation order
        assert torch.tensor(record["induction"]).shape == (TINY.num_layers, TINY.num_heads)
        assert len(record["copies"]) == 2
    final = lm.trace(traced_model, held_out)
    assert final == {k: v for k, v in traced["eval"][-1].items() if k not in ("step", "held_out")}
    icl = lm.in_context_score(traced_model, held_out, 5, 16)  # a context of 16: the last
    numerics.assert_close(torch.tensor(final["icl"], dtype=torch.float64),
                          torch.stack([icl.mean(), icl.std() / math.sqrt(len(icl))]))


# --- sampling ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    model, _ = lm.train(TINY, 0, SMALL_TEXT)
    return model


def test_sampling_with_the_cache_gives_what_sampling_without_it_gives(tiny_model):
    prompt = SMALL.encode("All:\n")
    for temperature in (1.0, 0.5, 0.0):
        a = lm.generate(tiny_model, prompt, 10, temperature=temperature,
                        generator=torch.Generator().manual_seed(1))
        b = lm.generate(tiny_model, prompt, 10, temperature=temperature,
                        generator=torch.Generator().manual_seed(1), cache=False)
        numerics.assert_same(a, b)  # token ids
        assert a.shape == (10,) and a.dtype == torch.long


def test_temperature_zero_is_the_most_likely_character(tiny_model):
    prompt = SMALL.encode("All:\n")
    first = lm.generate(tiny_model, prompt, 1, temperature=0.0)
    with torch.no_grad():
        assert int(first) == int(tiny_model(prompt[None])[0, -1].argmax())


def test_a_sample_longer_than_the_context_restarts_its_window_the_same_way(tiny_model):
    prompt = SMALL.encode("All:\n")
    a = lm.generate(tiny_model, prompt, 40, generator=torch.Generator().manual_seed(0))
    b = lm.generate(tiny_model, prompt, 40, cache=False, generator=torch.Generator().manual_seed(0))
    numerics.assert_same(a, b)  # token ids
    assert a.shape == (40,)
    # greedy decoding by the stated rule: the window starts at 0, grows to 16 characters, and
    # when a 17th arrives restarts from the last 8
    seen, start = prompt.tolist(), 0
    with torch.no_grad():
        for _ in range(40):
            seen.append(int(tiny_model(torch.tensor([seen[start:]]))[0, -1].argmax()))
            if len(seen) - start > TINY.context:
                start = len(seen) - TINY.context // 2
    greedy = lm.generate(tiny_model, prompt, 40, temperature=0.0)
    assert greedy.tolist() == seen[len(prompt):]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        lm.generate(tiny_model, prompt, 2, temperature=-1.0)


# --- sampling ----------------------------------------------------------------------------------


def hf_kept(scores: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """Which tokens Hugging Face's TopKLogitsWarper then TopPLogitsWarper keep (transformers'
    generation/logits_process.py, min_tokens_to_keep=1), transcribed: top-k removes every score
    below the k-th largest; top-p sorts ascending and removes the tokens whose cumulative
    probability is at most 1 - p, never the most likely one. nanoGPT's top-k is the same rule.
    The sort is made stable, so that equal scores at the boundary have one order (the
    library's default sort leaves it to the kernel)."""
    scores = scores.clone()
    if top_k is not None:
        top_k = min(top_k, scores.size(-1))
        scores[scores < torch.topk(scores, top_k)[0][..., -1, None]] = float("-inf")
    if top_p is not None:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False, stable=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores[remove.scatter(1, sorted_indices, remove)] = float("-inf")
    return scores > float("-inf")


def kept_by_sample(logits, n=4000, **settings) -> torch.Tensor:
    """Which tokens lm.sample ever draws, over n draws per row."""
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([lm.sample(logits, generator=g, **settings) for _ in range(n)])
    kept = torch.zeros(logits.shape, dtype=torch.bool)
    kept.scatter_(-1, drawn.T, True)
    return kept


def test_sample_returns_one_token_per_row_of_the_logits():
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 7), (2, 3, 7)]:
        tokens = lm.sample(torch.randn(*shape, generator=g), generator=g)
        assert tokens.shape == shape[:-1] and tokens.dtype == torch.long
        assert int(tokens.min()) >= 0 and int(tokens.max()) < 7


def test_temperature_zero_takes_the_most_likely_token_the_first_of_equal_ones():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    assert lm.sample(logits, temperature=0).tolist() == [1, 0]
    assert lm.sample(logits, temperature=0, top_k=1, top_p=0.1).tolist() == [1, 0]


@pytest.mark.parametrize("top_k, top_p", [(1, None), (3, None), (5, None), (50, None),
                                          (None, 0.5), (None, 0.9), (None, 1.0), (None, 0.01),
                                          (4, 0.8), (2, 0.3)])
def test_top_k_and_top_p_keep_what_hugging_faces_samplers_keep(top_k, top_p):
    """On logits with ties at the k-th value (0.5 three times) and without."""
    g = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.tensor([[2.0, 0.5, 0.5, 0.5, -1.0, 1.0, -3.0, 0.0]]),
                        torch.randn(3, 8, generator=g, dtype=torch.float64).float()])
    want = hf_kept(logits, top_k, top_p)
    got = kept_by_sample(logits, top_k=top_k, top_p=top_p)
    numerics.assert_same(got, want)  # boolean sets


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    assert kept_by_sample(logits[None], top_k=2)[0].tolist() == [True, True, True, True, False]


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log()[None]
    assert kept_by_sample(logits, top_p=0.5)[0].tolist() == [True, False, False, False]
    assert kept_by_sample(logits, top_p=0.79)[0].tolist() == [True, True, False, False]
    assert kept_by_sample(logits, top_p=0.81)[0].tolist() == [True, True, True, False]
    assert kept_by_sample(logits, top_p=0.2)[0].tolist() == [True, False, False, False]


def test_sample_draws_from_the_renormalised_kept_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    n = 40_000
    drawn = lm.sample(probs.log().expand(n, 4), top_p=0.79, generator=g)
    freq = torch.bincount(drawn, minlength=4).double() / n
    want = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    # binomial standard error at most 0.0025 here: 5 of them
    assert (freq - want).abs().max() < 0.0125, freq


def test_sample_with_a_generator_is_reproducible_and_temperature_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(20_000, 4)
    draws = {t: lm.sample(logits, temperature=t, generator=torch.Generator().manual_seed(3))
             for t in (0.5, 1.0, 2.0)}
    again = lm.sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    numerics.assert_same(draws[1.0], again)  # the same draws from the same seed
    top = [float((d == 0).double().mean()) for d in draws.values()]
    assert top[0] > top[1] > top[2]  # the most likely token loses mass as T grows


@pytest.mark.parametrize("settings, message", [
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_k": 0}, "top_k must be an int >= 1 or None, got 0"),
    ({"top_k": 2.5}, "top_k must be an int >= 1 or None, got 2.5"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\] or None, got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\] or None, got 1.5")])
def test_sample_refuses_bad_settings_naming_the_value(settings, message, tiny_model):
    with pytest.raises(ValueError, match=message):
        lm.sample(torch.zeros(2, 5), **settings)
    with pytest.raises(ValueError, match=message):
        lm.generate(tiny_model, SMALL.encode("All:"), 2, **settings)


def test_sample_refuses_logits_that_are_not_a_floating_tensor():
    for bad in (torch.zeros(()), torch.arange(5), [0.0, 1.0]):
        with pytest.raises(ValueError, match="logits must be a floating tensor"):
            lm.sample(bad)


def test_truncated_gives_the_logits_sample_draws_from():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    z = lm.truncated(logits, temperature=0.7, top_k=6, top_p=0.8)
    assert z.shape == logits.shape
    kept = torch.isfinite(z)
    numerics.assert_close(z[kept], (logits / 0.7)[kept])  # kept logits only divided by tau
    numerics.assert_same(kept.reshape(-1, 9),
                         hf_kept((logits / 0.7).reshape(-1, 9), top_k=6, top_p=0.8))
    with pytest.raises(ValueError, match="temperature 0 draws nothing"):
        lm.truncated(logits, temperature=0)


def test_generate_passes_top_k_and_top_p_through(tiny_model):
    prompt = SMALL.encode("All:\n")
    one = lm.generate(tiny_model, prompt, 30, top_k=1, generator=torch.Generator().manual_seed(0))
    numerics.assert_same(one, lm.generate(tiny_model, prompt, 30, temperature=0.0))  # greedy
    tiny = lm.generate(tiny_model, prompt, 30, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    numerics.assert_same(tiny, one)  # the most likely only
    a = lm.generate(tiny_model, prompt, 30, top_k=3, top_p=0.9,
                    generator=torch.Generator().manual_seed(4))
    b = lm.generate(tiny_model, prompt, 30, top_k=3, top_p=0.9, cache=False,
                    generator=torch.Generator().manual_seed(4))
    numerics.assert_same(a, b)  # token ids


# --- the heads ---------------------------------------------------------------------------------

def test_the_decoder_returns_its_weights_on_request(tiny_model):
    x = SMALL.encode(SMALL_TEXT[:12])[None]
    logits, weights = tiny_model(x, need_weights=True)
    numerics.assert_same(logits, tiny_model(x))  # the same computation: weights are always made
    assert len(weights) == TINY.num_layers and weights[0].shape == (1, TINY.num_heads, 12, 12)
    assert torch.allclose(weights[1].sum(-1), torch.ones(1, TINY.num_heads, 12, dtype=torch.float64))
    assert (weights[0].triu(1) == 0).all()  # causal


def test_score_on_averages_the_weight_on_each_querys_key():
    w = torch.zeros(1, 2, 3, 3)
    w[0, 0, :, 0] = 1.0  # head 0: everything on position 0
    w[0, 1, 0, 0], w[0, 1, 1, 1], w[0, 1, 2] = 1.0, 1.0, torch.tensor([0.5, 0.25, 0.25])
    keys = torch.tensor([[-1, 0, 0]])  # rows 1 and 2 only
    numerics.assert_close(lm.score_on(w, keys), torch.tensor([1.0, 0.25]))
    with pytest.raises(ValueError, match=r"keys must be \(B, T\) = \(1, 3\).*got \(1, 2\)"):
        lm.score_on(w, torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="a key lies after its query"):
        lm.score_on(w, torch.tensor([[1, 0, 0]]))
    with pytest.raises(ValueError, match=r"weights must be \(B, H, T, T\), got \(2, 2\)"):
        lm.score_on(torch.ones(2, 2), keys)


def test_the_keys_of_the_scores_by_hand():
    tokens = VOCAB.encode("ab cd\nef")[None]  # positions 0..7; " " at 2, "\n" at 5
    boundaries = VOCAB.encode(" \n").tolist()
    assert lm.back_keys(tokens, 2).tolist() == [[-1, -1, 0, 1, 2, 3, 4, 5]]
    assert lm.last_keys(tokens, VOCAB.encode("\n").tolist()).tolist() == [
        [-1, -1, -1, -1, -1, 5, 5, 5]]
    assert lm.word_start_keys(tokens, boundaries, after=0).tolist() == [
        [-1, -1, -1, 3, 3, -1, 6, 6]]
    assert lm.word_start_keys(tokens, boundaries, after=1).tolist() == [
        [-1, -1, -1, -1, 3, -1, -1, 6]]
    longer = VOCAB.encode("a bcdefg")[None]  # the word starts at 2
    assert lm.word_start_keys(longer, boundaries).tolist() == [[-1, -1, -1, -1, -1, 2, 2, 2]]


def test_repeated_text_holds_a_passage_twice_after_one_character():
    rows = lm.repeated_text(TOKENS, 3, 5, torch.Generator().manual_seed(0))
    assert rows.shape == (3, 11)
    numerics.assert_same(rows[:, 1:6], rows[:, 6:])  # token ids
    text = VOCAB.decode(rows[0])
    assert text[1:6] in TEXT and text[:6] in TEXT


def test_head_scores_are_weights_on_the_keys_they_name(tiny_model):
    tokens = SMALL.encode(SMALL_TEXT)
    x = tokens[:2 * TINY.context].view(2, -1)
    rep = lm.repeated_text(tokens, 4, 7, torch.Generator().manual_seed(0))
    scores = lm.head_scores(tiny_model, x, rep, SMALL)
    assert {k: tuple(v.shape) for k, v in scores.items()} == {
        k: (TINY.num_layers, TINY.num_heads) for k in ("previous", "two back", "word start",
                                                       "line break", "induction")}
    assert all(((v >= 0) & (v <= 1)).all() for v in scores.values())
    weights = lm.attention_weights(tiny_model, x)
    i = torch.arange(1, TINY.context)
    torch.testing.assert_close(scores["previous"][1], weights[1][:, :, i, i - 1].mean(dim=(0, 2)))


def test_ablation_silences_only_the_heads_named(tiny_model):
    ablated = lm.ablate(tiny_model, [(1, 0)])
    w = ablated.blocks[1].self_attn.out_proj.weight
    width = TINY.d_model // TINY.num_heads
    assert (w[:, :width] == 0).all() and (w[:, width:] != 0).all()
    assert (tiny_model.blocks[1].self_attn.out_proj.weight[:, :width] != 0).all()  # a copy
    x = SMALL.encode(SMALL_TEXT[:10])[None]
    _, before = tiny_model(x, need_weights=True)
    logits, after = ablated(x, need_weights=True)
    torch.testing.assert_close(after[1], before[1])  # the head still attends; it writes nothing
    assert not torch.allclose(logits, tiny_model(x))
    with pytest.raises(ValueError, match=r"no head \(2, 0\): the model has 2 layers of 2 heads"):
        lm.ablate(tiny_model, [(2, 0)])


# --- saving and loading ------------------------------------------------------------------------

def test_a_saved_run_loads_with_its_weights_and_log(tiny_model, tmp_path):
    log = {"lr": [], "loss": [], "eval": []}
    with pytest.raises(ValueError, match="the vocabulary has 62 characters, the model 52"):
        lm.save_run(tmp_path, "tiny", TINY, 0, tiny_model, log, VOCAB)
    record = lm.save_run(tmp_path, "tiny", TINY, 0, tiny_model, log, SMALL)
    assert record["chars"] == "".join(SMALL.chars) and record["torch"] == torch.__version__
    run = lm.load_run("tiny", tmp_path)
    assert run.config == TINY and run.log == log and not run.model.training
    assert run.until is None
    lm.save_run(tmp_path, "short", TINY, 0, tiny_model, log, SMALL, until=3)
    assert lm.load_run("short", tmp_path).until == 3
    assert run.vocab.chars == SMALL.chars
    for a, b in zip(run.model.state_dict().values(), tiny_model.state_dict().values()):
        numerics.assert_same(a, b)  # a copy, through the file
    state = torch.load(tmp_path / "tiny.pt", weights_only=True)
    state["unembed.weight"][0, 0] += 1.0
    torch.save(state, tmp_path / "tiny.pt")
    with pytest.raises(ValueError, match="SHA-256 .* but tiny.json records"):
        lm.load_run("tiny", tmp_path)


# --- the held-out analysis: predictions and ablation costs, window by window ------------------

def test_the_predictions_are_every_windows_losses_and_its_last_log_probabilities(tiny_model):
    tokens = SMALL.encode(SMALL_TEXT[:200])
    losses, last = lm.predictions(tiny_model, tokens, batch=5)
    x, y = lm.windows(tokens, TINY.context)
    assert losses.shape == x.shape and last.shape == (len(x), len(SMALL))
    numerics.assert_close(losses.mean(), torch.tensor(lm.evaluate(tiny_model, tokens),
                                                      dtype=torch.float64))
    with torch.no_grad():
        log_probs = torch.log_softmax(tiny_model(x), dim=-1)
    numerics.assert_close(last, log_probs[:, -1])
    numerics.assert_close(losses[2, 3], -log_probs[2, 3, y[2, 3]])


def test_ablation_rises_are_each_windows_rise_of_the_loss(tiny_model):
    tokens = SMALL.encode(SMALL_TEXT[:200])
    groups = lm.ablation_groups(TINY.num_layers, TINY.num_heads)
    assert groups == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)], [(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    rises = lm.ablation_rises(tiny_model, tokens, [[], *groups[:2]], batch=4)
    assert rises.shape == (3, 12)
    numerics.assert_close(rises[0], torch.zeros(12, dtype=torch.float64))  # nothing silenced
    base = lm.evaluate(tiny_model, tokens)
    silenced = lm.evaluate(lm.ablate(tiny_model, [(0, 1)]), tokens)
    numerics.assert_close(rises[2].mean(), torch.tensor(silenced - base, dtype=torch.float64),
                          factor=4)  # a mean of differences, against a difference of means


def test_a_saved_analysis_loads_with_its_run_and_tensors(tiny_model, tmp_path):
    log = {"lr": [], "loss": [], "eval": []}
    lm.save_run(tmp_path, "tiny", TINY, 0, tiny_model, log, SMALL)
    run = lm.load_run("tiny", tmp_path)
    assert run.sha256 == stored.sha256(tmp_path / "tiny.pt")
    tokens = SMALL.encode(SMALL_TEXT[:200])
    groups = lm.ablation_groups(TINY.num_layers, TINY.num_heads)
    tensors = lm.analyse(run, tokens, groups)
    with pytest.raises(ValueError, match=r"rises must be \(len\(groups\), N\) = \(5, 12\)"):
        lm.save_analysis(tmp_path, "bad", run, groups[:5], tensors)
    record = lm.save_analysis(tmp_path, "tiny-held-out", run, groups, tensors, cpu_seconds=2.0)
    assert (record["run"], record["run_sha256"], record["windows"]) == ("tiny", run.sha256, 12)
    assert record["log"]["held_out"] == float(tensors["losses"].mean())  # the same computation
    analysis = lm.load_analysis("tiny-held-out", tmp_path)
    assert analysis.groups == groups and analysis.cpu_seconds == 2.0
    for key in ("losses", "last", "rises"):
        numerics.assert_same(getattr(analysis, key), tensors[key])  # a copy, through the file
    state = torch.load(tmp_path / "tiny-held-out.pt", weights_only=True)
    state["rises"][0, 0] += 1.0
    torch.save(state, tmp_path / "tiny-held-out.pt")
    with pytest.raises(ValueError, match="SHA-256 .* but tiny-held-out.json records"):
        lm.load_analysis("tiny-held-out", tmp_path)


def test_the_training_exercise_starts_where_train_starts_and_steps_as_it_steps():
    """check_train_steps (chapter 13's exercise) gives an answer lm.train's fresh model and
    first batches for a seed, and names mistakes by its own loop: both must be lm.train's."""
    import checks_build_it_yourself as checks

    text = SMALL_TEXT[:800]
    model, batches = checks._start(TINY, 5, text, 4)
    state, losses = checks._steps_like(model, batches, TINY)
    trained, log = lm.train(TINY, 5, text, until=4)
    numerics.assert_close(torch.tensor(losses), torch.tensor(log["loss"]))
    for name, weight in trained.state_dict().items():
        numerics.assert_close(state[name], weight, msg=name)



def test_the_capstone_check_trains_once_gives_the_time_and_holds_the_answer_to_it(monkeypatch):
    """check_lm_capstone calls the answer once for all its cases, with the training text (not
    the held-out text) and the time the exercise states; an answer that overruns the time
    loses that case's point and keeps the others, whatever its loss."""
    import time

    import checks_build_it_yourself as checks
    import transformer

    calls = []

    def slow_untrained(train_tokens, n_vocab, seconds):
        calls.append((len(train_tokens), n_vocab, seconds))
        time.sleep(0.3)
        return transformer.DecoderLM(n_vocab, 8, 8, 2, 16, 1).state_dict(), 2

    text = lm.load_text()
    vocab = lm.Vocabulary(text)
    train, _ = lm.split(vocab.encode(text))
    check = checking.Check("capstone rules off", prepare=checks._warm_capstone)
    check.cases = dict(checks.check_lm_capstone.cases)  # the cases, without the rules
    monkeypatch.setattr(checks, "CAPSTONE_SECONDS", 0.1)
    monkeypatch.setattr(checks, "CAPSTONE_ALLOWED", 0.11)
    results = {title: check._run(title, (slow_untrained,)) for title in check.cases}
    assert calls == [(len(train), len(vocab), 0.1)]  # once, the training text, the time
    with pytest.raises(AssertionError):
        checks.check_lm_capstone(slow_untrained)  # a whole run: the function called afresh
    assert len(calls) == 2
    assert "read the clock" in results["within the time it is given"]
    assert results["weights under DecoderLM's names"] is None
    assert "not below the unigram" in results["below the unigram counts on the held-out text"]


# --- tokens of several characters: the byte-pair tokenizer -------------------------------------

TOY = "the thee then thin thine this\nthat these thy the then"


def test_split_text_splits_where_split_splits_the_characters():
    train_text, held_text = lm.split_text(TEXT)
    train, held = lm.split(TOKENS)
    assert train_text + held_text == TEXT
    numerics.assert_same(VOCAB.encode(train_text), train)  # token ids
    numerics.assert_same(VOCAB.encode(held_text), held)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        lm.split_text(TEXT, 0.0)


def test_bpe_merges_the_most_frequent_pair_first_and_encodes_with_its_merges():
    n_chars = len(set(TOY) - {"\n"})  # the space is a piece too, written "▁"
    plain = lm.Tokenizer(lm.train_tokenizer(TOY, 2 + n_chars))  # no merge
    assert plain.pieces[:2] == ["<unk>", "\n"] and len(plain) == 2 + n_chars
    assert [plain.pieces[i] for i in plain.encode("then this")] == list("then▁this")
    merged = lm.Tokenizer(lm.train_tokenizer(TOY, 2 + n_chars + 3))
    # by hand: "t" then "h" is the commonest pair (11 times), then "▁" then "th" (9), then
    # "▁th" then "e" (5: "▁the", "▁thee", "▁then" twice, "▁these")
    assert merged.pieces[2:5] == ["th", "▁th", "▁the"]
    pieces = [merged.pieces[i] for i in merged.encode("then this")]
    assert pieces == ["th", "e", "n", "▁th", "i", "s"]


def test_the_tokenizer_is_lossless_reproducible_and_refuses_unknown_characters():
    model = lm.train_tokenizer(SMALL_TEXT, 80)
    assert lm.train_tokenizer(SMALL_TEXT, 80) == model  # the same bytes on a second training
    tokenizer = lm.Tokenizer(model, "small")
    ids = tokenizer.encode(SMALL_TEXT)
    assert tokenizer.decode(ids) == SMALL_TEXT and len(tokenizer) == 80
    assert int(tokenizer.lengths[ids].sum()) == len(SMALL_TEXT) > len(ids)  # fewer tokens
    assert tokenizer.lengths.tolist()[:2] == [0, 1]  # the unknown piece, the line break
    assert tokenizer.sha256 == hashlib.sha256(model).hexdigest()
    with pytest.raises(ValueError, match=r"characters not in the tokenizer: \['@'\]"):
        tokenizer.encode("the @")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 80\)"):
        tokenizer.decode([80])


def test_bits_per_character_by_hand():
    # 1.2 nats per token over 100 tokens that spell 250 characters: 120 nats, 0.48 nats per
    # character, 0.48 / 0.693147 = 0.692494 bits per character
    assert lm.bits_per_character(1.2, 100, 250) == pytest.approx(0.692494, abs=1e-6)
    # on characters, n_tokens = n_chars: the loss over ln 2 (ln 2 nats is one bit)
    assert lm.bits_per_character(math.log(2), 300, 300) == pytest.approx(1.0, rel=1e-15)
    with pytest.raises(ValueError, match="at least one token and one character"):
        lm.bits_per_character(1.0, 10, 0)


def test_a_run_on_tokens_trains_saves_and_loads_with_its_tokenizer(tmp_path):
    train_text, held_text = lm.split_text(SMALL_TEXT, TINY.fraction)
    model_bytes = lm.train_tokenizer(train_text, 80)
    record = lm.save_tokenizer(tmp_path, "small", model_bytes, {"vocab_size": 80})
    assert record["sha256"] == hashlib.sha256(model_bytes).hexdigest() and record["pieces"] == 80
    tokenizer = lm.load_tokenizer("small", tmp_path)
    model, log = lm.train(TINY, 3, SMALL_TEXT, tokenizer=tokenizer)
    assert model.vocab_size == 80 and log == lm.train(TINY, 3, SMALL_TEXT, tokenizer=tokenizer)[1]
    held_out = tokenizer.encode(held_text)  # the held-out tokens train evaluates on
    assert log["eval"][-1]["held_out"] == pytest.approx(lm.evaluate(model, held_out), rel=1e-12)
    lm.save_run(tmp_path, "tiny-tokens", TINY, 3, model, log, tokenizer)
    run = lm.load_run("tiny-tokens", tmp_path)
    assert isinstance(run.vocab, lm.Tokenizer) and run.vocab.sha256 == tokenizer.sha256
    for a, b in zip(run.model.state_dict().values(), model.state_dict().values()):
        numerics.assert_same(a, b)  # a copy, through the file
    (tmp_path / "small.model").write_bytes(lm.train_tokenizer(train_text, 81))
    with pytest.raises(ValueError, match="SHA-256 .* but small.json records"):
        lm.load_tokenizer("small", tmp_path)


@pytest.mark.parametrize("seed, prompt, n", [(13, [1, 2], 9), (14, [4, 0, 5], 8)])
def test_the_sampling_checks_greedy_tokens_are_clear_of_ties(seed, prompt, n):
    """check_sampling compares an answer's greedy tokens with lm.generate's exactly, though the
    two compute the logits differently (with or without the cache, in other shapes). That is
    safe on every CPU only if no step's best logit is within rounding of the next: each step's
    margin must be far above float64's rounding."""
    import checks_build_it_yourself as checks

    model = checks._tiny_lm(seed)
    margins = []
    hook = model.register_forward_hook(
        lambda module, args, out: margins.append(float(torch.topk(out[0, -1], 2).values.diff().abs())))
    with torch.no_grad():
        lm.generate(model, torch.tensor(prompt), n, temperature=0.0, cache=False)
    hook.remove()
    assert len(margins) == n and min(margins) > 1e-6, margins
