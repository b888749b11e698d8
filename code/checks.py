"""The checks of the book's coding exercises: what a student runs while working, and what an
nbgrader assignment grades.

Each check is a list of *cases*, each worth points and each a small function that raises
`AssertionError` with a message naming the mistake. A student calls the check on their
function and sees every case pass or fail:

    check_stable_softmax(stable_softmax)

A graded cell of an assignment runs one case, so that a partly right answer earns part of the
points:

    check_stable_softmax.grade("fully masked rows", stable_softmax)

Every case runs the student's function with the exercise's *forbidden* calls replaced by ones
that raise: an answer that calls what the exercise asks to write (the module's softmax in the
softmax exercise, say) fails every case, with a message naming the call.

Expected values come from loops, from the module where the exercise is not the module's
function, or from PyTorch: a check shows what is compared, never how to write the answer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
from collections.abc import Callable

import torch

__all__ = ["Check", "ForbiddenCall", "NotWritten"]  # and every check_*: see CHECKS


NOT_WRITTEN = "is not written yet: replace `raise NotImplementedError()` with your code"


class ForbiddenCall(AssertionError):
    """An exercise's answer called what the exercise rules out."""


class NotWritten(Exception):
    """The answer is still the stub. Not a RuntimeError (as NotImplementedError is), so that a
    case that turns an answer's RuntimeError into a hint does not catch it."""


def _resolve(dotted: str):
    """The object that holds the last attribute of a dotted name, and that attribute's name:
    "torch.Tensor.softmax" -> (torch.Tensor, "softmax")."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for part in parts[split:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ValueError(f"cannot resolve {dotted}")


@contextlib.contextmanager
def forbidding(names: tuple[str, ...], functions: tuple[Callable, ...]):
    """Within the block, each dotted name in `names` raises ForbiddenCall when called: on its
    module or class, and wherever the answer's own globals hold the same object (an answer that
    did `from attention import softmax` calls it through its notebook's globals)."""
    undo = []

    def trap(name):
        def forbidden(*args, **kwargs):
            raise ForbiddenCall(f"it calls {name}, which this exercise asks you to write "
                                "yourself (or rules out); use what the exercise allows")
        return forbidden

    try:
        for name in names:
            owner, attr = _resolve(name)
            original = getattr(owner, attr)
            undo.append((setattr, owner, attr, original))
            setattr(owner, attr, trap(name))
            for namespace in {id(fn.__globals__): fn.__globals__ for fn in functions
                              if hasattr(fn, "__globals__")}.values():
                for key, value in list(namespace.items()):
                    if value is original:
                        undo.append((dict.__setitem__, namespace, key, original))
                        namespace[key] = trap(name)
        yield
    finally:
        for restore, owner, attr, original in reversed(undo):
            restore(owner, attr, original)


class Check:
    """A named list of cases for one exercise. Call it to check all cases; `.grade(case, ...)`
    runs one, as a graded test cell does."""

    def __init__(self, name: str, forbidden: tuple[str, ...] = ()):
        self.__name__ = name
        self.forbidden = tuple(forbidden)
        self.cases: dict[str, tuple[Callable, int]] = {}

    def case(self, title: str, points: int = 1):
        """Register `function(*answer)` as the case `title`, worth `points`."""
        def register(function):
            self.cases[title] = (function, points)
            return function
        return register

    @property
    def points(self) -> int:
        return sum(points for _, points in self.cases.values())

    def _guarded(self, fn: Callable) -> Callable:
        """fn, run with the forbidden calls trapped; the case's own code runs free."""
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            with forbidding(self.forbidden, (fn,)):
                try:
                    return fn(*args, **kwargs)
                except NotImplementedError:
                    raise NotWritten(f"{fn.__name__} {NOT_WRITTEN}") from None
        return guarded

    def _run(self, title: str, answer: tuple[Callable, ...]) -> str | None:
        """None if the case passes, else the message naming the mistake."""
        function, _ = self.cases[title]
        try:
            function(*(self._guarded(fn) for fn in answer))
        except NotWritten as err:
            return str(err)
        except AssertionError as err:
            return str(err)
        return None

    def __call__(self, *answer: Callable) -> None:
        """Run every case on the answer and print each result; AssertionError listing the
        failed cases if any fails (or just saying so if the answer is not written yet)."""
        results = {title: self._run(title, answer) for title in self.cases}
        failed = {title: message for title, message in results.items() if message is not None}
        if failed and all(NOT_WRITTEN in message for message in failed.values()):
            raise AssertionError(next(iter(failed.values())))
        lines = []
        for title, message in results.items():
            points = self.cases[title][1]
            worth = f"{points} point{'s' * (points != 1)}"
            lines.append(f"pass  {title} ({worth})" if message is None else
                         f"FAIL  {title} ({worth}): {message}")
        if not failed:
            lines.append(f"{self.__name__}: all {len(self.cases)} cases pass.")
        # One write for the whole report: a kernel's output stream has been seen to repeat the
        # tail of many quick writes (once in the suite's runs), which the notebook tests catch.
        print("\n".join(lines))
        if failed:
            raise AssertionError(f"{len(failed)} of {len(self.cases)} cases fail:\n" + "\n".join(
                f"{title}: {message}" for title, message in failed.items()))

    def grade(self, title: str, *answer: Callable) -> None:
        """Run one case; AssertionError with the mistake if it fails (nbgrader then gives the
        cell no points)."""
        if title not in self.cases:
            raise KeyError(f"{self.__name__} has no case {title!r}; its cases: "
                           + ", ".join(self.cases))
        message = self._run(title, answer)
        if message is not None:
            raise AssertionError(f"{title}: {message}")
        print(f"{title}: passed")


def _tensor_like(out, expected_shape, where: str):
    assert isinstance(out, torch.Tensor), f"{where}: expected a tensor, got {type(out).__name__}"
    assert tuple(out.shape) == tuple(expected_shape), (
        f"{where}: expected shape {tuple(expected_shape)}, got {tuple(out.shape)}")


# === Chapter 1: simple_self_attention(x) -> (output, weights)

check_simple_self_attention = Check(
    "check_simple_self_attention",
    forbidden=("attention.scaled_dot_product_attention",
               "torch.nn.functional.scaled_dot_product_attention", "attention.softmax",
               "torch.softmax", "torch.nn.functional.softmax", "torch.Tensor.softmax"))


def _ssa_inputs() -> dict[str, torch.Tensor]:
    """The four inputs, by name; the first: the six words of sentence A, as in the text."""
    gen = torch.Generator().manual_seed(0)
    return {
        "sentence A (6, 4)": torch.tensor(
            [[0.0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1],
             [2, 0, 0, 0], [1, 1, 0, 0]]),
        "random (5, 3)": torch.randn(5, 3, generator=gen),
        "batch (2, 4, 3)": torch.randn(2, 4, 3, generator=gen),
        "large scores (4, 2)": 40 * torch.randn(4, 2, generator=gen)}


def _ssa_by_loops(x: torch.Tensor, scale: float = 1.0):
    """(output, weights) of simple self-attention, pair by pair (chapter 2's loops with
    identity projections), in x's dtype."""
    eye = torch.eye(x.shape[-1])
    out, weights = _sa_by_loops(x, eye, eye, eye, scale=scale)
    return out.to(x.dtype), weights.to(x.dtype)


def _ssa_result(fn, name: str, x: torch.Tensor):
    """fn(x) as (output, weights), checked for type and shape, or AssertionError naming the
    mistake."""
    try:
        result = fn(x)
    except RuntimeError as err:
        hint = ("for a batch, transpose the last two axes with x.transpose(-2, -1); x.T "
                "reverses all of them" if x.dim() > 2 else "check the shapes of your products")
        raise AssertionError(f"{name}: {fn.__name__} raised {err!r}; {hint}") from None
    assert isinstance(result, tuple) and len(result) == 2, (
        f"{name}: return a tuple (output, weights), got {type(result).__name__}")
    out, weights = result
    assert all(isinstance(t, torch.Tensor) for t in result), (
        f"{name}: output and weights must be tensors, got {type(out).__name__} and "
        f"{type(weights).__name__}")
    want_w_shape = (*x.shape[:-1], x.shape[-2])
    if out.shape == want_w_shape and weights.shape == x.shape:
        raise AssertionError(f"{name}: you returned (weights, output); return (output, weights)")
    assert weights.shape == want_w_shape, (
        f"{name}: weights: expected shape (..., T, T) = {want_w_shape}, got "
        f"{tuple(weights.shape)}")
    assert out.shape == x.shape, (
        f"{name}: output: expected shape (..., T, d) = {tuple(x.shape)}, got "
        f"{tuple(out.shape)}")
    return out, weights


def _ssa_values(fn, name: str, x: torch.Tensor) -> None:
    """fn(x) against simple attention computed pair by pair: the weights, then the output."""
    out, weights = _ssa_result(fn, name, x)
    assert weights.isfinite().all() and out.isfinite().all(), (
        f"{name}: NaN or inf. exp of a large score overflows: subtract each row's maximum "
        "before exp")
    want_out, want_w = _ssa_by_loops(x)
    ones = torch.ones(weights.shape[:-1])
    sums = weights.sum(-1)
    if not torch.allclose(sums, ones, atol=1e-5):
        assert not torch.allclose(weights.sum(-2), ones, atol=1e-5), (
            f"{name}: the columns of weights sum to 1, not the rows: normalise over the keys, "
            "dim=-1")
        raise AssertionError(
            f"{name}: each row of weights must sum to 1, got sums from {sums.min():.3g} to "
            f"{sums.max():.3g}: normalise the exponentials over the keys, dim=-1")
    _, scaled = _ssa_by_loops(x, scale=x.shape[-1] ** -0.5)  # divided by sqrt(d)
    assert not (torch.allclose(weights, scaled, atol=1e-5)
                and not torch.allclose(weights, want_w, atol=1e-5)), (
        f"{name}: you divided the scores by sqrt(d); simple attention uses the plain dot "
        "product")
    torch.testing.assert_close(
        weights, want_w, rtol=1e-4, atol=1e-5,
        msg=lambda m: f"{name}: weights differ from the expected ones (computed pair by pair). {m}")
    torch.testing.assert_close(
        out, want_out, rtol=1e-4, atol=1e-4, msg=lambda m: (
            f"{name}: output != weights @ x: row i of the output is the average of the rows "
            f"of x with the weights of row i. {m}"))


@check_simple_self_attention.case("shapes on every input")
def _(fn):
    for name, x in _ssa_inputs().items():
        _ssa_result(fn, name, x)


@check_simple_self_attention.case("values: sentence A and a random input")
def _(fn):
    for name, x in list(_ssa_inputs().items())[:2]:
        _ssa_values(fn, name, x)


