"""The checks of Chapter 13, A language model on real text (the machinery: checking.py)."""

from __future__ import annotations

import math

import torch

from checking import Check, Rule, module_rules, tensor_like

# bigram_loss(train, held_out, vocab_size, alpha) -> () tensor, nats per predicted character

check_bigram_loss = Check(
    "check_bigram_loss", rules=module_rules("bigram_loss", module="lm"),
    unchanged="a text of five characters")


def _by_loops(train, held_out, V, alpha, *, backwards=False, by_column=False, source=None,
              denominator=None, numerator_only=False, log=math.log, reduce="mean"):
    """The loss by counting in Python, in float64; the keyword arguments give the named
    mistakes: pairs counted backwards, each count divided by its column's total, counts from
    another text, another denominator than n_a + alpha V, alpha on the numerator only, another
    logarithm, another reduction."""
    counted = (train if source is None else source).tolist()
    pairs = {}
    for a, b in zip(counted, counted[1:]):
        if backwards:
            a, b = b, a
        pairs[a, b] = pairs.get((a, b), 0) + 1
    row = {}
    for (a, b), n in pairs.items():
        row[b if by_column else a] = row.get(b if by_column else a, 0) + n
    terms = []
    for a, b in zip(held_out.tolist(), held_out[1:].tolist()):
        top = pairs.get((a, b), 0) + alpha
        if by_column:
            bottom = row.get(b, 0) + alpha * V
        elif numerator_only:
            bottom = row.get(a, 0)
        elif denominator is not None:
            bottom = denominator(row.get(a, 0), alpha, V)
        else:
            bottom = row.get(a, 0) + alpha * V
        if top == 0 or bottom == 0:
            terms.append(math.inf if bottom else math.nan)
        else:
            terms.append(-log(top / bottom))
    if reduce == "sum":
        return sum(terms)
    if reduce == "chars":  # divided by the number of characters, not of predictions
        return sum(terms) / len(held_out)
    return sum(terms) / len(terms)


def _call(fn, where, train, held_out, V, alpha):
    try:
        out = fn(train, held_out, V, alpha)
    except (RuntimeError, IndexError, ZeroDivisionError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; count the pairs (train[t], train[t + 1]) "
            "in a (vocab_size, vocab_size) table, add alpha, divide each row by its sum") from None
    tensor_like(out, (), where)
    if not out.is_floating_point():
        raise AssertionError(f"{where}: expected a floating-point loss, got {out.dtype}")
    return float(out)


def _same(got, want, tol=1e-5):
    if math.isinf(want) or math.isinf(got):
        return got == want
    return math.isclose(got, want, rel_tol=tol, abs_tol=tol)


def _compare(fn, where, train, held_out, V, alpha):
    """The answer against the loss by loops; if they differ, the mistake it reproduces."""
    got = _call(fn, where, train, held_out, V, alpha)
    want = _by_loops(train, held_out, V, alpha)
    if _same(got, want):
        return
    if math.isnan(got):
        raise AssertionError(
            f"{where}: NaN; with alpha = 0 a pair never seen in training has probability 0 and "
            "costs -ln 0 = inf, but 0 * log 0 or 0 / 0 gives NaN: take the log of the "
            "probabilities of the pairs that occur in held_out only")
    seen = {a for a in train[:-1].tolist()}
    unseen_rows = len(seen) < V
    mistakes = [
        (dict(backwards=True), "the table is transposed: counts[a, b] must count how often b "
         "follows a, the pairs (train[t], train[t + 1]), and p(b | a) is read at [a, b]"),
        (dict(by_column=True), "each count is divided by its column's total; p(b | a) divides "
         "by the total of row a, the pairs that start with a (sum over dim=1)"),
        (dict(source=held_out), "the pairs are counted in held_out; count them in train and "
         "evaluate them on held_out"),
        (dict(numerator_only=True), "alpha is added to the count of the pair but not to the "
         "row's total: the row sums to n_a + alpha * vocab_size"),
        (dict(denominator=lambda n, a, V: n + a), "the row's total is n_a + alpha; alpha is "
         "added to every one of the vocab_size counts of the row, so it is n_a + alpha * "
         "vocab_size"),
        (dict(log=math.log2), "the loss is in bits (log2); the chapter measures nats, the "
         "natural logarithm"),
        (dict(reduce="sum"), "summed, not averaged over the predictions"),
        (dict(reduce="chars"), "divided by the number of characters of held_out; there are "
         "one fewer predictions, len(held_out) - 1"),
    ]
    if alpha:
        mistakes.append((dict(alpha=0.0), "alpha is not used: add alpha to every count"))
        if unseen_rows:
            mistakes.append((dict(denominator=lambda n, a, _V: n + a * len(seen)),
                             "the row's total uses the characters that occur in train, not "
                             "vocab_size: a character that never occurs still gets alpha"))
    named = []  # every listed mistake that gives the answer's number here
    for change, message in mistakes:
        kwargs = {"alpha": alpha, **change}
        wrong = _by_loops(train, held_out, V, kwargs.pop("alpha"), **kwargs)
        if not math.isnan(wrong) and _same(got, wrong) and not _same(wrong, want):
            named.append(message)
    if len(named) == 1:
        raise AssertionError(f"{where}: {named[0]}")
    if named:  # these inputs cannot tell the mistakes apart: say so, and name them all
        raise AssertionError(f"{where}: {got:.6g} nats, expected {want:.6g}; on these inputs "
                             "that is what each of these mistakes gives: " + "; or ".join(named))
    raise AssertionError(f"{where}: {got:.6g} nats, expected {want:.6g}")


