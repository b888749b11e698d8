"""The checks of Chapter 14, Build it yourself: the model of chapter 13 written by the learner
(the machinery: checking.py)."""

from __future__ import annotations

import math

import torch

from checking import Check, Rule, module_rules, tensor_like

# lm_logits(tokens, weights, num_heads) -> (B, T, n_vocab): the decoder-only model of chapter
# "The Transformer block" written from its parts, with the weights of a tied DecoderLM given
# under its state_dict's names (no "unembed.weight": the output is the embedding's)


def _model_rules() -> list[Rule]:
    """The whole model, however reached: the module's DecoderLM and lm.build, and PyTorch's
    Transformer layers and their fused kernel (the book's TransformerBlock is allowed)."""
    def objects():
        from torch import nn
        return [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
                nn.TransformerDecoder, nn.Transformer]
    return [Rule("PyTorch's Transformer layers (nn.TransformerEncoderLayer, nn.Transformer, ...)",
                 aten=("_transformer_encoder", "_transformer_decoder"), python=objects),
            *module_rules("DecoderLM", module="transformer"),
            *module_rules("build", module="lm")]


def _warm_model() -> None:
    """A model's forward once before any recording (its first call sets up what later ones
    reuse), and the book's block built once."""
    model, _ = _book_model(0, 5, 4, 8, 2, 16, 1)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))


check_lm_logits = Check("check_lm_logits", rules=_model_rules(),
                        unchanged="one block, one head", prepare=lambda: _warm_model())


def _book_model(seed, vocab, n_pos, d_model, num_heads, d_ff, num_layers, dtype=torch.float32):
    """A tied, pre-LN, GELU DecoderLM with weights drawn from ``seed`` (biases, norms and the
    embeddings moved away from their initial values, so that each is seen), in eval mode, and
    its weights as the exercise gives them: the state_dict without ``unembed.weight``."""
    from transformer import DecoderLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DecoderLM(vocab, n_pos, d_model, num_heads, d_ff, num_layers, tie_weights=True,
                          dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(dtype))
    weights = {name: t.clone() for name, t in model.state_dict().items()
               if name != "unembed.weight"}
    return model.eval(), weights


def _tokens(seed, B, T, vocab):
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _variant(model, tokens, *, final_norm=True, causal=True, positions="start", scaled=False,
             post_ln=False, out="logits"):
    """What a model written with one mistake computes (the named mistakes of _compare_lm)."""
    import copy
    B, T = tokens.shape
    E, P = model.embed.weight, model.position.weight
    where = torch.arange(T) if positions == "start" else torch.arange(len(P) - T, len(P))
    x = E[tokens] * (E.shape[1] ** 0.5 if scaled else 1.0)
    if positions is not None:
        x = x + P[where]
    for block in model.blocks:
        if post_ln:
            block = copy.deepcopy(block)
            block.norm_first = False
        x = block(x, is_causal=causal)
    if final_norm:
        x = model.final_norm(x)
    logits = x @ E.T
    if out == "softmax":
        return torch.softmax(logits, dim=-1)
    if out == "log_softmax":
        return torch.log_softmax(logits, dim=-1)
    return logits


def _lm_call(fn, where, tokens, weights, num_heads, vocab):
    out = fn(tokens, weights, num_heads)
    tensor_like(out, (*tokens.shape, vocab), where)
    if not out.is_floating_point():
        raise AssertionError(f"{where}: expected floating logits, got {out.dtype}")
    return out


def _lm_tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-4


def _compare_lm(fn, where, seed, vocab, n_pos, d_model, num_heads, d_ff, num_layers, B, T,
                dtype=torch.float32):
    """The answer's logits against the DecoderLM that holds the same weights; if they differ,
    the mistake they reproduce."""
    model, weights = _book_model(seed, vocab, n_pos, d_model, num_heads, d_ff, num_layers, dtype)
    tokens = _tokens(seed, B, T, vocab)
    got = _lm_call(fn, where, tokens, weights, num_heads, vocab).detach()
    with torch.no_grad():
        want = model(tokens)
    tol = _lm_tol(dtype) * (1 + float(want.abs().max()))
    if torch.allclose(got.to(want.dtype), want, rtol=0, atol=tol):
        return got
    if not torch.isfinite(got).all():
        raise AssertionError(f"{where}: NaN or inf in the logits")
    mistakes = [
        (dict(final_norm=False), "the final layer norm is missing: normalise the stream with "
         "final_norm.weight and final_norm.bias before the output"),
        (dict(causal=False), "every position sees the tokens after it: the blocks must attend "
         "causally (is_causal=True), or each logit reads the token it predicts"),
        (dict(positions=None), "the position embedding is not added: x = E[tokens] + "
         "position.weight[:T]"),
        (dict(positions="end"), "the positions are the last T rows of position.weight; the "
         "first token is at position 0, so add position.weight[:T]"),
        (dict(scaled=True), "the token embeddings are multiplied by sqrt(d_model); DecoderLM "
         "adds them to the positions unscaled"),
        (dict(post_ln=True), "the blocks are post-LN; the model's are pre-LN (each branch "
         "reads the normalised stream and adds to it)"),
        (dict(out="softmax"), "these are probabilities (a softmax of the logits); return the "
         "logits themselves"),
        (dict(out="log_softmax"), "these are log-probabilities (a log_softmax of the logits); "
         "return the logits themselves"),
    ]
    got = got.to(want.dtype)
    with torch.no_grad():
        for change, message in mistakes:
            wrong = _variant(model, tokens, **change)
            if torch.allclose(got, wrong, rtol=0, atol=tol) and not torch.allclose(
                    wrong, want, rtol=0, atol=tol):
                raise AssertionError(f"{where}: {message}")
    err = float((got - want).abs().max())
    raise AssertionError(f"{where}: differs from DecoderLM's logits by up to {err:.3g}")