@check_simple_self_attention.case("values: a batch")
def _(fn):
    _ssa_values(fn, "batch (2, 4, 3)", _ssa_inputs()["batch (2, 4, 3)"])


@check_simple_self_attention.case("values: scores in the thousands")
def _(fn):
    _ssa_values(fn, "large scores (4, 2)", _ssa_inputs()["large scores (4, 2)"])


# === Chapter 2: self_attention(x, w_q, w_k, w_v) -> (output, weights); additive_scores(...)

check_self_attention = Check(
    "check_self_attention",
    forbidden=("attention.scaled_dot_product_attention",
               "torch.nn.functional.scaled_dot_product_attention",
               "attention.MultiHeadAttention", "torch.nn.MultiheadAttention"))


def _sa_inputs():
    """name -> (x, w_q, w_k, w_v): d_k, d_v and d_model differ after the worked example."""
    gen = torch.Generator().manual_seed(10)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    eye = torch.eye(2)
    return {"worked example": (torch.tensor([[1.0, 0], [0, 1], [1, 1]]), eye, eye, eye),
            "d_k=3, d_v=5": (rand(4, 6), rand(6, 3), rand(6, 3), rand(6, 5)),
            "batch (2, 5, 6)": (rand(2, 5, 6), rand(6, 3), rand(6, 3), rand(6, 4)),
            "large inputs": (20 * rand(3, 4), rand(4, 2), rand(4, 2), rand(4, 2))}


def _sa_by_loops(x, w_q, w_k, w_v, scale=None, keys_first=False):
    """(output, weights) of self-attention in float64, one token and one pair at a time;
    `scale` and `keys_first` give the named mistakes."""
    x, w_q, w_k, w_v = (t.double() for t in (x, w_q, w_k, w_v))
    T, d_k, d_v = x.shape[-2], w_k.shape[-1], w_v.shape[-1]
    scale = 1 / d_k ** 0.5 if scale is None else scale
    outputs, all_weights = [], []
    for seq in x.reshape(-1, T, x.shape[-1]):  # each sequence of the batch
        q = [seq[t] @ w_q for t in range(T)]
        k = [seq[t] @ w_k for t in range(T)]
        v = [seq[t] @ w_v for t in range(T)]
        for i in range(T):
            row = [float((k[i] @ q[j]) if keys_first else (q[i] @ k[j])) * scale
                   for j in range(T)]
            top = max(row)
            exps = [torch.tensor(z - top, dtype=torch.float64).exp() for z in row]
            a = [e / sum(exps) for e in exps]
            all_weights.append(torch.stack(a))
            outputs.append(sum((a[j] * v[j] for j in range(T)), torch.zeros(d_v).double()))
    return (torch.stack(outputs).reshape(*x.shape[:-1], d_v),
            torch.stack(all_weights).reshape(*x.shape[:-1], T))


def _sa_call(fn, where, x, w_q, w_k, w_v, want_out, want_w, parts=("output", "weights")):
    """fn's (output, weights), checked for type and for the shapes of `parts`."""
    try:
        result = fn(x, w_q, w_k, w_v)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; project with x @ w_q, x @ w_k, x @ w_v "
            "and transpose the keys with k.transpose(-2, -1) (k.T reverses every axis of a "
            "batch)") from None
    assert isinstance(result, tuple) and len(result) == 2, (
        f"{where}: return a tuple (output, weights), got {type(result).__name__}")
    out, weights = result
    assert all(isinstance(t, torch.Tensor) for t in result), (
        f"{where}: output and weights must be tensors, got {type(out).__name__} and "
        f"{type(weights).__name__}")
    if out.shape == want_w.shape and weights.shape == want_out.shape:
        raise AssertionError(f"{where}: you returned (weights, output); return "
                             "(output, weights)")
    if "weights" in parts:
        assert weights.shape == want_w.shape, (
            f"{where}: weights: expected shape (..., T, T) = {tuple(want_w.shape)}, got "
            f"{tuple(weights.shape)}")
    if "output" in parts:
        hint = (": multiply the weights by v = x @ w_v, not by x"
                if out.shape == x.shape else "")
        assert out.shape == want_out.shape, (
            f"{where}: output: expected shape (..., T, d_v) = {tuple(want_out.shape)}, got "
            f"{tuple(out.shape)}{hint}")
    return out, weights


def _sa_weights_right(where, weights, x, w_q, w_k, w_v, want_w):
    assert weights.isfinite().all(), (
        f"{where}: NaN or inf. exp of a large score overflows: use a stable softmax (the "
        "module's, or subtract each row's maximum)")
    ones = torch.ones(weights.shape[:-1])
    sums = weights.double().sum(-1)
    if not torch.allclose(sums, ones.double(), atol=1e-5):
        assert not torch.allclose(weights.double().sum(-2), ones.double(), atol=1e-5), (
            f"{where}: the columns of weights sum to 1, not the rows: take the softmax over "
            "the keys, dim=-1")
        raise AssertionError(
            f"{where}: each row of weights must sum to 1, got sums from {sums.min():.3g} to "
            f"{sums.max():.3g}: the weights are the softmax of the scaled scores over the "
            "keys, dim=-1")
    d_model, d_k = x.shape[-1], w_k.shape[-1]
    mistakes = {
        "the scores are not divided by sqrt(d_k)": dict(scale=1.0),
        f"the scores are divided by sqrt(d_model) = sqrt({d_model}); divide by sqrt(d_k) = "
        f"sqrt({d_k}), the width of the keys": dict(scale=1 / d_model ** 0.5),
        "the scores are divided by d_k; divide by sqrt(d_k)": dict(scale=1 / d_k),
        "queries and keys are swapped: the scores are K Q^T, the transpose of Q K^T":
            dict(keys_first=True)}
    close = lambda a, b: torch.allclose(a.double(), b, atol=1e-5)
    for mistake, how in mistakes.items():
        _, wrong = _sa_by_loops(x, w_q, w_k, w_v, **how)
        assert not (close(weights, wrong) and not close(weights, want_w)), (
            f"{where}: {mistake}")
    torch.testing.assert_close(
        weights.double(), want_w, rtol=1e-4, atol=1e-5, msg=lambda m: (
            f"{where}: weights differ from the expected ones (computed pair by pair). {m}"))


def _sa_output_right(where, out, weights, want_out, want_w):
    assert out.isfinite().all(), (
        f"{where}: NaN or inf. exp of a large score overflows: use a stable softmax (the "
        "module's, or subtract each row's maximum)")
    if (not torch.allclose(out.double(), want_out, rtol=1e-4, atol=1e-4)
            and not torch.allclose(weights.double(), want_w, atol=1e-5)):
        raise AssertionError(f"{where}: output differs from the expected one; it must be "
                             "weights @ v, and the weights differ too: see the case on them")
    torch.testing.assert_close(
        out.double(), want_out, rtol=1e-4, atol=1e-4, msg=lambda m: (
            f"{where}: output differs from the expected one; it must be weights @ v. {m}"))


@check_self_attention.case("shapes")
def _(fn):
    for where, (x, w_q, w_k, w_v) in _sa_inputs().items():
        want_out, want_w = _sa_by_loops(x, w_q, w_k, w_v)
        _sa_call(fn, where, x, w_q, w_k, w_v, want_out, want_w)


_SA_ORDINARY = ("worked example", "d_k=3, d_v=5")


@check_self_attention.case("weights on ordinary inputs")
def _(fn):
    for where in _SA_ORDINARY:
        args = _sa_inputs()[where]
        want_out, want_w = _sa_by_loops(*args)
        _, weights = _sa_call(fn, where, *args, want_out, want_w, parts=("weights",))
        _sa_weights_right(where, weights, *args, want_w)


@check_self_attention.case("output on ordinary inputs")
def _(fn):
    for where in _SA_ORDINARY:
        args = _sa_inputs()[where]
        want_out, want_w = _sa_by_loops(*args)
        out, weights = _sa_call(fn, where, *args, want_out, want_w, parts=("output",))
        _sa_output_right(where, out, weights, want_out, want_w)


def _sa_all_right(fn, where):
    args = _sa_inputs()[where]
    want_out, want_w = _sa_by_loops(*args)
    out, weights = _sa_call(fn, where, *args, want_out, want_w)
    _sa_weights_right(where, weights, *args, want_w)
    _sa_output_right(where, out, weights, want_out, want_w)


@check_self_attention.case("a batch")
def _(fn):
    _sa_all_right(fn, "batch (2, 5, 6)")


@check_self_attention.case("large inputs")
def _(fn):
    _sa_all_right(fn, "large inputs")


check_additive_scores = Check("check_additive_scores")  # it rules out a loop: no call to trap


def _additive_inputs():
    """name -> (query, key, w_1, w_2, w_out)."""
    gen = torch.Generator().manual_seed(11)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    inputs = {}
    for L, S, d_q, d_k, d_a in [(3, 3, 2, 2, 4), (2, 5, 3, 6, 7), (4, 2, 3, 3, 5)]:
        where = f"L={L}, S={S}" + (f", d_q={d_q}, d_k={d_k}" if d_q != d_k else "")
        inputs[where] = rand(L, d_q), rand(S, d_k), rand(d_q, d_a), rand(d_k, d_a), rand(d_a)
    return inputs


def _additive_by_loops(query, key, w_1, w_2, w_out, mistake=None):
    """The (L, S) scores in float64, pair by pair; `mistake` names a wrong recipe."""
    query, key, w_1, w_2, w_out = (t.double() for t in (query, key, w_1, w_2, w_out))
    if mistake == "swapped":
        w_1, w_2 = w_2, w_1

    def score(i, j):
        hidden = query[i] @ w_1 + key[j] @ w_2  # (d_a,)
        if mistake == "no tanh":
            return hidden @ w_out
        if mistake == "tanh after":
            return torch.tanh(hidden @ w_out)
        return torch.tanh(hidden) @ w_out

    return torch.tensor([[float(score(i, j)) for j in range(key.shape[0])]
                         for i in range(query.shape[0])], dtype=torch.float64)


def _additive_mistakes(query, key, w_1, w_2, w_out) -> dict:
    """message -> the scores that mistake gives, where the input can tell it apart."""
    mistakes = {
        "the tanh is missing: without it the score is linear and cannot rank keys differently "
        "for different queries": _additive_by_loops(query, key, w_1, w_2, w_out, "no tanh"),
        "tanh is applied after w_out: apply it to the hidden vectors (L, S, d_a), then take "
        "the product with w_out": _additive_by_loops(query, key, w_1, w_2, w_out, "tanh after")}
    if query.shape[-1] == key.shape[-1]:
        mistakes["w_1 and w_2 are swapped: w_1 projects the queries, w_2 the keys"] = (
            _additive_by_loops(query, key, w_1, w_2, w_out, "swapped"))
    return mistakes