def _text(g, n, V, skew=1.5):
    """n tokens in [0, V), token k drawn with a weight proportional to (k + 1) ** -skew, so
    that some pairs repeat and others never occur."""
    weights = torch.arange(1, V + 1, dtype=torch.float64) ** -skew
    return torch.multinomial(weights, n, replacement=True, generator=g)


@check_bigram_loss.case("shapes")
def _(fn):
    g = torch.Generator().manual_seed(0)
    for n, m, V in ((40, 10, 5), (12, 2, 3), (100, 30, 8)):
        _call(fn, f"train of {n}, held_out of {m} tokens, vocab_size {V}", _text(g, n, V),
              _text(g, m, V), V, 1.0)


@check_bigram_loss.case("a text of five characters")
def _(fn):
    train, held = torch.tensor([0, 1, 0, 1, 1]), torch.tensor([0, 1, 1])
    _compare(fn, "train [0, 1, 0, 1, 1], held_out [0, 1, 1], vocab_size 2, alpha 1", train,
             held, 2, 1.0)


@check_bigram_loss.case("alpha given")
def _(fn):
    g = torch.Generator().manual_seed(1)
    train, held = _text(g, 200, 6), _text(g, 60, 6)
    for alpha in (0.5, 2.0):
        _compare(fn, f"train of 200 and held_out of 60 tokens, vocab_size 6, alpha {alpha}",
                 train, held, 6, alpha)


@check_bigram_loss.case("alpha = 0 and a pair never seen")
def _(fn):
    train, held = torch.tensor([0, 1, 0, 1, 2, 0]), torch.tensor([0, 1, 1])  # (1, 1) unseen
    where = "train [0, 1, 0, 1, 2, 0], held_out [0, 1, 1], vocab_size 3, alpha 0"
    _compare(fn, where, train, held, 3, 0.0)
    seen = torch.tensor([0, 1, 2, 0])  # every pair of it occurs in train
    _compare(fn, "the same train, held_out [0, 1, 2, 0], alpha 0", train, seen, 3, 0.0)


@check_bigram_loss.case("characters that never occur")
def _(fn):
    g = torch.Generator().manual_seed(2)
    train, held = _text(g, 150, 4), _text(g, 40, 4)  # tokens 0..3 of a vocabulary of 7
    _compare(fn, "train and held_out using 4 of vocab_size 7, alpha 1", train, held, 7, 1.0)


@check_bigram_loss.case("sizes drawn at random")
def _(fn):
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        V = int(torch.randint(4, 12, (), generator=g))
        n, m = (int(torch.randint(20, 300, (), generator=g)) for _ in range(2))
        alpha = float(torch.rand((), generator=g)) * 2
        _compare(fn, f"random tokens: train of {n}, held_out of {m}, vocab_size {V}, alpha "
                 f"{alpha:.3f}", _text(g, n, V), _text(g, m, V), V, alpha)