@check_lm_logits.case("shapes")
def _(fn):
    for V, P, D, H, L, B, T in ((7, 6, 8, 2, 1, 2, 5), (5, 4, 12, 3, 2, 1, 4)):
        _, weights = _book_model(1, V, P, D, H, 2 * D, L)
        _lm_call(fn, f"n_vocab {V}, d_model {D}, {L} block(s), tokens ({B}, {T})",
                 _tokens(1, B, T, V), weights, H, V)


@check_lm_logits.case("one block, one head")
def _(fn):
    _compare_lm(fn, "n_vocab 6, d_model 8, one block of one head, tokens (2, 5)",
                2, 6, 5, 8, 1, 16, 1, 2, 5)


@check_lm_logits.case("fewer tokens than positions")
def _(fn):
    _compare_lm(fn, "two blocks of two heads, 10 positions, tokens (2, 4)",
                3, 9, 10, 8, 2, 24, 2, 2, 4)


@check_lm_logits.case("four blocks of four heads")
def _(fn):
    _compare_lm(fn, "n_vocab 11, d_model 16, four blocks of four heads, tokens (2, 6)",
                4, 11, 6, 16, 4, 32, 4, 2, 6)


@check_lm_logits.case("causal: a later token changes no earlier logit")
def _(fn):
    where = "two blocks, tokens (1, 6), then the same with the last token changed"
    first = _compare_lm(fn, where, 5, 7, 6, 8, 2, 16, 2, 1, 6)
    _, weights = _book_model(5, 7, 6, 8, 2, 16, 2)
    changed = _tokens(5, 1, 6, 7)
    changed[0, -1] = (changed[0, -1] + 1) % 7
    second = _lm_call(fn, where, changed, weights, 2, 7).detach()
    if not torch.allclose(first[:, :-1], second[:, :-1], rtol=0, atol=1e-5):
        raise AssertionError(f"{where}: the logits of positions 0 to 4 change when only the "
                             "token at position 5 changes; the blocks must attend causally "
                             "(is_causal=True)")


@check_lm_logits.case("float64 weights")
def _(fn):
    _compare_lm(fn, "float64 weights, two blocks of two heads, tokens (2, 5)",
                6, 8, 5, 8, 2, 16, 2, 2, 5, dtype=torch.float64)


@check_lm_logits.case("sizes drawn at random", points=2)
def _(fn):
    g = torch.Generator().manual_seed(13)
    for _ in range(2):
        H = int(torch.randint(1, 4, (), generator=g))
        D = H * int(torch.randint(2, 5, (), generator=g))
        V, P = (int(n) for n in torch.randint(3, 12, (2,), generator=g))
        L, B = (int(n) for n in torch.randint(1, 4, (2,), generator=g))
        T = int(torch.randint(1, P + 1, (), generator=g))
        _compare_lm(fn, f"random sizes: n_vocab {V}, {P} positions, d_model {D}, H = {H}, "
                    f"{L} block(s), tokens ({B}, {T})", int(torch.randint(100, (), generator=g)),
                    V, P, D, H, 3 * D, L, B, T)


# train_steps(model, inputs, targets, config) -> (rates (n,), losses (n,), the model's state_dict
# after the n steps), inputs and targets (n, B, T): lm.train's steps written out (AdamW, decay
# on the matrices, clipping, the schedule)


def _train_rules() -> list[Rule]:
    """lm.train itself, and the schedule the exercise asks for, Config.learning_rate."""
    return [*module_rules("train", "Config.learning_rate", module="lm")]


_TRAIN_TEXT: dict = {}


def _text_of(seed: int, n: int = 700) -> str:
    """A text of n characters from 9 letters, the space and the line break, drawn from seed
    with uneven frequencies (the check needs no data file)."""
    if (seed, n) not in _TRAIN_TEXT:
        g = torch.Generator().manual_seed(seed)
        chars = "abcdefgh \n"
        weights = torch.arange(len(chars), 0, -1, dtype=torch.float64)
        ids = torch.multinomial(weights, n, replacement=True, generator=g).tolist()
        _TRAIN_TEXT[seed, n] = "".join(chars[i] for i in ids)
    return _TRAIN_TEXT[seed, n]