def _additive_call(fn, where, args, shape=True):
    try:
        got = fn(*args)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; w_1 projects the queries and w_2 the "
            "keys: query @ w_1 is (L, d_a) and key @ w_2 is (S, d_a): give them a key axis and "
            "a query axis so that they broadcast to (L, S, d_a)") from None
    assert isinstance(got, torch.Tensor), (
        f"{where}: expected a tensor, got {type(got).__name__}")
    L, S = args[0].shape[0], args[1].shape[0]
    if shape:
        assert not (L != S and tuple(got.shape) == (S, L)), (
            f"{where}: expected shape (L, S) = {(L, S)}, got (S, L) = {(S, L)}: the rows are "
            "the queries, the columns the keys")
        assert tuple(got.shape) == (L, S), (
            f"{where}: expected shape (L, S) = {(L, S)}, got {tuple(got.shape)}")
    return got


def _additive_values(fn, where, args):
    got = _additive_call(fn, where, args).double()
    want = _additive_by_loops(*args)
    mistakes = _additive_mistakes(*args)
    if got.shape[0] == got.shape[1]:
        mistakes["the scores are transposed: scores[i, j] pairs query i with key j"] = want.T
    for message, wrong in mistakes.items():
        assert not (torch.allclose(got, wrong, atol=1e-5)
                    and not torch.allclose(got, want, atol=1e-5)), f"{where}: {message}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"{where}: {m}")


_ADDITIVE_SAME_WIDTH = ("L=3, S=3", "L=4, S=2")  # d_q = d_k


@check_additive_scores.case("shapes")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        _additive_call(fn, where, _additive_inputs()[where])


@check_additive_scores.case("every pair's score, in any layout")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        args = _additive_inputs()[where]
        got = _additive_call(fn, where, args, shape=False).double().flatten()
        L, S = args[0].shape[0], args[1].shape[0]
        assert got.numel() == L * S, (
            f"{where}: expected L * S = {L * S} scores, one per pair (query i, key j), got "
            f"{got.numel()}")
        in_order = lambda scores: scores.flatten().sort().values
        for message, wrong in _additive_mistakes(*args).items():
            assert not torch.allclose(got.sort().values, in_order(wrong), atol=1e-5), (
                f"{where}: {message}")
        assert torch.allclose(got.sort().values, in_order(_additive_by_loops(*args)),
                              rtol=1e-4, atol=1e-5), (
            f"{where}: the scores differ from tanh(query[i] @ w_1 + key[j] @ w_2) @ w_out, "
            "whatever their order")


@check_additive_scores.case("values, d_q = d_k")
def _(fn):
    for where in _ADDITIVE_SAME_WIDTH:
        _additive_values(fn, where, _additive_inputs()[where])


@check_additive_scores.case("values, d_q != d_k")
def _(fn):
    where = "L=2, S=5, d_q=3, d_k=6"
    _additive_values(fn, where, _additive_inputs()[where])


# === Chapter 3: score_variance(d_k, n, sigma, generator) -> (raw_var, scaled_var)

import math  # noqa: E402

check_score_variance = Check(
    "check_score_variance",
    forbidden=("torch.manual_seed", "torch.random.manual_seed"))

_VARIANCE_CASES = ((64, 2.0), (8, 0.5), (1, 1.0))  # (d_k, sigma)


