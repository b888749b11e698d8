"""The checks of Chapter 12, Induction heads (the machinery: checking.py)."""

from __future__ import annotations

import torch

from checking import Check, module_rules, tensor_like

# induction_score(weights, first, second, length) -> (H,)
#   weights (B, H, T, T), one layer's attention; first, second, length (B,) integers

check_induction_score = Check(
    "check_induction_score",
    rules=module_rules("induction_score", "Batch.copyable", module="induction"),
    unchanged="a batch of sequences of different lengths")


def _weights(g, B, H, T):
    """Causal attention weights (B, H, T, T) in float32, each row a softmax of random scores
    over the keys up to its query: every entry different, so that every mistake shows."""
    scores = 2 * torch.randn(B, H, T, T, generator=g, dtype=torch.float64)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1).float()


def _positions(g, B, T):
    """first, second, length (B,) of segments that fit in T positions after BOS: length at
    least 2, first >= 1, second >= first + length, second + length - 1 <= T."""
    rows = []
    for _ in range(B):
        length = int(torch.randint(2, (T - 1) // 2 + 1, (), generator=g))
        room = T - 1 - 2 * length  # shared by the gap and the first copy's offset
        gap = int(torch.randint(0, room + 1, (), generator=g))
        first = 1 + int(torch.randint(0, room - gap + 1, (), generator=g))
        rows.append((first, first + length + gap, length))
    return tuple(torch.tensor(column) for column in zip(*rows))


def _score(weights, first, second, length, *, queries=(0, -1), offset=1, per_sequence=False):
    """The score by loops over sequences and queries, in float64; the keyword arguments give
    the named mistakes: the queries from second + queries[0] to second + length - 1 +
    queries[1] (the right ones: second .. second + length - 2), the key i - (second - first) +
    offset, and the mean per sequence first."""
    w = weights.double()
    B, H = w.shape[:2]
    total, count, means = torch.zeros(H, dtype=torch.float64), 0, []
    for b in range(B):
        p1, p2, n = int(first[b]), int(second[b]), int(length[b])
        own, own_count = torch.zeros(H, dtype=torch.float64), 0
        for i in range(p2 + queries[0], p2 + n + queries[1]):
            key = i - (p2 - p1) + offset
            if not (0 <= key <= i < w.shape[-1]):
                continue
            own += w[b, :, i, key]
            own_count += 1
        total, count = total + own, count + own_count
        means.append(own / max(own_count, 1))
    return torch.stack(means).mean(0) if per_sequence else total / count


def _call(fn, where, weights, first, second, length):
    try:
        out = fn(weights, first, second, length)
    except (RuntimeError, IndexError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; weights is (B, H, T, T) and first, second "
            "and length are (B,): index the weights with one sequence index, one query and one "
            "key per copyable position, every head at once") from None
    tensor_like(out, weights.shape[1:2], f"{where}: one score per head, (H,) =")
    return out


def _compare(fn, where, weights, first, second, length, atol=1e-5):
    """The answer against the loops; if they differ, the mistake it reproduces."""
    got = _call(fn, where, weights, first, second, length).double()
    want = _score(weights, first, second, length)
    if torch.allclose(got, want, rtol=0, atol=atol):
        return
    transposed = _score(weights.transpose(-2, -1), first, second, length)
    over_heads = want.mean().expand_as(want)
    mistakes = [
        (transposed, "the weights are read as [key, query]: row i of weights[b, h] is query "
         "i's weights over the keys, so the weight of query i on key j is weights[b, h, i, j]"),
        (_score(weights, first, second, length, offset=0),
         "this is the weight on the earlier occurrence of the current token itself, "
         "i - (second - first), the pattern of a duplicate-token head; an induction head "
         "reads the position after it, i - (second - first) + 1"),
        (_score(weights, first, second, length, offset=2),
         "the key is one position too far: the token after the earlier occurrence is at "
         "i - (second - first) + 1"),
        (_score(weights, first, second, length, queries=(0, 0)),
         "the last position of the second copy is counted: the token after it is not part of "
         "the segment, so it cannot be copied; the copyable queries are second .. second + "
         "length - 2"),
        (_score(weights, first, second, length, queries=(1, 0)),
         "the queries are shifted by one: position i predicts the token at i + 1, so the "
         "positions that can copy are second .. second + length - 2, not the positions of "
         "the tokens they predict"),
        (_score(weights, first, second, length, per_sequence=True),
         "each sequence is averaged first, then the sequences: every copyable position of "
         "every sequence must count once in one mean"),
        (over_heads, "the heads are averaged together: give each head its own mean"),
        (_score(weights, first, second, length) * _copyable_count(second, length),
         "the weights are summed, not averaged over the copyable positions"),
    ]
    for value, message in mistakes:
        if torch.allclose(got, value, rtol=0, atol=atol) and not torch.allclose(
                value, want, rtol=0, atol=atol):
            raise AssertionError(f"{where}: {message}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{where}: NaN or inf in the result")
    raise AssertionError(f"{where}: expected {[round(x, 4) for x in want.tolist()]}, got "
                         f"{[round(x, 4) for x in got.tolist()]}")


def _copyable_count(second, length) -> int:
    return int((length - 1).sum())


def _described(weights, first, second, length) -> str:
    B, H, T, _ = weights.shape
    return (f"B={B}, H={H}, T={T}, first={first.tolist()}, second={second.tolist()}, "
            f"length={length.tolist()}")


def _case(seed, B, H, T):
    g = torch.Generator().manual_seed(seed)
    weights = _weights(g, B, H, T)
    first, second, length = _positions(g, B, T)
    return weights, first, second, length


@check_induction_score.case("shapes")
def _(fn):
    for seed, (B, H, T) in enumerate(((1, 1, 6), (3, 2, 10), (2, 4, 24))):
        inputs = _case(seed, B, H, T)
        _call(fn, _described(*inputs), *inputs)


@check_induction_score.case("one sequence, one head")
def _(fn):
    weights = _weights(torch.Generator().manual_seed(10), 1, 1, 12)
    first, second, length = torch.tensor([2]), torch.tensor([7]), torch.tensor([4])
    _compare(fn, _described(weights, first, second, length), weights, first, second, length)


@check_induction_score.case("hand-made heads: induction, duplicate-token, previous-token")
def _(fn):
    """In each copyable row, head 0 puts 0.6 of its weight on the key after the earlier
    occurrence, head 1 on the earlier occurrence itself, head 2 on the previous position; the
    other 0.4 is spread evenly over the keys up to the query, as it is in every other row."""
    T = 12
    first, second, length = torch.tensor([1, 3]), torch.tensor([6, 8]), torch.tensor([5, 4])
    even = torch.ones(T, T).tril()
    weights = (even / even.sum(-1, keepdim=True)).expand(2, 3, T, T).clone()
    for b in range(2):
        p1, p2, n = int(first[b]), int(second[b]), int(length[b])
        for i in range(p2, p2 + n - 1):
            for head, key in enumerate((i - (p2 - p1) + 1, i - (p2 - p1), i - 1)):
                weights[b, head, i] = 0.4 / (i + 1)
                weights[b, head, i, key] += 0.6
    where = ("2 sequences of hand-made heads, 0.6 of each copyable row on: the key after the "
             "earlier occurrence (head 0), the earlier occurrence (head 1), the previous "
             "position (head 2)")
    _compare(fn, where, weights, first, second, length)


@check_induction_score.case("a batch of sequences of different lengths")
def _(fn):
    weights = _weights(torch.Generator().manual_seed(11), 4, 1, 16)
    first = torch.tensor([1, 2, 5, 1])
    length = torch.tensor([2, 7, 3, 5])
    second = torch.tensor([4, 9, 12, 10])
    _compare(fn, _described(weights, first, second, length), weights, first, second, length)


@check_induction_score.case("several heads")
def _(fn):
    inputs = _case(12, 3, 4, 10)
    _compare(fn, _described(*inputs), *inputs)


@check_induction_score.case("sizes drawn at random")
def _(fn):
    g = torch.Generator().manual_seed(13)
    for number in range(3):
        B, H = (int(n) for n in torch.randint(2, 6, (2,), generator=g))
        T = int(torch.randint(13, 23, (), generator=g))
        inputs = _case(100 + number, B, H, T)
        _compare(fn, "sizes drawn at random: " + _described(*inputs), *inputs)