def _config(**changes):
    import lm
    values = dict(context=8, d_model=8, num_heads=2, d_ff=16, num_layers=1, batch_size=3,
                  steps=6, eval_every=6, warmup=2, lr=2e-2, min_lr=2e-3, betas=(0.9, 0.99),
                  weight_decay=0.1, clip=1.0)
    values.update(changes)
    return lm.Config(**values)


def _start(config, seed, text, n):
    """What lm.train starts from: its fresh model (from ``seed``) and its first n batches."""
    import lm
    vocab = lm.Vocabulary(text)
    train_part, _ = lm.split(vocab.encode(text), config.fraction)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = lm.build(config, len(vocab))
    data = torch.Generator().manual_seed(seed)
    batches = [lm._batch(train_part, config, data) for _ in range(n)]
    return model.train(), batches


def _steps_like(model, batches, config, *, decay="matrices", clip=True, clip_each=False):
    """lm.train's steps with one change (the named mistakes of _compare_training): the weights
    after them and the losses."""
    import torch.nn.functional as F
    params = list(model.parameters())
    if decay == "matrices":
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": config.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params,
                   "weight_decay": config.weight_decay if decay == "all" else 0.0}]
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    losses = []
    for step, (x, y) in enumerate(batches):
        rate = config.learning_rate(step)
        for group in opt.param_groups:
            group["lr"] = rate
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if clip_each:
            for p in params:
                torch.nn.utils.clip_grad_norm_([p], config.clip)
        elif clip:
            torch.nn.utils.clip_grad_norm_(params, config.clip)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def _train_call(fn, where, model, batches, config):
    import copy
    inputs = torch.stack([x for x, _ in batches])  # (n, B, T)
    targets = torch.stack([y for _, y in batches])
    out = fn(copy.deepcopy(model), inputs, targets, config)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise AssertionError(f"{where}: return a tuple (rates, losses, model.state_dict()), "
                             f"got {type(out).__name__}")
    rates, losses, state = out
    n = len(batches)
    for name, value in (("rates", rates), ("losses", losses)):
        tensor_like(value, (n,), f"{where}, {name}")
        if not value.is_floating_point():
            raise AssertionError(f"{where}: {name} must be floating, got {value.dtype}")
    if not isinstance(state, dict) or set(state) != set(model.state_dict()):
        raise AssertionError(f"{where}: the third result must be the model's state_dict() "
                             "after the last step, under the model's own names")
    return rates, losses, state


def _far(state, want, tol):
    """The name and the difference of the first weight that differs, or None."""
    for name, w in want.items():
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != w.shape:
            return name, math.inf
        err = float((got.detach().double() - w.double()).abs().max())
        if not err <= tol * (1 + float(w.abs().max())):
            return name, err
    return None


def _compare_training(fn, where, config, seed, n, text_seed=0):
    """The answer's n steps against lm.train's (rates, losses and the weights after them); if
    they differ, the mistake they reproduce."""
    import copy
    import lm
    text = _text_of(text_seed)
    model, batches = _start(config, seed, text, n)
    rates, losses, state = _train_call(fn, where, model, batches, config)
    trained, log = lm.train(config, seed, text, until=n)
    want = trained.state_dict()
    tol = 1e-9
    got_rates = [float(r) for r in rates.detach()]
    if not all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
               for a, b in zip(got_rates, log["lr"])):
        step = next(i for i, (a, b) in enumerate(zip(got_rates, log["lr"]))
                    if not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15))
        hint = ""
        if step < config.warmup:
            hint = (f"; the warm-up rises linearly to lr over {config.warmup} steps: "
                    "lr * (t + 1) / warmup at step t")
        elif abs(got_rates[step] - config.lr) < 1e-15:
            hint = "; after the warm-up the rate decays along a cosine, it is not constant"
        raise AssertionError(f"{where}: the learning rate of step {step} is "
                             f"{got_rates[step]:.6g}, expected {log['lr'][step]:.6g}{hint}")
    def loss_error(values, expected):
        """The first step whose loss differs, as (step, got, expected), or None."""
        return next(((t, a, b) for t, (a, b) in enumerate(zip(values, expected))
                     if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)), None)

    got_losses = [float(v) for v in losses.detach()]
    bad = loss_error(got_losses, log["loss"])
    if bad is not None and bad[0] == 0:
        raise AssertionError(f"{where}: the loss of step 0 is {bad[1]:.8g}, expected "
                             f"{bad[2]:.8g}: compute it before the step, the mean of "
                             "F.cross_entropy over every position of the batch")
    far = _far(state, want, tol)
    if far is None and bad is None:
        return
    mistakes = [
        (dict(decay="all"), "weight decay is applied to every parameter; lm.train decays the "
         "matrices only (p.dim() >= 2), not the biases and the norms' gains and shifts"),
        (dict(decay="none"), "no weight decay: the matrices (p.dim() >= 2) take "
         "config.weight_decay"),
        (dict(clip=False), "the gradients are not clipped: clip their global norm to "
         "config.clip after backward(), before the step"),
        (dict(clip_each=True), "each parameter's gradient is clipped on its own; clip the norm "
         "of all the gradients together (torch.nn.utils.clip_grad_norm_ on every parameter)"),
    ]
    for change, message in mistakes:
        wrong, wrong_losses = _steps_like(copy.deepcopy(model), batches, config, **change)
        if (_far(state, wrong, tol) is None and loss_error(got_losses, wrong_losses) is None
                and _far(wrong, want, tol) is not None):
            raise AssertionError(f"{where}: {message}")
    if bad is not None:
        raise AssertionError(f"{where}: the loss of step {bad[0]} is {bad[1]:.8g}, expected "
                             f"{bad[2]:.8g}: the steps before it moved the weights elsewhere")
    name, err = far
    raise AssertionError(f"{where}: after {n} steps the weight {name} differs from "
                         f"lm.train's by up to {err:.3g}")