def _variance_number(value):
    """A Python float, or None if value is not one number."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _variance_close(x, y):
    """Within 10%, about five standard errors at n = 20_000."""
    return abs(x - y) <= 0.1 * abs(y)


def _variances(fn, d_k: int, sigma: float, seed: int = 11) -> tuple[float, float]:
    """fn on a fresh generator seeded with `seed`: two finite floats, measured (not the lemma's
    values: fn also runs with seed + 1), or AssertionError naming the mistake."""
    case = f"d_k={d_k}, sigma={sigma}"
    results = []
    for each in (seed, seed + 1):
        try:
            out = fn(d_k, 20_000, sigma, torch.Generator().manual_seed(each))
        except RuntimeError as err:
            raise AssertionError(
                f"{case}: {fn.__name__} raised {err!r}; draw q and k of shape (n, d_k) and "
                "take the dot product of each pair") from None
        assert isinstance(out, (tuple, list)) and len(out) == 2, (
            f"{case}: expected a tuple (raw_var, scaled_var), got {type(out).__name__}")
        raw_var, scaled_var = _variance_number(out[0]), _variance_number(out[1])
        assert raw_var is not None and scaled_var is not None, (
            f"{case}: expected two numbers, got "
            + " and ".join(f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor)
                           else type(v).__name__ for v in out)
            + ": return the variances of the scores, as floats")
        assert math.isfinite(raw_var) and math.isfinite(scaled_var), (
            f"{case}: got NaN or inf: {out!r}")
        results.append((raw_var, scaled_var))
    lemma = (d_k * sigma**4, sigma**4)
    assert not (results[0] == results[1] and all(
        math.isclose(got, want, rel_tol=1e-9) for got, want in zip(results[0], lemma))), (
        f"{case}: you returned the lemma's values d_k * sigma^4 and sigma^4 for every seed, "
        "not a measurement: draw n pairs with generator and measure their variance")
    return results[0]


@check_score_variance.case("two numbers")
def _(fn):
    for d_k, sigma in _VARIANCE_CASES:
        _variances(fn, d_k, sigma)


@check_score_variance.case("drawn with generator only")
def _(fn):
    for d_k, sigma in _VARIANCE_CASES:
        case = f"d_k={d_k}, sigma={sigma}"
        first, second = _variances(fn, d_k, sigma), _variances(fn, d_k, sigma)
        assert first == second, (
            f"{case}: generators seeded alike gave different results; pass "
            "generator=generator to every torch.randn call")
        assert _variances(fn, d_k, sigma, seed=21) != first, (
            f"{case}: generators seeded differently gave the same results: draw q and k "
            "with the generator you are given, not one of your own")


@check_score_variance.case("Var[q.k] = d_k sigma^4")
def _(fn):
    for d_k, sigma in _VARIANCE_CASES:
        raw_var, _ = _variances(fn, d_k, sigma)
        want = d_k * sigma**4
        suspects = {  # what a common mistake returns: what to fix
            d_k * sigma**2: "entries have variance sigma: scale by sigma",
            d_k * sigma**8: "entries have variance sigma^4: scale by sigma",
            want**0.5: "that is the standard deviation, not the variance",
            sigma**4: "that is Var[q_i k_i]; sum over the d_k entries first",
        }
        hint = next((h for v, h in suspects.items() if _variance_close(raw_var, v)), "")
        assert _variance_close(raw_var, want), (
            f"d_k={d_k}, sigma={sigma}: raw variance {raw_var:.4g}, expected about "
            f"d_k * sigma^4 = {want:.4g}. {hint}")


@check_score_variance.case("Var[q.k / sqrt(d_k)] = sigma^4")
def _(fn):
    for d_k, sigma in _VARIANCE_CASES:
        raw_var, scaled_var = _variances(fn, d_k, sigma)
        hint = ""
        if d_k > 1 and _variance_close(scaled_var, raw_var):
            hint = "scaled equals raw: divide the scores by sqrt(d_k)"
        elif d_k > 1 and _variance_close(scaled_var, raw_var / d_k**2):
            hint = "you divided by d_k, not sqrt(d_k) (variance / d_k^2)"
        elif d_k > 1 and _variance_close(scaled_var, raw_var / d_k**0.5):
            hint = ("you divided the variance by sqrt(d_k); divide the scores by sqrt(d_k), "
                    "which divides the variance by d_k")
        elif _variance_close(scaled_var, (d_k * sigma**4) ** 0.5 / d_k**0.5):
            hint = "that is the standard deviation, not the variance"
        assert _variance_close(scaled_var, sigma**4), (
            f"d_k={d_k}, sigma={sigma}: scaled variance {scaled_var:.4g}, expected about "
            f"sigma^4 = {sigma**4:.4g}. {hint}")


# === Chapter 4: stable_softmax(scores, dim=-1) -> weights

check_stable_softmax = Check(
    "check_stable_softmax",
    forbidden=("torch.softmax", "torch.nn.functional.softmax", "torch.Tensor.softmax",
               "torch.special.softmax", "torch.log_softmax", "torch.nn.functional.log_softmax",
               "torch.Tensor.log_softmax", "attention.softmax"))


def _softmax_call(fn, scores, dim):
    try:
        return fn(scores, dim=dim)
    except RuntimeError as err:
        raise AssertionError(
            f"scores of shape {tuple(scores.shape)}, dim={dim}: {fn.__name__} raised {err!r}; "
            "keep the reduced axis (keepdim=True) so that the max and the sum broadcast"
        ) from None


def _ordinary_scores():
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(7))  # (3, 5): not square


@check_stable_softmax.case("ordinary scores, dim=-1")
def _(fn):
    z = _ordinary_scores()
    out = _softmax_call(fn, z, -1)
    _tensor_like(out, z.shape, "dim=-1")
    assert not torch.isnan(out).any(), "NaN on ordinary scores (about 1)"
    if not torch.allclose(out, torch.softmax(z, dim=-1), atol=1e-6):
        if torch.allclose(out, torch.softmax(z, dim=0), atol=1e-6):
            raise AssertionError("dim=-1: normalised over the wrong axis "
                                 "(columns sum to 1, not rows)")
        raise AssertionError("dim=-1: differs from torch.softmax on ordinary scores")


@check_stable_softmax.case("another axis, dim=0")
def _(fn):
    z = _ordinary_scores()
    out = _softmax_call(fn, z, 0)
    _tensor_like(out, z.shape, "dim=0")
    assert torch.allclose(out, torch.softmax(z, dim=0), atol=1e-6), (
        "dim=0: differs from torch.softmax(z, dim=0); use dim in every reduction (the max and "
        "the sum), not a fixed axis")


@check_stable_softmax.case("large and very negative scores")
def _(fn):
    z = _ordinary_scores()
    for name, extreme in (("large (about 1000)", z * 300 + 1000),
                          ("very negative (about -1000)", z - 1000)):
        out = _softmax_call(fn, extreme, -1)
        _tensor_like(out, z.shape, f"{name} scores")
        assert torch.isfinite(out).all(), (
            f"NaN or inf for {name} scores: subtract the row maximum first")
        assert torch.allclose(out, torch.softmax(extreme, dim=-1), atol=1e-6), (
            f"wrong result for {name} scores")


@check_stable_softmax.case("float16")
def _(fn):
    half = torch.tensor([[20.0, 19.0, 0.0]], dtype=torch.float16)
    out = _softmax_call(fn, half, -1)
    _tensor_like(out, half.shape, "float16")
    assert out.dtype == torch.float16, f"expected dtype float16 back, got {out.dtype}"
    assert torch.isfinite(out).all(), (
        "NaN or inf in float16 for scores of 20: exp(20) overflows float16 (largest 65504); "
        "subtract the row maximum first")
    assert torch.allclose(out.float(), torch.softmax(half.float(), dim=-1), atol=2e-3), (
        f"wrong result in float16: got {out.tolist()}")
    out = _softmax_call(fn, torch.full((1, 3), float("-inf"), dtype=torch.float16), -1)
    assert not torch.isnan(out).any(), (
        "NaN for an all -inf row in float16: a small constant such as 1e-30 added to the "
        "denominator is 0 in float16 (its smallest number is about 6e-8)")


def _masked_rows():
    ninf = float("-inf")
    return torch.tensor([[1.0, ninf, 2.0], [ninf, ninf, ninf]])  # (2, 3)


@check_stable_softmax.case("rows with -inf scores")
def _(fn):
    masked = _masked_rows()
    out = _softmax_call(fn, masked, -1)
    _tensor_like(out, masked.shape, "-inf scores")
    assert not torch.isnan(out[0]).any(), "NaN in a row with some -inf"
    assert out[0, 1] == 0, f"a -inf score must get weight exactly 0, got {out[0, 1].item()}"
    assert torch.allclose(out[0], torch.softmax(masked[0], dim=-1)), (
        "wrong weights in a row with some -inf scores")
    assert not torch.isnan(out[1]).any(), (
        "NaN for a row that is all -inf: -inf - (-inf) is nan; shift such rows by 0 and avoid "
        "0/0")
    assert (out[1] == 0).all(), f"a row that is all -inf must give zeros, got {out[1].tolist()}"


@check_stable_softmax.case("gradient through an all -inf row")
def _(fn):
    leaf = _masked_rows().requires_grad_()
    out = _softmax_call(fn, leaf, -1)
    _tensor_like(out, leaf.shape, "gradient")
    (out * torch.arange(1.0, 4.0)).sum().backward()
    assert torch.isfinite(leaf.grad).all(), (
        "the gradient is NaN for the all -inf row: a NaN made in the forward pass and replaced "
        "afterwards (nan_to_num, torch.where) still reaches the backward pass; avoid computing "
        "0/0 at all")


# === Chapter 5: causal_padding_mask(...), masked_softmax(...)

check_causal_padding_mask = Check(
    "check_causal_padding_mask",
    forbidden=("attention.causal_mask", "attention.padding_mask"))


def _entrywise(lengths, L, rule):
    """The (B, L, L) mask whose entry [b, i, j] is rule(lengths[b], i, j), built one entry at
    a time."""
    return torch.tensor([[[bool(rule(n, i, j)) for j in range(L)] for i in range(L)]
                         for n in lengths], dtype=torch.bool)


def _may_attend(n, i, j):  # the exercise's rule, for one entry
    return j <= i and j < n


# The usual mistakes, each as the rule for one entry that it follows instead. "not causal"
# comes before "combined with OR": on sequences without padding both give all True.
_MASK_MISTAKES = {
    "inverted mask: True must mean 'may attend', not 'blocked'":
        lambda n, i, j: not _may_attend(n, i, j),
    "off by one: the diagonal is missing; a token must see itself":
        lambda n, i, j: j < i and j < n,
    "off by one: each query may also see the next token":
        lambda n, i, j: j <= i + 1 and j < n,
    "upper triangle: the mask shows the future instead of the past":
        lambda n, i, j: j >= i and j < n,
    "off by one in the padding: the real keys are the positions j < lengths[b], "
    "not j <= lengths[b]":
        lambda n, i, j: j <= i and j <= n,
    "the rows of padded queries are all False: mask the padding keys (columns) only; "
    "blocking padded queries (alone or with the keys) leaves those rows with no key at all, "
    "and the loss ignores them anyway":
        lambda n, i, j: j <= i and i < n,
    "padding ignored: keys beyond each length must be blocked":
        lambda n, i, j: j <= i,
    "not causal: the causal part of the mask is missing":
        lambda n, i, j: j < n,
    "combined with OR: a key must be allowed by both masks, so combine them with & (AND), "
    "not | (OR)":
        lambda n, i, j: j <= i or j < n,
}

_NO_PADDING = (([4, 4], 4), ([1], 1))
_PADDED = (([3, 1, 4], 4), ([6, 2], 6), ([1, 3, 2], 3))
_EMPTY_AND_SHORT = (([2, 5, 0], 5), ([2, 3], 5))  # a length 0; L beyond the longest


def _mask_call(fn, lengths, L):
    """(fn(lengths, L), where), with a plain message if fn raises."""
    where = f"lengths={lengths}, L={L}"
    try:
        return fn(torch.tensor(lengths), L), where
    except (RuntimeError, IndexError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; compare query positions (L, 1), key "
            "positions (1, L) and lengths (B, 1, 1) by broadcasting") from None


def _mask_shape(got, lengths, L, where):
    B = len(lengths)
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    longest = max(lengths)
    hint = (f": the mask is L by L, also when L exceeds the longest sequence; not "
            f"lengths.max() by lengths.max()" if tuple(got.shape) == (B, longest, longest)
            and longest != L else "")
    assert tuple(got.shape) == (B, L, L), (
        f"{where}: expected shape (B, L, L) = {(B, L, L)}, got {tuple(got.shape)}{hint}")


def _mask_values(fn, inputs):
    for lengths, L in inputs:
        got, where = _mask_call(fn, lengths, L)
        _mask_shape(got, lengths, L, where)
        assert got.dtype == torch.bool, (
            f"{where}: expected a boolean mask (True = may attend), got {got.dtype}")
        expected = _entrywise(lengths, L, _may_attend)
        if torch.equal(got, expected):
            continue
        for message, rule in _MASK_MISTAKES.items():
            assert not torch.equal(got, _entrywise(lengths, L, rule)), f"{where}: {message}"
        b, i, j = (got != expected).nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: entry [b={b}, query={i}, key={j}] is {bool(got[b, i, j])}, expected "
            f"{bool(expected[b, i, j])}")


@check_causal_padding_mask.case("shapes")
def _(fn):
    for lengths, L in _PADDED + _NO_PADDING + _EMPTY_AND_SHORT:
        got, where = _mask_call(fn, lengths, L)
        _mask_shape(got, lengths, L, where)


@check_causal_padding_mask.case("sequences without padding")
def _(fn):
    _mask_values(fn, _NO_PADDING)


@check_causal_padding_mask.case("padded sequences")
def _(fn):
    _mask_values(fn, _PADDED)


@check_causal_padding_mask.case("an empty sequence, and L beyond the longest")
def _(fn):
    _mask_values(fn, _EMPTY_AND_SHORT)


check_masked_softmax = Check(
    "check_masked_softmax",
    forbidden=("attention.softmax", "torch.softmax", "torch.nn.functional.softmax",
               "torch.Tensor.softmax", "torch.special.softmax", "torch.log_softmax",
               "torch.nn.functional.log_softmax", "torch.Tensor.log_softmax"))


def _visible_softmax(scores, keep):
    """Row by row, in float64: PyTorch's softmax of the scores where keep is True, 0 elsewhere
    (a row where keep is all False stays 0)."""
    z = scores.double().reshape(-1, scores.shape[-1])
    keep = keep.reshape(z.shape)
    out = torch.zeros_like(z)
    for row in range(len(z)):
        visible = keep[row]
        if visible.any():
            out[row, visible] = torch.softmax(z[row, visible], dim=0)
    return out.reshape(scores.shape)


def _ms_inputs():
    """Scores (B, L, S) = (2, 3, 5) and a (B, L, S) mask where every row keeps a key."""
    g = torch.Generator().manual_seed(10)
    scores = torch.randn(2, 3, 5, generator=g)
    mask = torch.rand(2, 3, 5, generator=g) > 0.4
    mask[1, :, 0] = True
    return scores, mask


def _ms_with_empty_row():
    scores, mask = _ms_inputs()
    mask[0, 1] = False  # a fully masked row
    return scores, mask


def _ms_broadcast_inputs():
    from attention import causal_mask
    scores, _ = _ms_inputs()
    lengths = torch.tensor([3, 5])
    return {"(L, S) causal mask, broadcast over B": (scores, causal_mask(3, 5)),
            "(B, 1, S) padding mask, broadcast over L":
                (scores, (torch.arange(5) < lengths[:, None])[:, None, :])}


def _ms_float16_inputs():
    scores, mask = _ms_with_empty_row()
    return (12 + 8 * scores).half(), mask


def _ms_call(fn, where, x, m):
    """fn(x, m), with a plain message if it raises."""
    try:
        return fn(x, m)
    except (RuntimeError, IndexError) as err:
        hint = "does the mask broadcast, and did you keep the reduced axis (keepdim=True)?"
        if x.dtype == torch.float16 and "overflow" in str(err):
            hint = "a fill such as -1e9 does not fit in float16; fill with -inf"
        raise AssertionError(f"{where}: {fn.__name__} raised {err!r}; {hint}") from None


def _ms_shape(got, x, where):
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert got.shape == x.shape, (
        f"{where}: expected shape {tuple(x.shape)}, got {tuple(got.shape)}")


def _ms_values(fn, where, x, m):
    """Run fn on a copy of x and compare with the softmax of the visible scores, naming the
    mistake if they differ."""
    got = _ms_call(fn, where, x.clone(), m)
    _ms_shape(got, x, where)
    assert got.dtype == x.dtype, f"{where}: expected dtype {x.dtype}, got {got.dtype}"
    tol = 5e-3 if x.dtype == torch.float16 else 1e-5
    keep = m.expand(x.shape)
    empty = ~keep.any(-1)  # (B, L), fully masked rows
    got = got.float()
    expected = _visible_softmax(x, keep).float()
    inverted = _visible_softmax(x, ~keep).float()
    zeroed = got.nan_to_num(0.0, 0.0, 0.0)  # NaN and inf set to 0
    assert not (torch.allclose(zeroed, inverted, atol=tol)
                and not torch.allclose(zeroed, expected, atol=tol)), (
        f"{where}: inverted mask: True must mean 'may attend'; remove the positions where the "
        "mask is False")
    rows, cols = zeroed.sum(-1)[~empty], zeroed.sum(-2)[keep.any(-2)]
    assert not (torch.allclose(cols, torch.ones_like(cols), atol=tol)
                and not torch.allclose(rows, torch.ones_like(rows), atol=tol)), (
        f"{where}: the columns sum to 1, not the rows: take the softmax over the keys, dim=-1")
    bad = ~got.isfinite().all(-1)  # (B, L), rows with a NaN or inf
    assert not (bad & ~empty).any(), (
        f"{where}: NaN or inf in {int((bad & ~empty).sum())} row(s) with visible keys: exp of "
        "a large score overflows (in float16 above about 11); subtract the row maximum first")
    tiny = (" (a small constant such as 1e-30 added to the denominator is 0 in float16)"
            if x.dtype == torch.float16 else "")
    assert not (bad & empty).any(), (
        f"{where}: NaN in {int((bad & empty).sum())} fully masked row(s): a row with no "
        f"visible key must give zeros, not 0/0{tiny}")
    visible = got[~empty].masked_fill(keep[~empty], 0.0)  # the masked part of the other rows
    leaked = visible.abs().max().item() if visible.numel() else 0.0
    assert leaked == 0.0, (
        f"{where}: masked positions get weight up to {leaked:.3g}, expected 0: fill them with "
        "-inf before the softmax")
    if empty.any():
        lost = got[empty]  # (number of fully masked rows, S)
        uniform = torch.full_like(lost, 1 / lost.shape[-1])
        assert not torch.allclose(lost, uniform, atol=tol), (
            f"{where}: a fully masked row gets uniform weights 1/S, as a finite fill such as "
            "-1e9 or finfo.min gives; it must give zeros")
        assert not lost.any(), (
            f"{where}: a fully masked row must give zeros, got weights up to "
            f"{lost.abs().max():.3g}")
    sums = got.sum(-1)[~empty]
    assert torch.allclose(sums, torch.ones_like(sums), atol=tol), (
        f"{where}: rows with a visible key must sum to 1, got sums from {sums.min():.3f} to "
        f"{sums.max():.3f}: mask the scores before the softmax, not the weights after it")
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol,
                               msg=lambda message: f"{where}: {message}")


@check_masked_softmax.case("shapes")
def _(fn):
    cases = {"(B, L, S) mask": _ms_with_empty_row(), **_ms_broadcast_inputs(),
             "float16, scores up to about 30": _ms_float16_inputs()}
    for where, (x, m) in cases.items():
        _ms_shape(_ms_call(fn, where, x.clone(), m), x, where)


@check_masked_softmax.case("rows with visible keys")
def _(fn):
    _ms_values(fn, "(B, L, S) mask", *_ms_inputs())


@check_masked_softmax.case("masks that broadcast")
def _(fn):
    for where, (x, m) in _ms_broadcast_inputs().items():
        _ms_values(fn, where, x, m)


@check_masked_softmax.case("a fully masked row")
def _(fn):
    _ms_values(fn, "(B, L, S) mask with a fully masked row", *_ms_with_empty_row())


@check_masked_softmax.case("float16 and large scores")
def _(fn):
    _ms_values(fn, "float16, scores up to about 30", *_ms_float16_inputs())


@check_masked_softmax.case("the gradient through a fully masked row")
def _(fn):
    x, m = _ms_with_empty_row()
    leaf = x.clone().requires_grad_()
    where = "(B, L, S) mask with a fully masked row"
    got = _ms_call(fn, where, leaf, m)
    _ms_shape(got, x, where)
    (got * torch.arange(1.0, x.shape[-1] + 1)).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), (
        f"{where}: the gradient is NaN: a NaN made in the forward pass (0/0 on the fully masked "
        "row) and replaced afterwards (nan_to_num, torch.where) still reaches the backward "
        "pass; avoid computing 0/0 at all")


@check_masked_softmax.case("scores left unchanged")
def _(fn):
    x, m = _ms_with_empty_row()
    before = x.clone()
    where = "(B, L, S) mask with a fully masked row"
    _ms_call(fn, where, x, m)
    assert torch.equal(x, before), (
        f"{where}: {fn.__name__} modified the scores in place; use masked_fill, which returns "
        "a new tensor, not masked_fill_")


# === Chapter 6: split_heads / merge_heads, grouped_query_attention(...)

class _PairCheck(Check):
    """A check of two functions that form one answer, split_heads and merge_heads: a forbidden
    call in either of them earns no case, not even the cases that run only the other one."""

    _PROBES = ((torch.zeros(1, 2, 4), 2), (torch.zeros(1, 2, 2, 2),))  # split (x, H); merge (x,)

    def _run(self, title, answer):
        for fn, args in zip(answer, self._PROBES):
            try:
                self._guarded(fn)(*args)
            except ForbiddenCall as err:
                return f"{fn.__name__}: {err}"
            except Exception:  # any other mistake is for the cases to name
                pass
        return super()._run(title, answer)


check_split_merge = _PairCheck(
    "check_split_merge",
    forbidden=("attention.MultiHeadAttention.split_heads",
               "attention.MultiHeadAttention.merge_heads"))

_HEAD_SHAPES = ((2, 3, 8, 2), (1, 5, 12, 3), (3, 4, 6, 1), (2, 1, 8, 4))  # (B, L, D, H)


def _heads_inputs():
    """(where, x (B, L, D) with all entries different, H, heads (B, H, L, hd)): heads[b, h, t]
    holds features h*hd to (h+1)*hd - 1 of x[b, t], copied one entry at a time."""
    for B, L, D, H in _HEAD_SHAPES:
        hd = D // H
        x = torch.arange(B * L * D, dtype=torch.float32).reshape(B, L, D)
        heads = torch.zeros(B, H, L, hd)
        for b, h, t, e in itertools.product(range(B), range(H), range(L), range(hd)):
            heads[b, h, t, e] = x[b, t, h * hd + e]  # entry by entry
        yield f"B={B}, L={L}, D={D}, H={H}", x, H, heads


def _heads_call(where, fn, *args):
    """fn(*args), its RuntimeError turned into a hint."""
    try:
        return fn(*args)
    except RuntimeError as err:
        hint = ("after a transpose use reshape (or contiguous().view)"
                if len(args) == 1 else "check the shapes you view or reshape to: "
                "(B, L, H, hd) first, then transpose(1, 2)")
        raise AssertionError(f"{where}: {fn.__name__} raised {err!r}; {hint}") from None


def _split_shaped(where, split_heads, x, H):
    B, L, D = x.shape
    hd = D // H
    got = _heads_call(where, split_heads, x, H)
    assert isinstance(got, torch.Tensor), (
        f"split_heads must return a tensor, got {type(got).__name__}")
    if tuple(got.shape) == (B, L, H, hd) and L != H:
        raise AssertionError(f"{where}: split_heads returned (B, L, H, hd) = "
                             f"{tuple(got.shape)}; transpose to (B, H, L, hd)")
    assert tuple(got.shape) == (B, H, L, hd), (
        f"{where}: split_heads: expected shape (B, H, L, hd) = {(B, H, L, hd)}, got "
        f"{tuple(got.shape)}")
    return got


def _merge_shaped(where, merge_heads, heads):
    B, H, L, hd = heads.shape
    merged = _heads_call(where, merge_heads, heads)
    assert isinstance(merged, torch.Tensor), (
        f"merge_heads must return a tensor, got {type(merged).__name__}")
    assert tuple(merged.shape) == (B, L, H * hd), (
        f"{where}: merge_heads: expected shape (B, L, D) = {(B, L, H * hd)}, got "
        f"{tuple(merged.shape)}")
    return merged


@check_split_merge.case("split_heads: shapes")
def _(split_heads, merge_heads):
    for where, x, H, _ in _heads_inputs():
        _split_shaped(where, split_heads, x, H)


@check_split_merge.case("split_heads: each head holds its block of features")
def _(split_heads, merge_heads):
    for where, x, H, heads in _heads_inputs():
        got = _split_shaped(where, split_heads, x, H)
        if torch.equal(got, heads):
            continue
        B, H, L, hd = heads.shape
        if torch.equal(got, x.view(B, H, L, hd)):
            raise AssertionError(
                f"{where}: split_heads viewed x as (B, H, L, hd) directly; the shape is right "
                "but tokens are mixed: view as (B, L, H, hd), then transpose(1, 2)")
        if torch.equal(got, x.view(B, L, hd, H).permute(0, 3, 1, 2)):
            raise AssertionError(f"{where}: head h got every H-th feature; it must get the "
                                 "contiguous block h*hd:(h+1)*hd")
        raise AssertionError(
            f"{where}: split_heads: head h must hold features h*hd:(h+1)*hd of every token")


@check_split_merge.case("split_heads: ValueError when H does not divide D")
def _(split_heads, merge_heads):
    try:
        split_heads(torch.zeros(1, 2, 6), 4)
    except ValueError:
        return
    except Exception as err:
        raise AssertionError(
            f"split_heads(x, 4) with D = 6 raised {err!r}; it must raise ValueError itself: "
            "4 heads cannot share 6 features equally") from None
    raise AssertionError("split_heads(x, 4) with D = 6 must raise ValueError: 4 heads cannot "
                         "share 6 features equally")


@check_split_merge.case("merge_heads: shapes")
def _(split_heads, merge_heads):
    for where, _, _, heads in _heads_inputs():
        _merge_shaped(where, merge_heads, heads)


@check_split_merge.case("merge_heads: gives the tokens back")
def _(split_heads, merge_heads):
    for where, x, _, heads in _heads_inputs():
        merged = _merge_shaped(where, merge_heads, heads)
        if torch.equal(merged, x):
            continue
        assert not torch.equal(merged, heads.reshape(x.shape)), (
            f"{where}: merge_heads reshaped (B, H, L, hd) directly; transpose(1, 2) back to "
            "(B, L, H, hd) first")
        raise AssertionError(f"{where}: merge_heads(split(x)) must give x back")


check_grouped_query_attention = Check(
    "check_grouped_query_attention",
    forbidden=("torch.nn.functional.scaled_dot_product_attention", "attention.repeat_kv"))

_GQA_HEADS = {"grouped": ((4, 2), (6, 3), (8, 2)), "multi-query": ((4, 1),),
              "multi-head": ((4, 4),)}  # (H, G)


def _gqa_inputs(kinds=tuple(_GQA_HEADS)):
    """(where, q (B, H, L, hd), k and v (B, G, S, hd)) for each (H, G) of the kinds."""
    B, L, S, hd = 2, 3, 5, 4
    for H, G in (pair for kind in kinds for pair in _GQA_HEADS[kind]):
        g = torch.Generator().manual_seed(10 * H + G)
        q = torch.randn(B, H, L, hd, generator=g)
        k, v = (torch.randn(B, G, S, hd, generator=g) for _ in range(2))
        yield f"H={H} query heads, G={G} key-value heads", q, k, v


def _gqa_shaped(fn, where, q, k, v):
    try:
        got = fn(q, k, v)
    except (RuntimeError, ValueError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; k and v have G heads and q has H: give "
            "every query head its key-value head before the batched product") from None
    assert isinstance(got, torch.Tensor), (
        f"{where}: expected a tensor, got {type(got).__name__} (the module's "
        "scaled_dot_product_attention returns output and weights)")
    assert tuple(got.shape) == tuple(q.shape), (
        f"{where}: expected shape (B, H, L, hd) = {tuple(q.shape)}, got {tuple(got.shape)}")
    return got


def _gqa_values(fn, kind):
    from attention import scaled_dot_product_attention
    for where, q, k, v in _gqa_inputs((kind,)):
        got = _gqa_shaped(fn, where, q, k, v)
        H, G = q.shape[1], k.shape[1]
        for h in range(H):  # one query head at a time, with its key-value head h // (H // G)
            want = scaled_dot_product_attention(q[:, h], k[:, h // (H // G)],
                                                v[:, h // (H // G)])[0]  # (B, L, hd)
            if torch.allclose(got[:, h], want, atol=1e-6):
                continue
            uses = [j for j in range(G) if torch.allclose(
                got[:, h], scaled_dot_product_attention(q[:, h], k[:, j], v[:, j])[0],
                atol=1e-6)]
            if uses:
                raise AssertionError(
                    f"{where}: query head {h} used key-value head {uses[0]}, not "
                    f"{h} // (H // G) = {h // (H // G)}; heads 0..{H // G - 1} share key-value "
                    "head 0 (repeat_interleave repeats each head in place; repeat cycles "
                    "through them)")
            raise AssertionError(f"{where}: query head {h} differs from attention with "
                                 f"key-value head {h // (H // G)}")


@check_grouped_query_attention.case("shapes")
def _(fn):
    for where, q, k, v in _gqa_inputs():
        _gqa_shaped(fn, where, q, k, v)


@check_grouped_query_attention.case("groups of query heads: (H, G) = (4, 2), (6, 3), (8, 2)")
def _(fn):
    _gqa_values(fn, "grouped")


@check_grouped_query_attention.case("multi-query attention: G = 1")
def _(fn):
    _gqa_values(fn, "multi-query")


@check_grouped_query_attention.case("multi-head attention: G = H")
def _(fn):
    _gqa_values(fn, "multi-head")


# === Chapter 7: cross_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None) -> (B, L, d_v)

check_cross_attention = Check(
    "check_cross_attention",
    forbidden=("attention.scaled_dot_product_attention",
               "torch.nn.functional.scaled_dot_product_attention",
               "attention.MultiHeadAttention", "torch.nn.MultiheadAttention",
               "torch.nn.functional.multi_head_attention_forward"))


def _cross_inputs():
    """{name: (where, inputs)}: decoder and encoder of different lengths and widths;
    inputs = (x_dec, x_enc, w_q, w_k, w_v, enc_lengths)."""
    g = torch.Generator().manual_seed(7)
    cases = {  # B, L, S, d_dec, d_enc, d_k, d_v, enc_lengths, input size
        "no padding": (2, 3, 5, 4, 4, 4, 3, None, 2),
        "padded sources": (3, 4, 6, 5, 6, 8, 2, [6, 2, 4], 2),
        "large inputs": (2, 5, 3, 3, 7, 16, 4, [1, 3], 30)}  # scores in the thousands
    out = {}
    for name, (B, L, S, d_dec, d_enc, d_k, d_v, lengths, size) in cases.items():
        x_dec = size * torch.randn(B, L, d_dec, generator=g)
        x_enc = size * torch.randn(B, S, d_enc, generator=g)
        w_q = torch.randn(d_dec, d_k, generator=g)
        w_k = torch.randn(d_enc, d_k, generator=g)
        w_v = torch.randn(d_enc, d_v, generator=g)
        lens = None if lengths is None else torch.tensor(lengths)
        out[name] = (f"L={L}, S={S}, enc_lengths={lengths}",
                     (x_dec, x_enc, w_q, w_k, w_v, lens))
    return out


def _cross_call(fn, where, inputs):
    """fn(*inputs), checked for type and shape."""
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    B, L, S, d_v = x_dec.shape[0], x_dec.shape[1], x_enc.shape[1], w_v.shape[1]
    try:
        got = fn(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=lens)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; queries come from x_dec (B, L, d_dec), "
            "keys and values from x_enc (B, S, d_enc), and the padding mask is (B, 1, S), "
            "over the keys") from None
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) == (B, S, d_v):
        raise AssertionError(
            f"{where}: expected shape (B, L, d_v) = {(B, L, d_v)}, one row per decoder "
            f"position, got {tuple(got.shape)}, one row per encoder position. Queries come "
            "from x_dec, keys and values from x_enc.")
    assert tuple(got.shape) == (B, L, d_v), (
        f"{where}: expected shape (B, L, d_v) = {(B, L, d_v)}, got {tuple(got.shape)}")
    return got


def _one_example_at_a_time(inputs, attend):
    """torch.stack over the examples b of attend(q, k, v, n): q (L, d_k), k (S, d_k), v (S, d_v)
    the example's queries, keys and values, n its number of real encoder positions."""
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    rows = []
    for b in range(x_dec.shape[0]):
        q, k, v = x_dec[b] @ w_q, x_enc[b] @ w_k, x_enc[b] @ w_v
        n = x_enc.shape[1] if lens is None else int(lens[b])
        rows.append(attend(q, k, v, n))
    return torch.stack(rows)  # (B, L, d_v)


