"""The checks of Chapter 3, Why divide by sqrt(d_k) (the machinery: checking.py)."""

from __future__ import annotations

import math

import torch

from checking import Check, Rule

# score_variance(d_k, n, sigma, generator) -> (raw_var, scaled_var)


def _reseeds(fn) -> str | None:
    """Whether fn reseeds PyTorch's global generator, by what it does: started from two
    different global states, it leaves the same one behind. The caller's state is restored."""
    saved = torch.random.get_rng_state()
    try:
        after = []
        for start in (1, 2):
            torch.random.manual_seed(start)
            fn(4, 100, 1.0, torch.Generator().manual_seed(5))
            after.append(torch.random.get_rng_state())
    finally:
        torch.random.set_rng_state(saved)
    if torch.equal(*after):
        return (f"{fn.__name__} reseeds PyTorch's global generator (torch.manual_seed or "
                "another way to it): draw with the generator you are given")
    return None


def _not_measured(fn) -> str | None:
    """Whether fn's result is a formula rather than a measurement, by how it varies from
    generator to generator. The raw variance of n scores q.k, each a sum of d_k products of
    N(0, sigma^2) entries (fourth moment 3 d_k (d_k + 2) sigma^8), has a relative standard
    deviation of about sqrt((2 + 6 / d_k) / n) when it is estimated from n pairs: it shrinks 5
    times from n = 800 to n = 20_000. The lemma's values, with or without noise added, do not.
    The bounds are wide (a variance of 16 generators' estimates falls outside them with
    probability below 1e-8), so that an honest estimate with a mistake in it is not taken for
    a formula: a standard deviation returned instead varies half as much, an estimate from
    n / 10 pairs three times as much."""
    d_k, sigma, seeds = 8, 1.0, range(100, 116)
    spread = {}
    for n in (800, 20_000):
        expected = math.sqrt((2 + 6 / d_k) / n)
        spread[n] = _relative_spread(fn, d_k, sigma, n, seeds)
        if not 0.25 * expected <= spread[n] <= 4 * expected:
            break
    else:
        if 2 <= spread[800] / spread[20_000] <= 12.5:
            return None
    return (f"{fn.__name__}'s result does not vary with the generator as an estimate from n "
            f"pairs does: over {len(seeds)} generators, with d_k={d_k} and sigma={sigma}, its raw "
            "variance varies by "
            + " and ".join(f"{value:.3g} of its value at n={n}" for n, value in spread.items())
            + ", where an estimate from n pairs varies by about "
            + " and ".join(f"{math.sqrt((2 + 6 / d_k) / n):.3g}" for n in spread)
            + ". Draw n pairs with the generator you are given (not one of your own) and "
            "measure the variance of their scores; do not compute it from the lemma")


check_score_variance = Check(
    "check_score_variance",
    rules=[Rule("torch.manual_seed", python=lambda: [
        torch.random.manual_seed, torch.random.seed, torch.random.set_rng_state],
        tensor_methods=("default_generator.manual_seed", "default_generator.seed",
                        "default_generator.set_state"))],
    inspect=lambda fn: _reseeds(fn) or _not_measured(fn))

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


@check_score_variance.case("drawn with generator only")
def _(fn):
    saved = torch.random.get_rng_state()
    for d_k, sigma in _VARIANCE_CASES:
        case = f"d_k={d_k}, sigma={sigma}"
        first, second = _variances(fn, d_k, sigma), _variances(fn, d_k, sigma)
        assert torch.equal(torch.random.get_rng_state(), saved), (
            f"{case}: {fn.__name__} draws from PyTorch's global generator; pass "
            "generator=generator to every torch.randn call")
        assert first == second, (
            f"{case}: generators seeded alike gave different results; pass "
            "generator=generator to every torch.randn call")
        assert _variances(fn, d_k, sigma, seed=21) != first, (
            f"{case}: generators seeded differently gave the same results: draw q and k "
            "with the generator you are given, not one of your own")


def _relative_spread(fn, d_k, sigma, n, seeds):
    """The standard deviation of fn's raw variance over generators seeded with `seeds`,
    relative to the mean."""
    raw = []
    for seed in seeds:
        out = fn(d_k, n, sigma, torch.Generator().manual_seed(seed))
        assert isinstance(out, (tuple, list)) and len(out) == 2, (
            f"expected a tuple (raw_var, scaled_var), got {type(out).__name__}")
        raw.append(_variance_number(out[0]))
    assert None not in raw, "expected numbers"
    values = torch.tensor(raw, dtype=torch.float64)
    return float(values.std() / values.mean().abs())


@check_score_variance.case("Var[q.k] = d_k sigma^4", 2)
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


@check_score_variance.case("Var[q.k / sqrt(d_k)] = sigma^4", 2)
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