# what an answer's first optimizer imports, imported in the answer's own process before it runs
# (Check's answer_imports)
OPTIMIZERS = ("torch._dynamo",)


def _warm_training() -> None:
    """lm.train's steps once before any recording: AdamW's first step imports what later ones
    reuse (parts of torch._dynamo among them, which the recording would see as compiled code)."""
    config = _config()
    model, batches = _start(config, 0, _text_of(0), 1)
    _steps_like(model, batches, config)


check_train_steps = Check("check_train_steps", rules=_train_rules(), unchanged="one step",
                          prepare=lambda: _warm_training(), answer_imports=OPTIMIZERS)


@check_train_steps.case("shapes")
def _(fn):
    model, batches = _start(_config(), 1, _text_of(0), 1)
    _train_call(fn, "one step", model, batches, _config())


@check_train_steps.case("one step")
def _(fn):
    _compare_training(fn, "one step", _config(), 2, 1)


@check_train_steps.case("the warm-up and the decay")
def _(fn):
    _compare_training(fn, "the four steps of a run of four, a warm-up of two",
                      _config(steps=4, eval_every=4), 3, 4)


@check_train_steps.case("weight decay on the matrices only")
def _(fn):
    _compare_training(fn, "two steps, weight_decay 0.5, lr 0.1", _config(
        weight_decay=0.5, lr=0.1, min_lr=0.05, warmup=1), 4, 2)


@check_train_steps.case("clipping at config.clip")
def _(fn):
    _compare_training(fn, "two steps, clip 0.05", _config(clip=0.05), 5, 2)


@check_train_steps.case("sizes drawn at random")
def _(fn):
    g = torch.Generator().manual_seed(17)
    H = int(torch.randint(1, 3, (), generator=g))
    D = 4 * H
    steps = int(torch.randint(2, 4, (), generator=g))
    config = _config(d_model=D, num_heads=H, d_ff=2 * D, context=int(torch.randint(
        4, 9, (), generator=g)), num_layers=int(torch.randint(1, 3, (), generator=g)),
        batch_size=int(torch.randint(1, 4, (), generator=g)), steps=steps, eval_every=steps,
        warmup=int(torch.randint(1, 3, (), generator=g)))
    _compare_training(fn, f"random sizes: {config.num_layers} block(s) of {H} head(s), "
                      f"d_model {D}, context {config.context}, batches of "
                      f"{config.batch_size}, {steps} steps", config,
                      int(torch.randint(100, (), generator=g)), steps, text_seed=1)


# sample(logits, temperature, top_k, top_p, generator) -> tokens (...), and
# generate(model, prompt, n, temperature, generator, cache) -> (n,): the sampler and the loop
# of lm.sample and lm.generate


def _sampling_rules() -> list[Rule]:
    """The module's sampler, its truncation and its generation loop."""
    return [*module_rules("sample", "generate", "truncated", module="lm")]


def _warm_sampling() -> None:
    model = _tiny_lm(0)
    with torch.no_grad():
        caches = model.new_caches()
        model(torch.zeros(1, 2, dtype=torch.long), caches=caches)
        model(torch.zeros(1, 1, dtype=torch.long), caches=caches)
    torch.multinomial(torch.ones(2, 3), 1, generator=torch.Generator().manual_seed(0))


check_sampling = Check("check_sampling", rules=_sampling_rules(),
                       unchanged=("temperature", "generate: greedy, past the context"),
                       prepare=lambda: _warm_sampling())

_ROWS = 600  # draws of each distinct row of logits


def _rows(seed, distinct, V, spread=1.5):
    """(distinct * _ROWS, V) float32 logits: ``distinct`` random rows, each repeated _ROWS
    times, so that each row's draws give its frequencies."""
    g = torch.Generator().manual_seed(seed)
    base = spread * torch.randn(distinct, V, generator=g)
    return base.repeat_interleave(_ROWS, dim=0)