def _cross_values(fn, name):
    """Compare with the module's attention, example by example over the real encoder positions
    only; if they differ, name the mistake whose result the answer reproduces."""
    from attention import scaled_dot_product_attention as sdpa
    where, inputs = _cross_inputs()[name]
    got = _cross_call(fn, where, inputs)
    x_dec, x_enc, w_q, w_k, w_v, lens = inputs
    d_dec, d_k, d_v = x_dec.shape[-1], w_q.shape[-1], w_v.shape[-1]

    def each(attend):
        return _one_example_at_a_time(inputs, attend)

    want = each(lambda q, k, v, n: sdpa(q, k[:n], v[:n])[0])
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-4)
    if close(got, want):
        return
    mistakes = [
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=1.0)[0],
         "the scores are not divided by sqrt(d_k)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=1 / d_k)[0],
         "the scores are divided by d_k; divide by sqrt(d_k)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=d_dec ** -0.5)[0],
         "the scores are divided by sqrt(d_dec); divide by sqrt(d_k), the width of the keys"),
        (lambda q, k, v, n: sdpa(k[:n], q, q)[1].T @ v[:n],  # each key's weights over queries
         "softmax over the queries (dim=-2); it must run over the encoder positions (dim=-1)"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], scale=d_v ** -0.5)[0],
         "the scores are divided by sqrt(d_v), the width of the values; divide by sqrt(d_k), "
         "the width of the queries and keys"),
        (lambda q, k, v, n: sdpa(q, k[:n], v[:n], is_causal=True)[0],
         "a causal mask in cross-attention: every decoder position may see the whole source; "
         "only the decoder's self-attention is causal"),
    ]
    if lens is not None:
        mistakes += [
            (lambda q, k, v, n: sdpa(q, k, v)[0],
             "the padding of the encoder is ignored: keys at positions >= enc_lengths[b] must "
             "get zero weight"),
            (lambda q, k, v, n: sdpa(q, k[n:], v[n:])[0],
             "the mask is inverted: it hides the real tokens and keeps the padding"),
            (lambda q, k, v, n: sdpa(q, k[:n + 1], v[:n + 1])[0],
             "off by one in the padding: the real keys are the positions j < enc_lengths[b]"),
            (lambda q, k, v, n: sdpa(q, k, v)[0] * (torch.arange(len(q)) < n)[:, None],
             "query rows are masked: the source's padding is over the keys, the last axis of "
             "the scores (B, L, S); every decoder position has a query"),
            (lambda q, k, v, n: sdpa(q, k, v * (torch.arange(len(k)) < n)[:, None])[0],
             "the mask is applied to the weights after the softmax; fill the padded scores "
             "with -inf before it, so that each row of weights still sums to 1"),
        ]
    zeroed = got.nan_to_num(0.0, 0.0, 0.0)  # NaN and inf set to 0
    for attend, message in mistakes:
        wrong = each(attend)
        if close(zeroed, wrong) and not close(wrong, want):
            raise AssertionError(f"{where}: {message}")
    assert torch.isfinite(got).all(), (
        f"{where}: NaN or inf in the output; exp of a large score overflows: use the module's "
        "softmax, which subtracts each row's maximum")
    err = float((got - want).abs().max())
    raise AssertionError(f"{where}: output differs from the reference by up to {err:.3g}")


@check_cross_attention.case("shapes")
def _(fn):
    for where, inputs in _cross_inputs().values():
        _cross_call(fn, where, inputs)


@check_cross_attention.case("no padding")
def _(fn):
    _cross_values(fn, "no padding")


@check_cross_attention.case("padded sources")
def _(fn):
    _cross_values(fn, "padded sources")


@check_cross_attention.case("large inputs, padded")
def _(fn):
    _cross_values(fn, "large inputs")


# === Chapter 8: rope_interleaved(x, positions) -> rotated x

check_rope_interleaved = Check(
    "check_rope_interleaved",
    forbidden=("position.rotary_embedding",))


def _rope_by_loops(x, positions, layout="interleaved", exponent=2, sign=1, swap=False):
    """x rotated pair by pair, in float64: pairs (2i, 2i+1) ("interleaved") or (i, i + d/2)
    ("half"), angle sign * p * 10000**(-exponent*i/d), cos and sin exchanged if swap."""
    d = x.shape[-1]
    pos = torch.as_tensor(positions).expand(x.shape[:-1]).reshape(-1)
    rows = x.detach().to(torch.float64).reshape(-1, d)
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        p = int(pos[r])
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + d // 2)
            angle = sign * p * 10000.0 ** (-exponent * i / d)
            c, s = math.cos(angle), math.sin(angle)
            if swap:
                c, s = s, c
            u, v = float(rows[r, a]), float(rows[r, b])
            out[r, a] = u * c - v * s
            out[r, b] = v * c + u * s
    return out.reshape(x.shape)


def _rope_inputs():
    """{name: (where, x, positions)}."""
    g = torch.Generator().manual_seed(8)
    shifted = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])  # (B, L): 2 left pads
    return {
        "one sequence": ("x (6, 8), positions arange(6)",
                         torch.randn(6, 8, generator=g, dtype=torch.float64), torch.arange(6)),
        "heads and positions per sequence": (
            "x (B, H, L, d) = (2, 3, 5, 4), positions (B, 1, L) = (2, 1, 5)",
            torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64), shifted[:, None, :]),
        "far positions": ("x (4, 16), positions 1000, 2000, 3000, 4000",
                          torch.randn(4, 16, generator=g, dtype=torch.float64),
                          torch.tensor([1000, 2000, 3000, 4000]))}