def _expected(logits, temperature, top_k, top_p):
    """(distinct, V): the probabilities lm.sample draws each distinct row from."""
    import lm
    z = lm.truncated(logits[::_ROWS].double(), temperature=temperature, top_k=top_k,
                     top_p=top_p)
    return torch.softmax(z, dim=-1)


def _alt_probs(logits, temperature, top_k, top_p, mistake):
    """What a sampler with one mistake draws each distinct row from (None where the mistake
    does not apply)."""
    z = logits[::_ROWS].double()
    V = z.shape[-1]
    if mistake == "times":
        z = z * temperature
    elif mistake != "ignored":
        z = z / temperature
    if top_k is not None:
        if mistake == "ties dropped":
            keep = torch.zeros_like(z, dtype=torch.bool).scatter(
                -1, z.topk(min(top_k, V), dim=-1).indices, True)
            z = z.masked_fill(~keep, -math.inf)
        else:
            kth = z.topk(min(top_k, V), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -math.inf)
    if top_p is not None:
        source = logits[::_ROWS].double() if mistake == "p untempered" else z
        if mistake == "p untempered" and top_k is not None:
            kth = source.topk(min(top_k, V), dim=-1).values[:, -1:]
            source = source.masked_fill(source < kth, -math.inf)
        probs, order = torch.softmax(source, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs
        drop = (probs.cumsum(dim=-1) > top_p) if mistake == "p crossing" else before >= top_p
        drop[:, 0] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return torch.softmax(z, dim=-1)


def _sample_call(fn, where, logits, temperature, top_k, top_p, seed=0):
    out = fn(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    tensor_like(out, logits.shape[:-1], where)
    if out.dtype not in (torch.int64, torch.int32):
        raise AssertionError(f"{where}: expected integer token ids, got {out.dtype}")
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= logits.shape[-1]):
        raise AssertionError(f"{where}: token ids must lie in [0, {logits.shape[-1]})")
    return out


def _fits(tokens, probs):
    """Whether the draws of each distinct row fit probs (distinct, V): no token of probability
    0, and every frequency within 4.5 standard errors of its probability."""
    counts = torch.stack([torch.bincount(tokens[i * _ROWS:(i + 1) * _ROWS].long(),
                                         minlength=probs.shape[-1])
                          for i in range(probs.shape[0])]).double()
    if bool(((probs == 0) & (counts > 0)).any()):
        return False
    freq = counts / _ROWS
    return bool(((freq - probs).abs() <= 4.5 * (probs * (1 - probs) / _ROWS).sqrt()
                 + 2e-3).all())


def _compare_sample(fn, where, logits, temperature, top_k=None, top_p=None, seed=0):
    """The answer's draws against lm.sample's with the same generator; if they differ, whether
    they still follow lm.sample's distribution; if not, the mistake whose distribution they
    follow."""
    import lm
    got = _sample_call(fn, where, logits, temperature, top_k, top_p, seed).reshape(-1)
    want = lm.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                     generator=torch.Generator().manual_seed(seed)).reshape(-1)
    if torch.equal(got.long(), want):
        return
    probs = _expected(logits.reshape(-1, logits.shape[-1]), temperature, top_k, top_p)
    if _fits(got, probs):
        return
    mistakes = [
        ("times", "the logits are multiplied by the temperature; divide them by it"),
        ("ignored", "the temperature is not used: draw from softmax(logits / temperature)"),
        ("ties dropped", "exactly top_k tokens are kept; every token equal to the k-th "
         "largest logit is kept too (z < kth is dropped, not the rest of topk's indices)"),
        ("p crossing", "the token whose probability makes the kept mass reach top_p is "
         "dropped; top-p keeps the smallest set of the most likely tokens whose mass reaches "
         "top_p, so that token is in it"),
        ("p untempered", "top-p reads the probabilities before the temperature; divide by the "
         "temperature first, then cut the tail"),
    ]
    flat = logits.reshape(-1, logits.shape[-1])
    for mistake, message in mistakes:
        if mistake == "ties dropped" and top_k is None or mistake.startswith("p") and (
                top_p is None):
            continue
        alt = _alt_probs(flat, temperature, top_k, top_p, mistake)
        if _fits(got, alt) and not torch.allclose(alt, probs, atol=1e-9):
            raise AssertionError(f"{where}: {message}")
    drawn = ((probs == 0) & torch.stack([torch.bincount(
        got[i * _ROWS:(i + 1) * _ROWS].long(), minlength=probs.shape[-1]) > 0
        for i in range(probs.shape[0])])).nonzero()
    if len(drawn):
        row, token = (int(v) for v in drawn[0])
        raise AssertionError(f"{where}: token {token} is drawn from row {row * _ROWS}, where "
                             "temperature, top_k and top_p leave it no probability")
    raise AssertionError(f"{where}: the tokens drawn are not distributed as "
                         "softmax(truncated logits / temperature): their frequencies over "
                         f"{_ROWS} draws of each row are too far from it")