def _rope_call(fn, where, x, positions):
    got = fn(x.clone(), positions)
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert tuple(got.shape) == tuple(x.shape), (
        f"{where}: expected the shape of x, {tuple(x.shape)}, got {tuple(got.shape)}")
    return got


def _rope_values(fn, name):
    where, x, positions = _rope_inputs()[name]
    got = _rope_call(fn, where, x, positions).to(torch.float64)
    want = _rope_by_loops(x, positions)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731
    if close(got, want):
        return
    mistakes = [
        (dict(layout="half"), "the pairs are (i, i + d/2), the half-split layout of GPT-NeoX and "
         "Hugging Face; the interleaved layout pairs neighbours (2i, 2i+1)"),
        (dict(exponent=1), "the frequencies are 10000**(-i/d); use 10000**(-2i/d), with i the "
         "index of the pair"),
        (dict(swap=True), "cos and sin are swapped: the first entry of a pair becomes "
         "x_a cos - x_b sin"),
        (dict(sign=-1), "the rotation goes the wrong way (by -angle): the pair (x_a, x_b) becomes "
         "(x_a cos - x_b sin, x_b cos + x_a sin)"),
    ]
    if name != "one sequence":
        mistakes.append((dict(positions=torch.arange(x.shape[-2])),
                         "the positions given are ignored (arange(L) is used): each sequence's "
                         "own position ids must be used, broadcast over the heads"))
    for change, message in mistakes:
        wrong = _rope_by_loops(x, change.pop("positions", positions), **change)
        if close(got, wrong):
            raise AssertionError(f"{where}: {message}")
    err = float((got - want).abs().max())
    hint = ("; are the angles computed in float32? p * frequency must be computed in x's dtype "
            "(float64 here) to stay accurate at large p" if name == "far positions" else "")
    raise AssertionError(
        f"{where}: output differs from the rotation by loops by up to {err:.3g}{hint}")


@check_rope_interleaved.case("shape and dtype")
def _(fn):
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(1))  # float32
    got = _rope_call(fn, "x (3, 5, 6) float32, positions arange(5)", x, torch.arange(5))
    assert got.dtype == torch.float32, (
        f"x (3, 5, 6) float32: the result must keep x's dtype, float32, got {got.dtype}")
    assert torch.isfinite(got).all(), "x (3, 5, 6) float32: NaN or inf in the output"


@check_rope_interleaved.case("one sequence", 2)
def _(fn):
    _rope_values(fn, "one sequence")


@check_rope_interleaved.case("heads and positions per sequence", 2)
def _(fn):
    _rope_values(fn, "heads and positions per sequence")


@check_rope_interleaved.case("far positions")
def _(fn):
    _rope_values(fn, "far positions")


# === Chapter 9: cached_attention(k_cache, v_cache, q, k, v) -> (y, k_cache, v_cache)

check_cached_attention = Check(
    "check_cached_attention",
    forbidden=("attention.scaled_dot_product_attention",
               "torch.nn.functional.scaled_dot_product_attention",
               "attention.MultiHeadAttention", "attention.KVCache",
               "torch.nn.MultiheadAttention",
               "torch.nn.attention.bias.causal_lower_right"))

_CACHED_CASES = {  # name: (B, S cached, n new, T in all, d_k, d_v)
    "one new token, empty cache": (2, 0, 1, 1, 4, 3),
    "one new token after 5 cached": (2, 5, 1, 6, 4, 3),
    "a chunk of 3 new tokens after 4 cached": (2, 4, 3, 7, 4, 3),
    "a sequence, prompt of 3 then one token at a time": (2, 3, 1, 8, 4, 3),
}


def _cached_sequence(name):
    """q, k (B, T, d_k), v (B, T, d_v) of a whole sequence for the case `name`."""
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    g = torch.Generator().manual_seed(90 + S + 10 * n)
    q, k = (torch.randn(B, T, d_k, generator=g) for _ in range(2))
    v = torch.randn(B, T, d_v, generator=g)
    return q, k, v


def _cached_inputs(name):
    """(where, (k_cache, v_cache, q_new, k_new, v_new)) for the case `name`."""
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    q, k, v = _cached_sequence(name)
    where = f"S={S} cached, n={n} new, d_k={d_k}, d_v={d_v}"
    return where, (k[:, :S], v[:, :S], q[:, S:S + n], k[:, S:S + n], v[:, S:S + n])


def _cached_call(fn, where, inputs, caches=True):
    """fn(*inputs), checked for type and shapes: (y, k_cache, v_cache); the caches' shapes
    only if `caches`."""
    k_cache, v_cache, q, k, v = inputs
    B, S, d_k = k_cache.shape
    n, d_v = q.shape[1], v.shape[-1]
    try:
        got = fn(*(t.clone() for t in inputs))
    except (RuntimeError, ValueError, IndexError) as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}; the caches are (B, S, d), the new "
            "tokens (B, n, d): append along the sequence axis, dim 1") from None
    assert isinstance(got, tuple) and len(got) == 3, (
        f"{where}: expected a tuple (y, k_cache, v_cache), got {type(got).__name__}")
    for part, want in zip(("y", "k_cache", "v_cache"),
                          ((B, n, d_v), (B, S + n, d_k), (B, S + n, d_v))):
        t = got[("y", "k_cache", "v_cache").index(part)]
        assert isinstance(t, torch.Tensor), (
            f"{where}: {part} should be a tensor, got {type(t).__name__}")
        if part != "y" and caches and tuple(t.shape) != want:
            if tuple(t.shape) == (B, S, want[2]):
                raise AssertionError(
                    f"{where}: {part} has shape {tuple(t.shape)}, the old cache; return "
                    f"the cache with the n new rows appended, {want}")
            raise AssertionError(
                f"{where}: {part} has shape {tuple(t.shape)}, expected {want}: the cache "
                "grows along the sequence axis (dim 1), by the n new positions")
        if part == "y" and tuple(t.shape) != want:
            raise AssertionError(
                f"{where}: y has shape {tuple(t.shape)}, expected (B, n, d_v) = {want}: "
                "one output row per new token")
    return got


def _cached_mistakes(S, n, d_k, d_v):
    """(visible (n, S + n) or None, scale, message) for the usual mistakes."""
    j = torch.arange(S + n)[None, :]
    r = torch.arange(n)[:, None]
    return [
        (j <= r, d_k ** -0.5,
         "the causal mask is aligned to the top left (tril() of an n x (S + n) matrix, "
         "or is_causal=True): new query r is position S + r and must see keys 0..S + r, "
         "the bottom-right alignment"),
        (j < S + r, d_k ** -0.5,
         "a new token does not see its own key: append the new keys and values to the "
         "cache before attending (query r, position S + r, sees keys 0..S + r, itself "
         "included)"),
        (j < S, d_k ** -0.5,
         "the new tokens see only the cached keys: append the new keys and values before "
         "attending, so that query r sees keys 0..S + r, its own and the earlier new ones "
         "included"),
        (None, d_k ** -0.5,
         "no causal mask among the new tokens: a new token sees the keys of new tokens "
         "after it; query r may see keys 0..S + r only"),
        (j <= S + r, 1.0, "the scores are not divided by sqrt(d_k)"),
        (j <= S + r, 1 / d_k, "the scores are divided by d_k; divide by sqrt(d_k)"),
        (j <= S + r, d_v ** -0.5,
         "the scores are divided by sqrt(d_v), the width of the values; divide by "
         "sqrt(d_k), the width of the queries and keys"),
    ]


def _cached_values(fn, name):
    """Compare y with the rows of full causal attention over the whole sequence; if it
    differs, name the mistake whose result it reproduces."""
    from attention import scaled_dot_product_attention as sdpa
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    where, inputs = _cached_inputs(name)
    y = _cached_call(fn, where, inputs, caches=False)[0]
    q, k, v = _cached_sequence(name)
    want = sdpa(q, k, v, is_causal=True)[0][:, S:S + n]  # (B, n, d_v), rows of the full
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-5)
    if close(y, want):
        return
    keys, values = k[:, :S + n], v[:, :S + n]
    zeroed = y.nan_to_num(0.0, 0.0, 0.0)
    for visible, scale, message in _cached_mistakes(S, n, d_k, d_v):
        wrong = sdpa(q[:, S:S + n], keys, values, attn_mask=visible, scale=scale)[0]
        if close(zeroed, wrong.nan_to_num(0.0)) and not close(wrong, want):
            raise AssertionError(f"{where}: {message}")
    assert torch.isfinite(y).all(), f"{where}: NaN or inf in y"
    err = float((y - want).abs().max())
    raise AssertionError(f"{where}: y differs from causal attention over all S + n "
                         f"positions by up to {err:.3g}")


@check_cached_attention.case("one new token, empty cache")
def _(fn):
    _cached_values(fn, "one new token, empty cache")


@check_cached_attention.case("one new token after 5 cached")
def _(fn):
    _cached_values(fn, "one new token after 5 cached")


@check_cached_attention.case("a chunk of 3 new tokens after 4 cached", 2)
def _(fn):
    _cached_values(fn, "a chunk of 3 new tokens after 4 cached")


@check_cached_attention.case("the returned caches")
def _(fn):
    for name in ("one new token, empty cache", "a chunk of 3 new tokens after 4 cached"):
        where, inputs = _cached_inputs(name)
        _, k_out, v_out = _cached_call(fn, where, inputs)
        k_cache, v_cache, _, k, v = inputs
        for part, got, old, new in (("k_cache", k_out, k_cache, k),
                                    ("v_cache", v_out, v_cache, v)):
            if torch.equal(got, torch.cat([old, new], dim=1)):
                continue
            if torch.equal(got, torch.cat([new, old], dim=1)):
                raise AssertionError(
                    f"{where}: {part} has the new rows first; they are the newest "
                    "positions and go after the cached ones")
            raise AssertionError(
                f"{where}: {part} should be the old cache with the new rows appended "
                "along dim 1, unchanged")


@check_cached_attention.case("a sequence, prompt of 3 then one token at a time")
def _(fn):
    from attention import scaled_dot_product_attention as sdpa
    name = "a sequence, prompt of 3 then one token at a time"
    B, S, n, T, d_k, d_v = _CACHED_CASES[name]
    q, k, v = _cached_sequence(name)
    want = sdpa(q, k, v, is_causal=True)[0]  # (B, T, d_v)
    k_cache, v_cache = k[:, :0], v[:, :0]
    start, rows = 0, []
    for size in [S] + [1] * (T - S):
        where = f"decoding T={T}: prompt of {S}, then one token; step at position {start}"
        y, k_cache, v_cache = _cached_call(
            fn, where, (k_cache, v_cache, q[:, start:start + size],
                        k[:, start:start + size], v[:, start:start + size]))
        rows.append(y)
        start += size
        got = torch.cat(rows, dim=1)
        if not torch.allclose(got, want[:, :start], rtol=1e-4, atol=1e-5):
            _cached_values(fn, "a chunk of 3 new tokens after 4 cached")  # names a mistake
            raise AssertionError(
                f"{where}: the outputs differ from causal attention over the whole "
                "sequence; check the caches you return, which the next step receives")


# === Chapter 10: merge_partials(m1, ell1, y1, m2, ell2, y2) -> (m, ell, y)

check_merge_partials = Check(
    "check_merge_partials",
    forbidden=("torch.logsumexp", "torch.Tensor.logsumexp", "torch.logaddexp",
               "torch.Tensor.logaddexp", "torch.softmax", "torch.nn.functional.softmax",
               "torch.Tensor.softmax", "attention.softmax"))


def _partial(z: torch.Tensor, v: torch.Tensor):
    """The partial result of one block of keys, by its definition: z (..., L, c) scores of the
    block (-inf = not visible), v (..., c, Ev) its values -> m (..., L) the largest score,
    ell (..., L) the sum of exp(z - m), y (..., L, Ev) the sum of exp(z - m) * v. A row that
    sees no key of the block has m = -inf, ell = 0, y = 0."""
    m = z.amax(dim=-1) if z.shape[-1] else z.new_full(z.shape[:-1], float("-inf"))
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    e = torch.exp(z - shift[..., None])  # (..., L, c), 0 where z = -inf
    return m, e.sum(dim=-1), e @ v


def _merge_inputs(name: str):
    """(where, z, v, split): scores z (..., L, S) and values v (..., S, Ev) of a case, and the
    index where the keys split into block 1 and block 2."""
    g = torch.Generator().manual_seed(10)
    if name == "two blocks":  # moderate scores, a batch axis, L != Ev
        z = 2 * torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
        return "scores (2, 5, 7), keys 0-3 | 4-6", z, torch.randn(2, 7, 3, generator=g,
                                                                  dtype=torch.float64), 4
    if name == "large scores":  # block 2 in the thousands: exp of a score overflows
        z = torch.randn(4, 6, generator=g, dtype=torch.float64)
        z[:, 3:] += 1000.0
        z[1:3, :3] += 2000.0  # rows 1 and 2: block 1 is the larger
        return "scores (4, 6) near 1000 and 2000, keys 0-2 | 3-5", z, torch.randn(
            6, 2, generator=g, dtype=torch.float64), 3
    # "empty blocks": row 0 sees only block 2, row 1 only block 1, row 2 nothing at all
    z = torch.randn(3, 5, generator=g, dtype=torch.float64)
    z[0, :2] = z[1, 2:] = z[2, :] = float("-inf")
    return ("scores (3, 5), keys 0-1 | 2-4; row 0 sees only block 2, row 1 only block 1, "
            "row 2 no key"), z, torch.randn(5, 4, generator=g, dtype=torch.float64), 2


def _merge_call(fn, where, part1, part2):
    """fn(*part1, *part2), checked for type and shapes."""
    try:
        got = fn(*part1, *part2)
    except RuntimeError as err:
        raise AssertionError(
            f"{where}: {fn.__name__} raised {err!r}. m and ell are (..., L), one number per "
            "query row, and y is (..., L, Ev): to scale the rows of y by a factor of shape "
            "(..., L), index it as factor[..., None]") from None
    assert isinstance(got, tuple) and len(got) == 3, (
        f"{where}: return a tuple (m, ell, y), got {type(got).__name__}")
    for label, t, like in zip(("m", "ell", "y"), got, part1):
        assert isinstance(t, torch.Tensor), f"{where}: {label} must be a tensor"
        assert t.shape == like.shape, (
            f"{where}: {label} must have shape {tuple(like.shape)}, as {label}1 has; got "
            f"{tuple(t.shape)}")
    return got


def _merge_values(fn, name: str):
    """Merge the partial results of the two blocks of a case and compare with the partial
    result of all the keys at once; if they differ, name the mistake."""
    where, z, v, split = _merge_inputs(name)
    part1 = _partial(z[..., :split], v[..., :split, :])
    part2 = _partial(z[..., split:], v[..., split:, :])
    m, ell, y = _merge_call(fn, where, part1, part2)
    want_m, want_ell, want_y = _partial(z, v)
    close = functools.partial(torch.allclose, rtol=1e-9, atol=1e-12, equal_nan=True)
    (m1, ell1, y1), (m2, ell2, y2) = part1, part2
    bad = m.isnan() | ell.isnan() | y.isnan().any(dim=-1)  # (..., L)
    if (bad & (want_m == float("-inf"))).any():
        rows = (bad & (want_m == float("-inf"))).nonzero()[:, -1].tolist()
        raise AssertionError(
            f"{where}: NaN in rows {rows} (0-based), which see no key in either block. A "
            "block that a row does not see has m = -inf, ell = 0, y = 0, and "
            "exp(-inf - (-inf)) is NaN: where the new maximum is -inf, shift by 0 instead")
    if bad.any():
        raise AssertionError(
            f"{where}: NaN or inf in the result (inf / inf, or inf * 0). Only differences of "
            "scores may be exponentiated, and only ones <= 0: rescale each block by "
            "exp(its maximum - the new maximum), never by exp(a maximum) alone")
    if not close(m, want_m):
        assert not close(m, m2), (
            f"{where}: m is the second block's maximum m2; the merged maximum is the larger "
            "of m1 and m2")
        assert not close(m, m1), (
            f"{where}: m is the first block's maximum m1; the merged maximum is the larger "
            "of m1 and m2")
        raise AssertionError(f"{where}: m must be the largest score of both blocks, "
                             "torch.maximum(m1, m2)")
    if not (ell.isfinite().all() and y.isfinite().all()):
        raise AssertionError(
            f"{where}: inf in ell or y. Only differences of scores may be exponentiated, and "
            "only ones <= 0: rescale each block by exp(its maximum - the new maximum), never "
            "by exp(a maximum) alone or by exp(new maximum - old maximum)")
    m_safe = torch.where(m.isfinite(), m, torch.zeros_like(m))
    f1 = torch.exp(m1 - m_safe)  # the factors that bring each block to the new maximum
    f2 = torch.exp(m2 - m_safe)
    if not close(ell, want_ell):
        mistakes = [
            (ell1 + ell2, "the running sums are added without rescaling: each block's ell is "
             "relative to its own maximum, so bring both to the new maximum first"),
            (ell1 / f1 + ell2 / f2, "the sums are rescaled by exp(new max - old max), the "
             "inverse of the right factor exp(old max - new max)"),
            (ell1 * torch.exp(m1 - m2) + ell2, "both sums are rescaled to the second block's "
             "maximum m2, not to the new maximum max(m1, m2): right only where m2 >= m1"),
            (ell1 * f1 + ell2, "only the first block's sum is rescaled; the second block's "
             "ell2 is relative to m2 and needs exp(m2 - m) too"),
        ]
        for wrong, message in mistakes:
            if close(ell, wrong):
                raise AssertionError(f"{where}: {message}")
        err = float((ell - want_ell).abs().max())
        raise AssertionError(f"{where}: ell differs from the sum of exp(score - m) over both "
                             f"blocks by up to {err:.3g}")
    if not close(y, want_y):
        g1, g2 = f1[..., None], f2[..., None]
        mistakes = [
            (y1 + y2, "ell is rescaled but y is not: the unnormalised outputs need the same "
             "factors as the sums"),
            (y1 / g1 + y2 / g2, "y is rescaled by exp(new max - old max), the inverse of the "
             "right factor"),
            (want_y / want_ell[..., None], "y is divided by ell: keep it unnormalised while "
             "merging, and divide by ell once, after the last block"),
            (y1 * g1 + y2, "only the first block's y is rescaled; y2 is relative to m2 and "
             "needs exp(m2 - m) too"),
            ((y1 * g1 + y2 * g2) / 2, "the two rescaled outputs are averaged; add them: "
             "the weights come from ell, at the end"),
        ]
        for wrong, message in mistakes:
            if close(y, wrong):
                raise AssertionError(f"{where}: {message}")
        err = float((y - want_y).abs().max())
        raise AssertionError(f"{where}: y differs from the sum of exp(score - m) * value over "
                             f"both blocks by up to {err:.3g}")


@check_merge_partials.case("shapes", 1)
def _(fn):
    for name in ("two blocks", "large scores", "empty blocks"):
        where, z, v, split = _merge_inputs(name)
        _merge_call(fn, where, _partial(z[..., :split], v[..., :split, :]),
                    _partial(z[..., split:], v[..., split:, :]))


@check_merge_partials.case("two blocks", 2)
def _(fn):
    _merge_values(fn, "two blocks")


@check_merge_partials.case("large scores", 1)
def _(fn):
    _merge_values(fn, "large scores")


@check_merge_partials.case("empty blocks", 1)
def _(fn):
    _merge_values(fn, "empty blocks")


@check_merge_partials.case("many blocks, folded", 1)
def _(fn):
    from attention import scaled_dot_product_attention as sdpa
    g = torch.Generator().manual_seed(11)
    q = 3 * torch.randn(6, 4, generator=g, dtype=torch.float64)  # (L, E)
    k = torch.randn(23, 4, generator=g, dtype=torch.float64)  # (S, E)
    v = torch.randn(23, 5, generator=g, dtype=torch.float64)  # (S, Ev)
    z = q @ k.T / 2.0  # (L, S), scale 1/sqrt(E)
    state = (torch.full((6,), float("-inf"), dtype=torch.float64),
             torch.zeros(6, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64))
    where = "six queries, 23 keys in blocks of 4 (the last of 3), from the empty state"
    for j0 in range(0, 23, 4):
        state = _merge_call(fn, where, state, _partial(z[:, j0:j0 + 4], v[j0:j0 + 4]))
    m, ell, y = state
    want, _ = sdpa(q, k, v)  # (L, Ev)
    got = y / ell[:, None]
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), (
        f"{where}: y / ell after the last block differs from attention's output by up to "
        f"{float((got - want).abs().max()):.3g}")


# === end of the chapters' checks


CHECKS = {name: value for name, value in globals().items() if isinstance(value, Check)}
__all__ += sorted(CHECKS)