@check_sampling.case("shapes")
def _(sample, generate):
    for shape in ((7,), (3, 7), (2, 3, 5)):
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        _sample_call(sample, f"sample, logits {shape}", logits, 1.0, None, None)


@check_sampling.case("temperature 0: the most likely token")
def _(sample, generate):
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0], [-2.0, -1.0, -3.0,
                                                                         -1.5]])
    where = "sample, temperature 0, rows with equal largest logits"
    got = _sample_call(sample, where, logits, 0.0, None, None)
    assert got.tolist() == [1, 0, 1], (
        f"{where}: got {got.tolist()}, expected [1, 0, 1]: temperature 0 takes the most likely "
        "token, the first of equal ones (argmax), and draws nothing")
    got = _sample_call(sample, "sample, temperature 0 with top_k 2", logits, 0.0, 2, 0.5)
    assert got.tolist() == [1, 0, 1], (
        f"sample, temperature 0 with top_k 2 and top_p 0.5: got {got.tolist()}, expected "
        "[1, 0, 1], the most likely token")


@check_sampling.case("temperature")
def _(sample, generate):
    for tau in (0.5, 2.0):
        _compare_sample(sample, f"sample, temperature {tau}, 3 rows of 6 logits drawn "
                        f"{_ROWS} times each", _rows(2, 3, 6), tau, seed=int(tau * 10))


@check_sampling.case("top-k keeps ties with the k-th")
def _(sample, generate):
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 1.0, 1.0]])
    logits = logits.repeat_interleave(_ROWS, dim=0)
    _compare_sample(sample, "sample, top_k 2 on rows whose 2nd and 3rd logits tie",
                    logits, 1.0, top_k=2, seed=3)
    _compare_sample(sample, "sample, top_k 3, temperature 0.7", _rows(4, 2, 8), 0.7, top_k=3,
                    seed=4)


@check_sampling.case("top-p keeps the smallest set that reaches p")
def _(sample, generate):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]]).log_softmax(-1)  # probabilities
    logits = logits.repeat_interleave(_ROWS, dim=0)  # 0.64, 0.24, 0.09, 0.03, 0.01
    _compare_sample(sample, "sample, top_p 0.8 on probabilities 0.64, 0.24, 0.09, 0.03, "
                    "0.01", logits, 1.0, top_p=0.8, seed=5)
    _compare_sample(sample, "sample, top_p 1e-6: never fewer than one token", logits, 1.0,
                    top_p=1e-6, seed=6)
    _compare_sample(sample, "sample, top_p 0.9, temperature 2", _rows(7, 2, 6), 2.0,
                    top_p=0.9, seed=7)


@check_sampling.case("top-k, then top-p")
def _(sample, generate):
    _compare_sample(sample, "sample, temperature 0.8, top_k 4, top_p 0.7", _rows(8, 3, 9),
                    0.8, top_k=4, top_p=0.7, seed=8)


@check_sampling.case("the generator decides the draw")
def _(sample, generate):
    logits = _rows(9, 1, 6)[:200]
    where = "sample, 200 draws, the same seed twice"
    first = _sample_call(sample, where, logits, 1.0, None, None, seed=11)
    torch.manual_seed(12345)  # the global state changes: the draw must not read it
    second = _sample_call(sample, where, logits, 1.0, None, None, seed=11)
    other = _sample_call(sample, where, logits, 1.0, None, None, seed=12)
    if not torch.equal(first, second) or torch.equal(first, other):
        raise AssertionError(f"{where}: the tokens do not follow the generator; draw with it "
                             "(torch.multinomial(probs, 1, generator=generator))")


def _tiny_lm(seed, max_len=6):
    """A float64 DecoderLM of 9 tokens, its weights from seed, its matrices scaled up so that
    its greedy choice depends on the whole window."""
    import lm
    config = lm.Config(context=max_len, d_model=8, num_heads=2, d_ff=16, num_layers=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = lm.build(config, 9)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model.eval()


def _generate_call(fn, where, model, prompt, n, temperature, seed, cache):
    out = fn(model, prompt, n, temperature, torch.Generator().manual_seed(seed), cache)
    tensor_like(out, (n,), where)
    if out.dtype not in (torch.int64, torch.int32):
        raise AssertionError(f"{where}: expected integer token ids, got {out.dtype}")
    return out.long()


@check_sampling.case("generate: greedy, past the context")
def _(sample, generate):
    import lm
    model, prompt = _tiny_lm(13), torch.tensor([1, 2])
    want = lm.generate(model, prompt, 9, temperature=0.0)
    where = "generate, temperature 0, cache=False, 9 tokens after 2 with 6 positions"
    got = _generate_call(generate, where, model, prompt, 9, 0.0, 0, False)
    if not torch.equal(got, want):
        t = int((got != want).nonzero()[0])
        hint = (": when the window is full, restart it from its last max_len // 2 tokens"
                if t >= model.max_len - len(prompt) else "")
        raise AssertionError(f"{where}: token {t} is {int(got[t])}, lm.generate gives "
                             f"{int(want[t])}{hint}")


@check_sampling.case("generate: the cache changes no token")
def _(sample, generate):
    import lm
    model, prompt = _tiny_lm(14), torch.tensor([4, 0, 5])
    want = lm.generate(model, prompt, 8, temperature=0.0)
    where = "generate, temperature 0, cache=True, 8 tokens after 3 with 6 positions"
    got = _generate_call(generate, where, model, prompt, 8, 0.0, 0, True)
    assert torch.equal(got, want), (
        f"{where}: {got.tolist()}, lm.generate gives {want.tolist()}: with the cache feed only "
        "the new token, and after a restart the kept tokens into new caches")
    where = "generate, temperature 1, the same seed with and without the cache"
    cached = _generate_call(generate, where, model, prompt, 5, 1.0, 15, True)
    plain = _generate_call(generate, where, model, prompt, 5, 1.0, 15, False)
    assert torch.equal(cached, plain), (
        f"{where}: {cached.tolist()} with the cache, {plain.tolist()} without")


@check_sampling.case("sizes drawn at random")
def _(sample, generate):
    g = torch.Generator().manual_seed(21)
    for _ in range(2):
        V = int(torch.randint(3, 12, (), generator=g))
        tau = 0.3 + 1.5 * float(torch.rand((), generator=g))
        k = int(torch.randint(1, V + 3, (), generator=g))
        p = 0.3 + 0.6 * float(torch.rand((), generator=g))
        _compare_sample(sample, f"sample, {V} logits, temperature {tau:.3f}, top_k {k}, "
                        f"top_p {p:.3f}", _rows(int(torch.randint(100, (), generator=g)), 2, V),
                        tau, top_k=k, top_p=p, seed=int(torch.randint(100, (), generator=g)))


# train_lm(train_tokens, n_vocab, seconds) -> (weights, num_heads): a model of the chapter's
# kind, trained by the answer on the training text within `seconds`, its weights under
# DecoderLM's names; judged by its loss on the held-out text, which the answer never sees

CAPSTONE_SECONDS = 60  # what the exercise gives train_lm: on Colab's CPU, enough to pass
CAPSTONE_ALLOWED = 1.1 * CAPSTONE_SECONDS  # the longest a call may take
_CAPSTONE: dict = {}  # the last answer trained: its function, its outcome, its loss
_CAPSTONE_DATA: dict = {}


def _capstone_rules() -> list[Rule]:
    """The whole model (as in check_lm_logits), lm.train, and every way to the chapter's
    trained weights or to the held-out text: lm.load_text, lm.load_run, the stored runs."""
    import importlib
    return [*_model_rules(), *module_rules("train", "load_text", "load_run", module="lm"),
            Rule("the book's stored runs and files (stored.py)",
                 python=lambda: [importlib.import_module("stored")])]


def _capstone_data() -> dict:
    """The chapter's text split as the chapter splits it, and the counts' held-out losses."""
    if not _CAPSTONE_DATA:
        import lm
        text = lm.load_text()
        vocab = lm.Vocabulary(text)
        train, held_out = lm.split(vocab.encode(text))
        V = len(vocab)
        _CAPSTONE_DATA.update(train=train, held_out=held_out, V=V,
                              unigram=lm.unigram_loss(train, held_out, V),
                              bigram=lm.bigram_loss(train, held_out, V))
    return _CAPSTONE_DATA


def _warm_capstone() -> None:
    _capstone_data()
    _warm_model()
    _warm_training()


def _trained(fn) -> tuple:
    """(what the answer returned, the seconds its call took), from one call for each function
    (every case reads the same run; a new run of the whole check calls it afresh), or the
    error that every case then reports."""
    import time
    if _CAPSTONE.get("fn") is not fn.fn:
        from checking import ForbiddenWork, NotWritten
        data = _capstone_data()
        start = time.perf_counter()
        try:
            out = fn(data["train"], data["V"], CAPSTONE_SECONDS)
            outcome = (out, time.perf_counter() - start)
        except (NotWritten, ForbiddenWork) as err:
            outcome = err
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 (every case reports it)
            outcome = AssertionError(f"{fn.__name__} raised {type(err).__name__}: {err}")
        _CAPSTONE.clear()
        _CAPSTONE.update(fn=fn.fn, outcome=outcome, mutated=list(fn.mutated),
                         trivial=list(fn.trivial))
    else:  # what the call showed, for this case's judgement too (arguments left unchanged)
        fn.mutated += _CAPSTONE["mutated"]
        fn.trivial += _CAPSTONE["trivial"]
    if isinstance(_CAPSTONE["outcome"], BaseException):
        raise _CAPSTONE["outcome"]
    return _CAPSTONE["outcome"]


def _returned(fn) -> tuple:
    """(weights, num_heads) as the answer returned them."""
    out, _ = _trained(fn)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise AssertionError(f"{fn.__name__} should return (weights, num_heads), got "
                             f"{type(out).__name__}")
    return out


def _capstone_model(weights, num_heads, V):
    """The book's DecoderLM holding the answer's weights (tied unless they hold
    unembed.weight), in eval mode; AssertionError naming what does not fit."""
    from transformer import DecoderLM
    if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise AssertionError("weights should be a dict {name: tensor}, as model.state_dict() "
                             f"gives, got {type(weights).__name__}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise AssertionError(f"num_heads should be a positive int, got {num_heads!r}")
    for name in ("embed.weight", "position.weight", "blocks.0.linear1.weight"):
        if name not in weights or weights[name].dim() != 2:
            raise AssertionError(
                f"no 2-D {name} among the weights' names ({', '.join(sorted(weights)[:4])}, "
                "...): name them as DecoderLM's state_dict does (see the exercise)")
    E, P = weights["embed.weight"], weights["position.weight"]
    if E.shape[0] != V or P.shape[1] != E.shape[1] or not E.is_floating_point():
        raise AssertionError(f"embed.weight {tuple(E.shape)} {E.dtype} and position.weight "
                             f"{tuple(P.shape)} should be floating, (n_vocab = {V}, d_model) "
                             "and (context, d_model)")
    D = E.shape[1]
    if D % num_heads:
        raise AssertionError(f"d_model = {D} is not a multiple of num_heads = {num_heads}")
    L = 0
    while f"blocks.{L}.linear1.weight" in weights:
        L += 1
    tied = "unembed.weight" not in weights
    model = DecoderLM(V, P.shape[0], D, num_heads, weights["blocks.0.linear1.weight"].shape[0],
                      L, tie_weights=tied, dtype=E.dtype)
    state = dict(weights, **({"unembed.weight": E} if tied else {}))
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise AssertionError(
            f"{L} block(s) of DecoderLM's names: "
            + (f"missing {', '.join(missing[:3])}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not DecoderLM's: {', '.join(extra[:3])}" if extra else ""))
    for name, tensor in want.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise AssertionError(f"{name} has shape {tuple(state[name].shape)}; DecoderLM of "
                                 f"these sizes needs {tuple(tensor.shape)}")
    model.load_state_dict({k: v.detach().to(E.dtype) for k, v in state.items()})
    return model.eval()


def _held_out_loss(fn) -> float:
    """The answer's model's loss on the held-out text, as lm.evaluate measures it (windows of
    the model's context, each from its start)."""
    import lm
    weights, num_heads = _returned(fn)
    if "loss" not in _CAPSTONE:
        data = _capstone_data()
        loss = lm.evaluate(_capstone_model(weights, num_heads, data["V"]), data["held_out"])
        if not math.isfinite(loss):
            raise AssertionError(f"the held-out loss is {loss}: NaN or inf in the weights or "
                                 "the logits")
        _CAPSTONE["loss"] = loss
    return _CAPSTONE["loss"]


def capstone_measurement() -> dict | None:
    """What check_lm_capstone measured of the last answer it trained: the held-out loss, the
    counts' losses and the seconds the training took (None before a model was measured)."""
    if "loss" not in _CAPSTONE:
        return None
    data = _capstone_data()
    return {"held_out": _CAPSTONE["loss"], "unigram": data["unigram"],
            "bigram": data["bigram"], "seconds": _CAPSTONE["outcome"][1]}


check_lm_capstone = Check("check_lm_capstone", rules=_capstone_rules(),
                          unchanged="weights under DecoderLM's names",
                          prepare=lambda: _warm_capstone(), begin=lambda: _CAPSTONE.clear(),
                          answer_imports=OPTIMIZERS)


@check_lm_capstone.case("weights under DecoderLM's names")
def _(fn):
    weights, num_heads = _returned(fn)
    _capstone_model(weights, num_heads, _capstone_data()["V"])


@check_lm_capstone.case("within the time it is given")
def _(fn):
    _returned(fn)  # (weights, num_heads), in whatever state
    _, seconds = _trained(fn)
    assert seconds <= CAPSTONE_ALLOWED, (
        f"training took {seconds:.0f} s of the {CAPSTONE_SECONDS} s given (allowed: "
        f"{CAPSTONE_ALLOWED:.0f} s): read the clock in your loop (time.perf_counter()) and "
        "stop in time")


@check_lm_capstone.case("below the unigram counts on the held-out text")
def _(fn):
    loss, data = _held_out_loss(fn), _capstone_data()
    assert loss < data["unigram"], (
        f"held-out loss {loss:.3f} nats, not below the unigram counts' {data['unigram']:.3f}: "
        "the model has not learned even which characters are common")


@check_lm_capstone.case("below the bigram counts on the held-out text", points=2)
def _(fn):
    loss, data = _held_out_loss(fn), _capstone_data()
    assert loss < data["bigram"], (
        f"held-out loss {loss:.3f} nats, not below the bigram counts' {data['bigram']:.3f}: "
        "train longer (more steps in the time), or with a larger learning rate")
