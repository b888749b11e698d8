"""The self-checking coding exercises of the chapters.

Every chapter has one or two checks that a student runs on their own function, and a gated
solution whose code cell defines the reference function and calls the check on it. A check is a
`checking.Check` of code/checks_<chapter>.py, a list of cases worth points that an nbgrader assignment grades
one by one, which a chapter imports (`from checks import check_xxx`); no chapter defines a
check of its own. Here each check must

* accept the reference solution, and other correct ways of writing it;
* reject the stub a student starts from (tools/chapter_structure.py, `stub_code`) with a message
  saying the function is not written yet;
* reject every wrong answer of the catalogue below with a message that names the mistake;
* give every wrong answer part of the points (it passes some case and fails
  another) unless it is registered with earns="nothing", and give nothing, naming the call, to
  an answer that calls what the exercise forbids (the `shortcut` entries).

A new check in a chapter fails `test_every_check_has_a_catalogue` until its wrong answers are
written here.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import attention
import checking
import flash
import induction
import lm
import position
import transformer
from attention import causal_mask, padding_mask, scaled_dot_product_attention, softmax
from chapter_structure import (SOLUTION, CodeCell, check_calls, imported_checks, read_source,
                               stub_code)
from classroom import numbered_chapters

torch.set_num_threads(1)

NOT_WRITTEN = "{} is not written yet: replace `raise NotImplementedError()` with your code"

# What a solution cell may use without importing it: the chapters' own imports.
SOLUTION_GLOBALS = {"torch": torch, "math": math, "F": F,
                    **{name: getattr(module, name) for module in (attention, position, flash, transformer)
                       for name in module.__all__}}


# ---------------------------------------------------------------------------------------------
# Reading the chapters (tools/chapter_structure.py reads them for the build and the notebooks)


def defined_checks(cell: CodeCell) -> list[str]:
    """The check_* functions a visible cell imports from code/checks_<chapter>.py."""
    return [] if cell.solution_of is not None else imported_checks(cell.source)


def definitions_only(source: str) -> str:
    """The imports and function definitions of a cell, without the calls."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.Import, ast.ImportFrom))]
    return ast.unparse(tree)


CHAPTERS = [read_source(path) for path in numbered_chapters()]

CHECK_CELLS: dict[str, CodeCell] = {}  # check name -> the cell that defines it
for _chapter in CHAPTERS:
    for _cell in _chapter.cells:
        for _name in defined_checks(_cell):
            assert _name not in CHECK_CELLS, f"{_name} is defined twice"
            CHECK_CELLS[_name] = _cell


@dataclass
class Reference:
    cell: CodeCell
    functions: list[str]  # the arguments of the check call, in order


REFERENCES: dict[str, Reference] = {}  # check name -> the solution cell that calls it
for _chapter in CHAPTERS:
    for _cell in _chapter.cells:
        if _cell.solution_of is None or SOLUTION not in _cell.tags:
            continue
        for _name, _args in check_calls(_cell.source):
            REFERENCES.setdefault(_name, Reference(_cell, _args))

CHECK_NAMES = sorted(CHECK_CELLS)


CHECKS = checking.all_checks()


def load_check(name: str) -> checking.Check:
    return CHECKS[name]


def load_functions(source: str, names: list[str], label: str) -> dict:
    namespace = dict(SOLUTION_GLOBALS)
    exec(compile(source, f"<{label}>", "exec"), namespace)
    return {name: namespace[name] for name in names}


def reference_functions(check: str) -> dict:
    ref = REFERENCES[check]
    return load_functions(definitions_only(ref.cell.source), ref.functions, f"{check} solution")


def stub_functions(check: str) -> dict:
    ref = REFERENCES[check]
    stubbed = stub_code(ref.cell.source)
    assert stubbed is not None, f"stub_code found no function in the solution of {check}"
    return load_functions(stubbed[0], ref.functions, f"{check} stub")


def call_check(check: str, replace: dict):
    """Run the check on the reference functions, some of them replaced."""
    functions = reference_functions(check)
    unknown = set(replace) - set(functions)
    assert not unknown, f"{check} takes no function named {unknown}"
    functions.update(replace)
    return load_check(check)(*functions.values())


# ---------------------------------------------------------------------------------------------
# The catalogue: common wrong answers, each with a fragment its message must contain, and
# correct answers written differently from the reference, which every check must accept.

WRONG: dict[str, list] = {}  # check name -> [(id, fragment, {function name: function})]
RIGHT: dict[str, list] = {}  # check name -> [(id, {function name: function})]


EARNS: dict[tuple[str, str], str] = {}  # (check, wrong answer) -> "part" or "nothing"


def wrong(check: str, fragment: str, replaces: str | None = None, earns: str = "part"):
    """Register a wrong answer: `check` must reject it saying `fragment`. A `Check` must give it
    part of its points, or none with earns="nothing"."""
    assert earns in {"part", "nothing"}
    def register(fn):
        WRONG.setdefault(check, []).append((fn.__name__, fragment, replaces, fn))
        EARNS[check, fn.__name__] = earns
        return fn
    return register


# What the message of a check says of each forbidden call: the label of the Rule that catches it.
RULE_OF_CALL = {
    "attention.softmax": "the module's softmax",
    "attention.scaled_dot_product_attention": "the module's scaled_dot_product_attention",
    "attention.MultiHeadAttention": "the module's MultiHeadAttention",
    "attention.KVCache": "the module's KVCache",
    "attention.repeat_kv": "the module's repeat_kv",
    "attention.causal_mask": "the module's causal_mask",
    "attention.padding_mask": "the module's padding_mask",
    "attention.MultiHeadAttention.split_heads": "the module's MultiHeadAttention.split_heads",
    "attention.MultiHeadAttention.merge_heads": "the module's MultiHeadAttention.merge_heads",
    "position.rotary_embedding": "the module's rotary_embedding",
    "transformer.TransformerBlock": "the module's TransformerBlock",
    "transformer.TransformerBlock.forward": "the module's TransformerBlock",
    "torch.nn.TransformerEncoderLayer": "PyTorch's Transformer layers",
    "transformer.DecoderLM": "the module's DecoderLM",
    "induction.induction_score": "the module's induction_score",
    "induction.Batch.copyable": "the module's Batch.copyable",
    "lm.bigram_loss": "the module's bigram_loss",
    "torch.nn.functional.layer_norm": "a ready-made normalisation",
    "torch.nn.LayerNorm": "a ready-made normalisation",
    "torch.nn.functional.group_norm": "a ready-made normalisation",
    "torch.nn.functional.batch_norm": "a ready-made normalisation",
    "torch.softmax": "a ready-made softmax", "torch.Tensor.softmax": "a ready-made softmax",
    "torch.nn.functional.softmax": "a ready-made softmax",
    "torch.special.softmax": "a ready-made softmax",
    "torch.log_softmax": "a ready-made softmax",
    "torch.Tensor.log_softmax": "a ready-made softmax",
    "torch.nn.functional.log_softmax": "a ready-made softmax",
    "torch.logsumexp": "torch.logsumexp", "torch.logaddexp": "torch.logsumexp",
    "torch.nn.functional.scaled_dot_product_attention": "PyTorch's attention",
    "torch.nn.MultiheadAttention": "PyTorch's attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's attention",
    "torch.nn.attention.bias.causal_lower_right": "PyTorch's attention",
    "torch.manual_seed": "torch.manual_seed", "torch.random.manual_seed": "torch.manual_seed",
    "loops over the queries or keys": "", # a message of its own: "... loops over the ..."
}


FORBIDDEN_WORK: set[str] = set()  # the names of the answers that do forbidden work


def shortcut(check: str, call: str, replaces: str | None = None):
    """Register a correct answer that makes a call the exercise forbids, however it reaches it:
    it earns nothing, and the message names what ran."""
    fragment = RULE_OF_CALL[call] if RULE_OF_CALL.get(call, call) else call
    register = wrong(check, fragment, replaces, earns="nothing")

    def forbidden(fn):
        FORBIDDEN_WORK.add(fn.__name__)
        return register(fn)
    return forbidden


def right(check: str, replaces: str | None = None):
    """Register a correct answer written differently: `check` must accept it."""
    def register(fn):
        RIGHT.setdefault(check, []).append((fn.__name__, replaces, fn))
        return fn
    return register


def _exp_rows(scores, dim=-1):
    """A correct softmax, for the wrong answers that make another mistake."""
    exp = torch.exp(scores - scores.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=dim, keepdim=True)


# --- chapter 1: check_simple_self_attention(fn), fn(x) -> (output, weights) ------------------

C1 = "check_simple_self_attention"


@wrong(C1, "NaN or inf")
def ssa_naive_exp(x):
    exp = torch.exp(x @ x.transpose(-2, -1))
    weights = exp / exp.sum(-1, keepdim=True)
    return weights @ x, weights


@wrong(C1, "subtract each row's maximum")
def ssa_global_max(x):
    scores = x @ x.transpose(-2, -1)
    exp = torch.exp(scores - scores.max())  # one shift for all rows: rows underflow to 0/0
    weights = exp / exp.sum(-1, keepdim=True)
    return weights @ x, weights


@wrong(C1, "columns of weights sum to 1, not the rows: normalise over the keys, dim=-1")
def ssa_softmax_over_queries(x):
    weights = _exp_rows(x @ x.transpose(-2, -1), dim=-2)
    return weights @ x, weights


@wrong(C1, "you divided the scores by sqrt(d)")
def ssa_scaled(x):
    weights = _exp_rows(x @ x.transpose(-2, -1) / math.sqrt(x.shape[-1]))
    return weights @ x, weights


@wrong(C1, "return (output, weights)", earns="nothing")
def ssa_swapped_return(x):
    weights = _exp_rows(x @ x.transpose(-2, -1))
    return weights, weights @ x


@wrong(C1, "x.transpose(-2, -1); x.T reverses all of them")
def ssa_x_dot_T(x):
    import warnings
    with warnings.catch_warnings():  # x.T on a batch is deprecated, then fails in the matmul
        warnings.simplefilter("ignore")
        weights = _exp_rows(x @ x.T)
    return weights @ x, weights


@wrong(C1, "expected shape (..., T, T) = (2, 4, 4), got (8, 8)")
def ssa_batch_as_one_sequence(x):
    flat = x.reshape(-1, x.shape[-1])  # all tokens of the batch in one sequence
    weights = _exp_rows(flat @ flat.T)
    return weights @ flat, weights


@wrong(C1, "each row of weights must sum to 1")
def ssa_no_softmax(x):
    weights = x @ x.transpose(-2, -1)
    return weights @ x, weights


@wrong(C1, "output != weights @ x")
def ssa_transposed_weights_in_output(x):
    weights = _exp_rows(x @ x.transpose(-2, -1))
    return weights.transpose(-2, -1) @ x, weights


@wrong(C1, "return a tuple (output, weights)", earns="nothing")
def ssa_output_only(x):
    return _exp_rows(x @ x.transpose(-2, -1)) @ x


@wrong(C1, "batch (2, 4, 3): the columns of weights sum to 1, not the rows")
def ssa_softmax_dim_1(x):
    weights = _exp_rows(x @ x.transpose(-2, -1), dim=1)  # the keys' axis only without a batch
    return weights @ x, weights


@shortcut(C1, "attention.scaled_dot_product_attention")
def ssa_module(x):
    return attention.scaled_dot_product_attention(x, x, x, scale=1.0)


@shortcut(C1, "attention.scaled_dot_product_attention")
def ssa_module_imported(x):
    return scaled_dot_product_attention(x, x, x, scale=1.0)  # imported from attention


@shortcut(C1, "torch.nn.functional.scaled_dot_product_attention")
def ssa_torch_sdpa(x):
    weights = _exp_rows(x @ x.transpose(-2, -1))
    return F.scaled_dot_product_attention(x, x, x, scale=1.0), weights


@shortcut(C1, "torch.softmax")
def ssa_torch_softmax(x):
    weights = torch.softmax(torch.einsum("...id,...jd->...ij", x, x), dim=-1)
    return weights @ x, weights


@wrong(C1, "drawn at random (")
def ssa_up_to_one_batch_axis(x):
    """Right for the shapes the statement's examples show, (T, d) and (B, T, d), only."""
    keys = x.T if x.dim() == 2 else x.transpose(1, 2)
    weights = _exp_rows(x @ keys)
    return weights @ x, weights


@right(C1)
def ssa_float64(x):
    x64 = x.double()
    scores = x64 @ x64.mT
    exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = exp / exp.sum(dim=-1, keepdim=True)
    return (weights @ x64).float(), weights.float()


@right(C1)
def ssa_broadcast_sums(x):
    scores = (x.unsqueeze(-2) * x.unsqueeze(-3)).sum(-1)  # another rounding of the scores
    exp = (scores - scores.max(dim=-1, keepdim=True).values).exp()
    weights = exp / exp.sum(-1, keepdim=True)
    return (weights.unsqueeze(-1) * x.unsqueeze(-3)).sum(-2), weights


# --- chapter 2: check_self_attention(fn), fn(x, w_q, w_k, w_v) -> (output, weights) ----------

C2 = "check_self_attention"


def _sa(x, w_q, w_k, w_v, scale=None, dim=-1, keys_first=False, values=None):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    scale = 1 / math.sqrt(k.shape[-1]) if scale is None else scale
    scores = (k @ q.transpose(-2, -1) if keys_first else q @ k.transpose(-2, -1)) * scale
    weights = softmax(scores, dim=dim)
    return weights @ (v if values is None else values), weights


@wrong(C2, "the scores are not divided by sqrt(d_k)")
def sa_no_scale(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, scale=1.0)


@wrong(C2, "divided by sqrt(d_model) = sqrt(6); divide by sqrt(d_k) = sqrt(3)")
def sa_scale_d_model(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, scale=1 / math.sqrt(x.shape[-1]))


@wrong(C2, "the scores are divided by d_k; divide by sqrt(d_k)")
def sa_scale_d_k(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, scale=1 / w_k.shape[-1])


@wrong(C2, "K Q^T")
def sa_keys_times_queries(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, keys_first=True)


@wrong(C2, "the columns of weights sum to 1, not the rows: take the softmax over the keys, "
           "dim=-1")
def sa_softmax_over_queries(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, dim=-2)


@wrong(C2, "large inputs: NaN or inf")
def sa_naive_exp(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    exp = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]))
    weights = exp / exp.sum(-1, keepdim=True)
    return weights @ v, weights


@wrong(C2, "multiply the weights by v = x @ w_v, not by x")
def sa_values_not_projected(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v, values=x)


@wrong(C2, "k.T reverses every axis of a batch")
def sa_k_dot_T(x, w_q, w_k, w_v):
    import warnings
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = softmax(q @ k.T / math.sqrt(k.shape[-1]))
    return weights @ v, weights


@wrong(C2, "you returned (weights, output)", earns="nothing")
def sa_swapped_return(x, w_q, w_k, w_v):
    return _sa(x, w_q, w_k, w_v)[::-1]


@wrong(C2, "transpose the keys with k.transpose(-2, -1)")
def sa_transpose_0_1(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    weights = softmax(q @ k.transpose(0, 1) / math.sqrt(k.shape[-1]))  # a batch's axes 0, 1
    return weights @ v, weights


def _sa_scores(x, w_q, w_k):
    q, k = x @ w_q, x @ w_k
    return q, k, softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]))


@shortcut(C2, "attention.scaled_dot_product_attention")
def sa_module_attention(x, w_q, w_k, w_v):
    return scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)


@shortcut(C2, "torch.nn.functional.scaled_dot_product_attention")
def sa_torch_attention(x, w_q, w_k, w_v):
    q, k, weights = _sa_scores(x, w_q, w_k)
    return F.scaled_dot_product_attention(q, k, x @ w_v), weights


def _sa_one_head(x, w_q, w_k, w_v, mha, projections):
    """Self-attention through a one-head attention module `mha` of width E, its projection
    weights set to the identity: q, k, v padded with zeros to width E, the queries rescaled
    for the module's 1/sqrt(E)."""
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    d_k, d_v, T = k.shape[-1], v.shape[-1], x.shape[-2]
    E = max(d_k, d_v)
    pad = lambda t: F.pad(t, (0, E - t.shape[-1])).reshape(-1, T, E)
    with torch.no_grad():
        for weight in projections(mha):
            weight.copy_(torch.eye(E).repeat(weight.shape[0] // E, 1))
        out, weights = mha(pad(q * math.sqrt(E / d_k)), pad(k), pad(v))
    return (out[..., :d_v].reshape(*x.shape[:-1], d_v),
            weights.reshape(*x.shape[:-1], T))


@shortcut(C2, "attention.MultiHeadAttention")
def sa_module_mha(x, w_q, w_k, w_v):
    mha = attention.MultiHeadAttention(max(w_k.shape[-1], w_v.shape[-1]), 1, bias=False)
    return _sa_one_head(x, w_q, w_k, w_v, mha, lambda m: [
        p.weight for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)])


@shortcut(C2, "torch.nn.MultiheadAttention")
def sa_torch_mha(x, w_q, w_k, w_v):
    E = max(w_k.shape[-1], w_v.shape[-1])
    mha = torch.nn.MultiheadAttention(E, 1, bias=False, batch_first=True)
    return _sa_one_head(x, w_q, w_k, w_v, mha, lambda m: [
        m.in_proj_weight, m.out_proj.weight])  # in_proj_weight: (3E, E), W_Q, W_K, W_V


@right(C2)
def sa_torch_softmax_scaled_queries(x, w_q, w_k, w_v):
    q = (x @ w_q) / math.sqrt(w_q.shape[-1])
    weights = torch.softmax(q @ (x @ w_k).mT, dim=-1)
    return weights @ (x @ w_v), weights


@right(C2)
def sa_einsum(x, w_q, w_k, w_v):
    q, k, v = (torch.einsum("...td,de->...te", x, w) for w in (w_q, w_k, w_v))
    scores = torch.einsum("...ie,...je->...ij", q, k) / k.shape[-1] ** 0.5
    weights = F.softmax(scores, dim=-1)
    return torch.einsum("...ij,...je->...ie", weights, v), weights


# --- chapter 2: check_additive_scores(fn), fn(query, key, w_1, w_2, w_out) -> (L, S) ----------

C2b = "check_additive_scores"


@wrong(C2b, "the tanh is missing")
def add_no_tanh(query, key, w_1, w_2, w_out):
    return ((query @ w_1)[:, None, :] + (key @ w_2)[None, :, :]) @ w_out


@wrong(C2b, "tanh is applied after w_out")
def add_tanh_after_w_out(query, key, w_1, w_2, w_out):
    return torch.tanh(((query @ w_1)[:, None, :] + (key @ w_2)[None, :, :]) @ w_out)


@wrong(C2b, "the scores are transposed")
def add_keys_first(query, key, w_1, w_2, w_out):
    return torch.tanh((key @ w_2)[:, None, :] + (query @ w_1)[None, :, :]) @ w_out


@wrong(C2b, "w_1 and w_2 are swapped")
def add_swapped_weights(query, key, w_1, w_2, w_out):
    return torch.tanh((query @ w_2)[:, None, :] + (key @ w_1)[None, :, :]) @ w_out


@wrong(C2b, "expected shape (L, S) = (3, 3), got (3,)", earns="nothing")
def add_no_broadcast(query, key, w_1, w_2, w_out):
    return torch.tanh(query @ w_1 + key @ w_2) @ w_out  # pairs query i with key i only


@wrong(C2b, "expected shape (L, S) = (3, 3), got (3, 3, 1)")
def add_w_out_as_column(query, key, w_1, w_2, w_out):
    hidden = (query @ w_1)[:, None, :] + (key @ w_2)[None, :, :]
    return torch.tanh(hidden) @ w_out[:, None]  # (L, S, 1): the right numbers, one axis too many


@shortcut(C2b, "loops over the queries or keys")
def add_loop_over_pairs(query, key, w_1, w_2, w_out):
    return torch.stack([torch.stack([torch.tanh(q @ w_1 + k @ w_2) @ w_out for k in key])
                        for q in query])


@shortcut(C2b, "loops over the queries or keys")
def add_loop_over_queries(query, key, w_1, w_2, w_out):
    rows = [torch.tanh(query[i] @ w_1 + key @ w_2) @ w_out for i in range(len(query))]
    return torch.stack(rows)  # one query at a time: still a loop


@right(C2b)
def add_unsqueeze(query, key, w_1, w_2, w_out):
    hidden = (query @ w_1).unsqueeze(1) + (key @ w_2).unsqueeze(0)
    return torch.einsum("lsh,h->ls", torch.tanh(hidden), w_out)


# --- chapter 3: check_score_variance(fn), fn(d_k, n, sigma, generator) -> (raw, scaled) ------

C3 = "check_score_variance"


def _draws(d_k, n, sigma, generator):
    q = sigma * torch.randn(n, d_k, generator=generator)
    k = sigma * torch.randn(n, d_k, generator=generator)
    return (q * k).sum(-1)


def _draws_variances(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


@wrong(C3, "you divided by d_k, not sqrt(d_k)")
def var_divide_by_d_k(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return float(s.var()), float((s / d_k).var())


@wrong(C3, "scaled equals raw: divide the scores by sqrt(d_k)")
def var_no_scale(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return float(s.var()), float(s.var())


@wrong(C3, "you divided the variance by sqrt(d_k)")
def var_variance_over_sqrt_d_k(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return float(s.var()), float(s.var()) / math.sqrt(d_k)


@wrong(C3, "that is the standard deviation, not the variance")
def var_std(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return float(s.std()), float((s / math.sqrt(d_k)).std())


@wrong(C3, "entries have variance sigma: scale by sigma")
def var_entries_variance_sigma(d_k, n, sigma, generator):
    q = math.sqrt(sigma) * torch.randn(n, d_k, generator=generator)
    k = math.sqrt(sigma) * torch.randn(n, d_k, generator=generator)
    s = (q * k).sum(-1)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


@wrong(C3, "entries have variance sigma^4: scale by sigma")
def var_entries_variance_sigma4(d_k, n, sigma, generator):
    q = sigma**2 * torch.randn(n, d_k, generator=generator)
    k = sigma**2 * torch.randn(n, d_k, generator=generator)
    s = (q * k).sum(-1)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


@wrong(C3, "that is Var[q_i k_i]; sum over the d_k entries first")
def var_no_sum(d_k, n, sigma, generator):
    q = sigma * torch.randn(n, d_k, generator=generator)
    k = sigma * torch.randn(n, d_k, generator=generator)
    return float((q * k).var()), float((q * k / math.sqrt(d_k)).var())


@wrong(C3, "pass generator=generator to every torch.randn call")
def var_global_generator(d_k, n, sigma, generator):
    q = sigma * torch.randn(n, d_k)
    k = sigma * torch.randn(n, d_k)
    s = (q * k).sum(-1)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


@wrong(C3, "does not vary with the generator as an estimate from n pairs does", earns="nothing")
def var_own_generator(d_k, n, sigma, generator):
    return _draws_variances(d_k, n, sigma, torch.Generator().manual_seed(0))


@wrong(C3, "does not vary with the generator as an estimate from n pairs does", earns="nothing")
def var_lemma_values(d_k, n, sigma, generator):
    return d_k * sigma**4, sigma**4  # what the exercise asks to measure


@shortcut(C3, "torch.manual_seed")
def var_reseeds_global(d_k, n, sigma, generator):
    torch.manual_seed(generator.initial_seed())  # reproducible, but not drawn with generator
    q = sigma * torch.randn(n, d_k)
    k = sigma * torch.randn(n, d_k)
    s = (q * k).sum(-1)
    return float(s.var()), float((s / math.sqrt(d_k)).var())


@shortcut(C3, "torch.random.manual_seed")
def var_reseeds_global_random(d_k, n, sigma, generator):
    torch.random.manual_seed(generator.initial_seed())
    return _draws_variances(d_k, n, sigma, None)


@wrong(C3, "expected two numbers, got a tensor of shape (20000,) and a tensor of shape "
           "(20000,)", earns="nothing")
def var_returns_scores(d_k, n, sigma, generator):
    s = _draws(d_k, n, sigma, generator)
    return s, s / math.sqrt(d_k)


@right(C3)
def var_one_draw_keys_first(d_k, n, sigma, generator):
    k, q = sigma * torch.randn(2, n, d_k, generator=generator)
    s = torch.einsum("nd,nd->n", q, k)
    centred = s - s.mean()
    raw = float((centred**2).mean())  # the biased estimate: n / (n - 1) makes no difference
    return raw, raw / d_k


# --- chapter 4: check_stable_softmax(fn), fn(scores, dim=-1) -> weights ----------------------

C4 = "check_stable_softmax"


@wrong(C4, "NaN or inf for large (about 1000) scores: subtract the row maximum first")
def sm_naive(scores, dim=-1):
    exp = torch.exp(scores)
    return exp / exp.sum(dim=dim, keepdim=True)


@wrong(C4, "NaN for a row that is all -inf")
def sm_max_shift_only(scores, dim=-1):
    exp = torch.exp(scores - scores.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=dim, keepdim=True)


@wrong(C4, "dim=0: differs from torch.softmax(z, dim=0)")
def sm_ignores_dim(scores, dim=-1):
    return _exp_rows(scores, dim=-1)


@wrong(C4, "dim=0: differs from torch.softmax(z, dim=0)")
def sm_sum_over_last_axis(scores, dim=-1):
    exp = torch.exp(scores - scores.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=-1, keepdim=True)


@wrong(C4, "dim=-1: normalised over the wrong axis")
def sm_over_columns(scores, dim=-1):
    return _exp_rows(scores, dim=0)


@wrong(C4, "keepdim=True")
def sm_no_keepdim(scores, dim=-1):
    exp = torch.exp(scores - scores.amax(dim=dim))  # (3, 5) - (3,) does not broadcast
    return exp / exp.sum(dim=dim)


@wrong(C4, "must keep the dtype of the scores, float16")
def sm_returns_float32(scores, dim=-1):
    s = scores.float()
    top = s.amax(dim=dim, keepdim=True)
    exp = torch.exp(s - torch.where(top.isfinite(), top, 0.0))
    return exp / exp.sum(dim=dim, keepdim=True).clamp_min(1e-30)


@wrong(C4, "a row that is all -inf must give zeros, got [0.333")
def sm_finite_stand_in(scores, dim=-1):
    return _exp_rows(scores.clamp_min(torch.finfo(scores.dtype).min), dim)


@wrong(C4, "expected shape (3, 5), got (15,)", earns="nothing")
def sm_flattened(scores, dim=-1):
    return _exp_rows(scores.reshape(-1), dim=-1)


@shortcut(C4, "attention.softmax")
def sm_module_softmax(scores, dim=-1):
    return softmax(scores, dim=dim)


@shortcut(C4, "torch.Tensor.softmax")
def sm_tensor_softmax(scores, dim=-1):
    return scores.softmax(dim).nan_to_num(0.0)


@shortcut(C4, "torch.nn.functional.log_softmax")
def sm_exp_log_softmax(scores, dim=-1):
    return F.log_softmax(scores, dim=dim).exp().nan_to_num(0.0)


@right(C4)
def sm_float32_inside(scores, dim=-1):
    s = scores.float()
    top = s.amax(dim=dim, keepdim=True)
    exp = torch.exp(s - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    total = exp.sum(dim=dim, keepdim=True)
    return (exp / torch.where(total > 0, total, torch.ones_like(total))).to(scores.dtype)


@wrong(C4, "the gradient is NaN for the all -inf row")
def sm_nan_to_zero(scores, dim=-1):
    top = scores.amax(dim=dim, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    exp = torch.exp(scores - top)
    return (exp / exp.sum(dim=dim, keepdim=True)).nan_to_num(0.0)


@wrong(C4, "the gradient is NaN for the all -inf row")
def sm_where_after_division(scores, dim=-1):
    top = scores.amax(dim=dim, keepdim=True)
    exp = torch.exp(scores - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    out = exp / exp.sum(dim=dim, keepdim=True)
    return torch.where(out.isnan(), torch.zeros_like(out), out)


@wrong(C4, "added to the denominator is 0 in float16")
def sm_eps_in_denominator(scores, dim=-1):
    top = scores.amax(dim=dim, keepdim=True)
    exp = torch.exp(scores - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    return exp / (exp.sum(dim=dim, keepdim=True) + 1e-30)


@right(C4)
def sm_where_before_division(scores, dim=-1):
    top = scores.amax(dim=dim, keepdim=True)
    exp = torch.exp(scores - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total == 0, torch.ones_like(total), total)


# --- chapter 5: check_causal_padding_mask(fn), fn(lengths, T) -> (B, T, T) boolean -----------

C5 = "check_causal_padding_mask"


def _mask(lengths, L, causal=None, padding=None):
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    causal = (j <= i) if causal is None else causal(i, j)
    real = (j[None] < lengths[:, None, None]) if padding is None else padding(j, lengths)
    return causal[None] & real


@wrong(C5, "inverted mask")
def mask_inverted(lengths, L):
    return ~_mask(lengths, L)


@wrong(C5, "the diagonal is missing")
def mask_no_diagonal(lengths, L):
    return _mask(lengths, L, causal=lambda i, j: j < i)


@wrong(C5, "each query may also see the next token")
def mask_sees_next(lengths, L):
    return _mask(lengths, L, causal=lambda i, j: j <= i + 1)


@wrong(C5, "upper triangle")
def mask_upper(lengths, L):
    return _mask(lengths, L, causal=lambda i, j: j >= i)


@wrong(C5, "off by one in the padding")
def mask_padding_off_by_one(lengths, L):
    return _mask(lengths, L, padding=lambda j, n: j[None] <= n[:, None, None])


@wrong(C5, "the rows of padded queries are all False")
def mask_padding_on_queries(lengths, L):
    i = torch.arange(L)[:, None]
    return (torch.arange(L)[None, :] <= i)[None] & (i[None] < lengths[:, None, None])


@wrong(C5, "padding ignored")
def mask_no_padding(lengths, L):
    return torch.ones(L, L, dtype=torch.bool).tril().expand(len(lengths), L, L)


@wrong(C5, "not causal")
def mask_not_causal(lengths, L):
    return _mask(lengths, L, causal=lambda i, j: torch.ones(L, L, dtype=torch.bool))


@wrong(C5, "combined with OR")
def mask_or(lengths, L):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j <= i)[None] | (j[None] < lengths[:, None, None])


@wrong(C5, "the rows of padded queries are all False")
def mask_queries_and_keys(lengths, L):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return _mask(lengths, L) & (i[None] < lengths[:, None, None])


@wrong(C5, "expected a boolean mask (True = may attend), got torch.float32")
def mask_additive(lengths, L):
    return torch.zeros(len(lengths), L, L).masked_fill(~_mask(lengths, L), float("-inf"))


@wrong(C5, "expected shape (B, T, T) = (3, 4, 4), got (4, 4)", earns="nothing")
def mask_one_sequence(lengths, L):
    return _mask(lengths, L)[0]


@wrong(C5, "not lengths.max() by lengths.max()")
def mask_longest_as_size(lengths, L):
    return _mask(lengths, int(lengths.max()))  # L may exceed the longest sequence


@wrong(C5, "by broadcasting", earns="nothing")
def mask_lengths_not_broadcast(lengths, L):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j <= i)[None] & (torch.arange(L) < lengths)  # (L,) against (B,)


@wrong(C5, "entry [b=")
def mask_padded_queries_see_themselves(lengths, L):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return _mask(lengths, L) | ((i == j)[None] & (i[None] >= lengths[:, None, None]))


@shortcut(C5, "attention.causal_mask")
def mask_module_causal(lengths, L):
    real = torch.arange(L)[None, None, :] < lengths[:, None, None]
    return causal_mask(L)[None] & real


@shortcut(C5, "attention.padding_mask")
def mask_module_padding(lengths, L):
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return causal[None] & attention.padding_mask(lengths, L)[:, None, :]


@right(C5)
def mask_tril(lengths, L):
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    return causal & (torch.arange(L) < lengths.unsqueeze(-1)).unsqueeze(1)


# --- chapter 5: check_masked_softmax(fn), fn(scores, mask) -> weights ------------------------

C5b = "check_masked_softmax"


@wrong(C5b, "the gradient is NaN")
def ms_nan_to_num_after(scores, mask):
    # an additive -inf mask: unlike masked_fill, its backward passes the NaN of 0/0 on
    filled = scores + torch.zeros_like(scores).masked_fill(~mask, float("-inf"))
    return _exp_rows(filled).nan_to_num(0.0)


@wrong(C5b, "too many values to unpack (expected 3)")
def ms_three_axes_only(scores, mask):
    """Right for (B, L, S) scores only, the shape of most cases."""
    B, L, S = scores.shape
    keep = mask.expand(B, L, S)
    top = scores.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exp = torch.exp(scores.float() - top).masked_fill(~keep, 0.0)
    return (exp / exp.sum(-1, keepdim=True).clamp_min(1e-30)).to(scores.dtype)


@wrong(C5b, "inverted mask")
def ms_inverted(scores, mask):
    weights = _exp_rows(scores.masked_fill(mask, float("-inf")), dim=-1)
    return weights.nan_to_num(0.0)


@wrong(C5b, "NaN in 1 fully masked row(s)")
def ms_nan_rows(scores, mask):
    return _exp_rows(scores.masked_fill(~mask, float("-inf")), dim=-1)


@wrong(C5b, "uniform weights 1/S")
def ms_finfo_min(scores, mask):
    return _exp_rows(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)


@wrong(C5b, "a fully masked row must give zeros, got weights up to")
def ms_add_minus_1e4(scores, mask):
    return _exp_rows(scores + (~mask) * -1e4, dim=-1)  # an additive finite mask


@wrong(C5b, "a fill such as -1e9 does not fit in float16; fill with -inf")
def ms_fill_minus_1e9(scores, mask):
    weights = _exp_rows(scores.masked_fill(~mask, -1e9), dim=-1)
    return torch.where(mask.any(-1, keepdim=True), weights, 0.0)


@wrong(C5b, "modified its argument `scores`")
def ms_in_place(scores, mask):
    weights = _exp_rows(scores.masked_fill_(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(-1, keepdim=True), weights, 0.0)


@wrong(C5b, "the columns sum to 1, not the rows: take the softmax over the keys, dim=-1")
def ms_over_queries(scores, mask):
    weights = _exp_rows(scores.masked_fill(~mask, float("-inf")), dim=-2)
    return torch.where(mask.any(-1, keepdim=True), weights, 0.0)


@wrong(C5b, "exp of a large score overflows (in float16 above about 11)")
def ms_naive_exp(scores, mask):
    exp = torch.exp(scores) * mask
    total = exp.sum(-1, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


@wrong(C5b, "mask the scores before the softmax, not the weights after it")
def ms_mask_after_softmax(scores, mask):
    return _exp_rows(scores, dim=-1) * mask


@wrong(C5b, "masked positions get weight up to")
def ms_mask_ignored(scores, mask):
    return _exp_rows(scores, dim=-1)


@wrong(C5b, "must keep the dtype of the scores, torch.float16")
def ms_returns_float32(scores, mask):
    weights = _exp_rows(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(-1, keepdim=True), weights, 0.0)


@wrong(C5b, "expected shape (2, 3, 5), got (", earns="nothing")
def ms_boolean_indexing(scores, mask):
    return _exp_rows(scores[mask], dim=-1)  # the visible scores, flattened


@wrong(C5b, "keepdim=True", earns="nothing")
def ms_any_without_keepdim(scores, mask):
    weights = _exp_rows(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(-1), weights, 0.0)  # (B, L) against (B, L, S)


@right(C5b)
def ms_manual_stable(scores, mask):
    filled = scores.masked_fill(~mask, float("-inf"))
    top = filled.amax(-1, keepdim=True)
    exp = torch.exp(filled - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    total = exp.sum(-1, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


@right(C5b)
def ms_float32_inside(scores, mask):
    weights = _exp_rows(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    return weights.nan_to_num(0.0).to(scores.dtype)


@right(C5b)
def ms_where_fill(scores, mask):
    filled = torch.where(mask, scores, float("-inf"))
    top = filled.amax(-1, keepdim=True).clamp_min(-1e4)  # finite on fully masked rows
    exp = torch.exp(filled - top)
    return exp / exp.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


@wrong(C5b, "is 0 in float16")
def ms_eps_in_denominator(scores, mask):
    filled = scores.masked_fill(~mask, float("-inf"))
    top = filled.amax(-1, keepdim=True)
    exp = torch.exp(filled - torch.where(top.isfinite(), top, torch.zeros_like(top)))
    return exp / (exp.sum(-1, keepdim=True) + 1e-30)


@wrong(C5b, "does the mask broadcast")
def ms_boolean_assignment(scores, mask):
    filled = scores.clone()
    filled[~mask] = float("-inf")  # fails unless mask has the shape of scores
    return torch.where(mask.any(-1, keepdim=True), _exp_rows(filled), 0.0)


@shortcut(C5b, "attention.softmax")
def ms_module_softmax(scores, mask):
    return softmax(scores.masked_fill(~mask, float("-inf")))


@shortcut(C5b, "torch.softmax")
def ms_torch_softmax(scores, mask):
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(dim=-1, keepdim=True), weights, 0.0)


@shortcut(C5b, "torch.nn.functional.softmax")
def ms_functional_softmax(scores, mask):
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)


@shortcut(C5b, "torch.Tensor.softmax")
def ms_tensor_softmax(scores, mask):
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)


@shortcut(C5b, "torch.Tensor.log_softmax")
def ms_exp_log_softmax(scores, mask):
    filled = scores.masked_fill(~mask, float("-inf"))
    return filled.log_softmax(-1).exp().nan_to_num(0.0)


# --- chapter 6: check_split_merge(split_heads, merge_heads) ---------------------------------

C6 = "check_split_merge"


@wrong(C6, "the shape is right but tokens are mixed", replaces="split_heads")
def split_no_transpose(x, num_heads):
    B, L, D = x.shape
    if D % num_heads:
        raise ValueError("num_heads must divide D")
    return x.reshape(B, num_heads, L, D // num_heads)


@wrong(C6, "transpose to (B, H, L, hd)", replaces="split_heads")
def split_forgets_transpose(x, num_heads):
    B, L, D = x.shape
    if D % num_heads:
        raise ValueError("num_heads must divide D")
    return x.reshape(B, L, num_heads, D // num_heads)


@wrong(C6, "head h got every H-th feature", replaces="split_heads")
def split_strided(x, num_heads):
    B, L, D = x.shape
    if D % num_heads:
        raise ValueError("num_heads must divide D")
    return x.reshape(B, L, D // num_heads, num_heads).permute(0, 3, 1, 2)


@wrong(C6, "it must raise ValueError itself", replaces="split_heads")
def split_no_value_error(x, num_heads):
    B, L, D = x.shape
    return x.view(B, L, num_heads, D // num_heads).transpose(1, 2)


@wrong(C6, "must raise ValueError: 4 heads cannot share 6 features", replaces="split_heads")
def split_rounds_down(x, num_heads):
    B, L, D = x.shape
    hd = D // num_heads
    return x[..., :num_heads * hd].reshape(B, L, num_heads, hd).transpose(1, 2)


@wrong(C6, "merge_heads reshaped (B, H, L, hd) directly", replaces="merge_heads")
def merge_no_transpose(x):
    B, H, L, hd = x.shape
    return x.reshape(B, L, H * hd)


@wrong(C6, "after a transpose use reshape", replaces="merge_heads")
def merge_view(x):
    B, H, L, hd = x.shape
    return x.transpose(1, 2).view(B, L, H * hd)


@wrong(C6, "merge_heads: expected shape (B, L, D) = (2, 3, 8), got (2, 3, 2, 4)",
       replaces="merge_heads")
def merge_forgets_reshape(x):
    return x.transpose(1, 2)


@wrong(C6, "merge_heads(split(x)) must give x back", replaces="merge_heads")
def merge_interleaved(x):
    B, H, L, hd = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, L, H * hd)  # features of the heads interleaved


@wrong(C6, "split_heads must return a tensor, got tuple", replaces="split_heads")
def split_chunks(x, num_heads):
    return x.chunk(num_heads, dim=-1)  # H tensors (B, L, hd), not one (B, H, L, hd)


@shortcut(C6, "attention.MultiHeadAttention.split_heads", replaces="split_heads")
def split_module_method(x, num_heads):
    return attention.MultiHeadAttention(x.shape[-1], num_heads).split_heads(x)


@shortcut(C6, "attention.MultiHeadAttention.merge_heads", replaces="merge_heads")
def merge_module_method(x):
    B, H, L, hd = x.shape
    return attention.MultiHeadAttention(H * hd, H).merge_heads(x)


@right(C6, replaces="split_heads")
def split_unflatten(x, num_heads):
    if x.shape[-1] % num_heads:
        raise ValueError(f"{num_heads} heads do not divide {x.shape[-1]} features")
    return x.unflatten(-1, (num_heads, -1)).permute(0, 2, 1, 3)


@right(C6, replaces="merge_heads")
def merge_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)


# --- chapter 6: check_grouped_query_attention(fn), fn(q, k, v) -> (B, H, L, hd) ------------

CG = "check_grouped_query_attention"


@wrong(CG, "used key-value head")
def gqa_repeat(q, k, v):
    reps = (1, q.shape[1] // k.shape[1], 1, 1)
    return scaled_dot_product_attention(q, k.repeat(*reps), v.repeat(*reps))[0]


@wrong(CG, "used key-value head 0")
def gqa_first_head_only(q, k, v):
    return scaled_dot_product_attention(q, k[:, :1], v[:, :1])[0]


@wrong(CG, "give every query head its key-value head")
def gqa_no_grouping(q, k, v):
    return scaled_dot_product_attention(q, k, v)[0]


@wrong(CG, "query head 1 used key-value head 1, not 1 // (H // G) = 0")
def gqa_broadcast_wrong_grouping(q, k, v):
    B, H, L, hd = q.shape
    G = k.shape[1]
    grouped = q.reshape(B, H // G, G, L, hd)  # pairs query head h with h % G
    out, _ = scaled_dot_product_attention(grouped, k[:, None], v[:, None])
    return out.reshape(B, H, L, hd)


@shortcut(CG, "torch.nn.functional.scaled_dot_product_attention")
def gqa_torch_enable_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@shortcut(CG, "attention.repeat_kv")
def gqa_module_repeat_kv(q, k, v):
    H, G = q.shape[1], k.shape[1]
    return scaled_dot_product_attention(q, attention.repeat_kv(k, H // G),
                                        attention.repeat_kv(v, H // G))[0]


@wrong(CG, "expected a tensor, got tuple", earns="nothing")
def gqa_returns_both(q, k, v):
    H, G = q.shape[1], k.shape[1]
    return scaled_dot_product_attention(q, k.repeat_interleave(H // G, dim=1),
                                        v.repeat_interleave(H // G, dim=1))


@right(CG)
def gqa_broadcast_groups(q, k, v):
    B, H, L, hd = q.shape
    G = k.shape[1]
    grouped = q.reshape(B, G, H // G, L, hd)  # (B, G, H/G, L, hd)
    out, _ = scaled_dot_product_attention(grouped, k[:, :, None], v[:, :, None])
    return out.reshape(B, H, L, hd)


# --- chapter 7: check_cross_attention(fn) ---------------------------------------------------

C7 = "check_cross_attention"


def _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths, scale=None, dim=-1, keep=None,
           source=None):
    """Cross-attention with one thing changed, for the wrong answers."""
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, L, S)
    if enc_lengths is not None:
        S = x_enc.shape[1]
        real = torch.arange(S) < enc_lengths[:, None] if keep is None else keep(S, enc_lengths)
        scores = scores.masked_fill(~real[:, None, :], float("-inf"))
    return softmax(scores, dim=dim) @ v


@wrong(C7, "divided by sqrt(d_v)")
def cross_scale_d_v(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths,
                  scale=1 / math.sqrt(w_v.shape[1]))


@wrong(C7, "a causal mask in cross-attention")
def cross_causal(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, L, S)
    L, S = scores.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool).tril()  # top-left, as is_causal=True
    if enc_lengths is not None:
        keep = keep & (torch.arange(S) < enc_lengths[:, None])[:, None, :]
    return softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


@wrong(C7, "query rows are masked")
def cross_masks_query_rows(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, L, S)
    if enc_lengths is not None:
        L = scores.shape[-2]
        rows = torch.arange(L) < enc_lengths[:, None]  # (B, L): the wrong axis
        scores = scores.masked_fill(~rows[:, :, None], float("-inf"))
    return softmax(scores, dim=-1) @ v


@wrong(C7, "one row per encoder position", earns="nothing")
def cross_swapped_sources(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_enc @ w_q, x_dec @ w_k, x_dec @ w_v
    return softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v


@wrong(C7, "the scores are not divided by sqrt(d_k)")
def cross_no_scale(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths, scale=1.0)


@wrong(C7, "the scores are divided by d_k; divide by sqrt(d_k)")
def cross_scale_d_k(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths, scale=1 / w_q.shape[-1])


@wrong(C7, "divided by sqrt(d_dec)")
def cross_scale_d_dec(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths, scale=x_dec.shape[-1] ** -0.5)


@wrong(C7, "softmax over the queries (dim=-2)")
def cross_softmax_over_queries(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths, dim=-2)


@wrong(C7, "the padding of the encoder is ignored")
def cross_no_mask(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, None)


@wrong(C7, "the mask is inverted")
def cross_inverted_mask(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if enc_lengths is not None:
        real = torch.arange(x_enc.shape[1]) < enc_lengths[:, None]
        scores = scores.masked_fill(real[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # NaN where every key is real


@wrong(C7, "off by one in the padding")
def cross_mask_off_by_one(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    return _cross(x_dec, x_enc, w_q, w_k, w_v, enc_lengths,
                  keep=lambda S, n: torch.arange(S) <= n[:, None])


@wrong(C7, "the padding mask is (B, 1, S), over the keys")
def cross_mask_on_queries(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if enc_lengths is not None:
        real = torch.arange(x_enc.shape[1]) < enc_lengths[:, None]  # (B, S)
        scores = scores.masked_fill(~real[:, :, None], float("-inf"))  # (B, S, 1): wrong
    return softmax(scores) @ v


@wrong(C7, "the mask is applied to the weights after the softmax")
def cross_mask_after_softmax(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    weights = softmax((x_dec @ w_q) @ (x_enc @ w_k).mT / math.sqrt(w_q.shape[-1]))
    if enc_lengths is not None:
        weights = weights * (torch.arange(x_enc.shape[1]) < enc_lengths[:, None])[:, None, :]
    return weights @ (x_enc @ w_v)


@wrong(C7, "NaN or inf in the output; exp of a large score overflows")
def cross_naive_exp(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    exp = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    if enc_lengths is not None:
        exp = exp * (torch.arange(x_enc.shape[1]) < enc_lengths[:, None])[:, None, :]
    return exp / exp.sum(-1, keepdim=True) @ v


@shortcut(C7, "attention.scaled_dot_product_attention")
def cross_module_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    mask = None
    if enc_lengths is not None:
        mask = padding_mask(enc_lengths, x_enc.shape[1])[:, None, :]  # (B, 1, S)
    return scaled_dot_product_attention(x_dec @ w_q, x_enc @ w_k, x_enc @ w_v,
                                        attn_mask=mask)[0]


@shortcut(C7, "torch.nn.functional.scaled_dot_product_attention")
def cross_torch_attention(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    mask = None
    if enc_lengths is not None:
        mask = padding_mask(enc_lengths, x_enc.shape[1])[:, None, :]  # (B, 1, S)
    return F.scaled_dot_product_attention(x_dec @ w_q, x_enc @ w_k, x_enc @ w_v,
                                          attn_mask=mask)


def _one_wide_head(x_dec, x_enc, w_q, w_k, w_v):
    """A one-head attention module's width m and weights that compute cross-attention: x_dec
    padded with zero features to width m, every projection written into the top-left corner
    of an m-wide one, the queries multiplied by sqrt(m / d_k) to undo the module's scale."""
    d_dec, (d_enc, d_k), d_v = x_dec.shape[-1], w_k.shape, w_v.shape[-1]
    m = d_dec + d_k + d_v + d_enc  # not d_enc: PyTorch's module then keeps separate weights
    q_w, k_w, v_w = torch.zeros(m, m), torch.zeros(m, d_enc), torch.zeros(m, d_enc)
    q_w[:d_k, :d_dec] = w_q.T * math.sqrt(m / d_k)
    k_w[:d_k] = w_k.T
    v_w[:d_v] = w_v.T
    return m, F.pad(x_dec, (0, m - d_dec)), (q_w, k_w, v_w, torch.eye(m))


@shortcut(C7, "attention.MultiHeadAttention")
def cross_module_mha(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    m, query, weights = _one_wide_head(x_dec, x_enc, w_q, w_k, w_v)
    mha = attention.MultiHeadAttention(m, 1, bias=False, kdim=x_enc.shape[-1],
                                       vdim=x_enc.shape[-1])
    mask = None
    if enc_lengths is not None:
        mask = padding_mask(enc_lengths, x_enc.shape[1])[:, None, None, :]  # (B, 1, 1, S)
    with torch.no_grad():
        for linear, w in zip((mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj), weights):
            linear.weight.copy_(w)
        return mha(query, x_enc, x_enc, attn_mask=mask)[0][..., :w_v.shape[-1]]


@shortcut(C7, "torch.nn.MultiheadAttention")
def cross_torch_mha(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    m, query, (q_w, k_w, v_w, out_w) = _one_wide_head(x_dec, x_enc, w_q, w_k, w_v)
    mha = torch.nn.MultiheadAttention(m, 1, bias=False, batch_first=True,
                                      kdim=x_enc.shape[-1], vdim=x_enc.shape[-1])
    pad = None
    if enc_lengths is not None:
        pad = torch.arange(x_enc.shape[1]) >= enc_lengths[:, None]  # True = padding
    with torch.no_grad():
        mha.q_proj_weight.copy_(q_w)
        mha.k_proj_weight.copy_(k_w)
        mha.v_proj_weight.copy_(v_w)
        mha.out_proj.weight.copy_(out_w)
        return mha(query, x_enc, x_enc, key_padding_mask=pad)[0][..., :w_v.shape[-1]]


@right(C7)
def cross_einsum_float64(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q = torch.einsum("bld,dk->blk", x_dec.double(), w_q.double())
    k = torch.einsum("bsd,dk->bsk", x_enc.double(), w_k.double())
    v = torch.einsum("bsd,dv->bsv", x_enc.double(), w_v.double())
    scores = torch.einsum("blk,bsk->bls", q / math.sqrt(k.shape[-1]), k)
    if enc_lengths is not None:
        pad = torch.arange(x_enc.shape[1]) >= enc_lengths[:, None]
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0).matmul(v).float()


@right(C7)
def cross_scale_after(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    scores = (x_dec @ w_q) @ (x_enc @ w_k).mT / w_q.shape[-1] ** 0.5
    if enc_lengths is not None:
        mask = padding_mask(enc_lengths, x_enc.shape[1])[:, None, :]
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores) @ (x_enc @ w_v)


@right(C7)
def cross_broadcast_sums(x_dec, x_enc, w_q, w_k, w_v, enc_lengths=None):
    q, k, v = x_dec @ w_q, x_enc @ w_k, x_enc @ w_v
    scores = (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1) / math.sqrt(q.shape[-1])  # (B, L, S)
    if enc_lengths is not None:
        pad = torch.arange(k.shape[1]) >= enc_lengths[:, None, None]  # (B, 1, S)
        scores = scores.masked_fill(pad, float("-inf"))
    return (softmax(scores).unsqueeze(-1) * v.unsqueeze(1)).sum(2)



# --- chapter 8: check_rope_interleaved(fn), fn(x, positions) -> rotated x --------------------

C8 = "check_rope_interleaved"


def _angles(x, positions, exponent=2.0, sign=1.0):
    """(..., L, d/2) angles sign * p * 10000**(-exponent*i/d), in float64."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    freq = 10000.0 ** (-exponent * i / d)
    return sign * positions.to(torch.float64)[..., None] * freq


def _pairs(x, angles, swap=False, layout="interleaved"):
    """Rotate the pairs of x by angles, with one thing changed, for the wrong answers: in
    float32 or wider, returned in x's dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(wide), angles.sin().to(wide)
    if swap:
        cos, sin = sin, cos
    x_wide = x.to(wide)
    if layout == "interleaved":
        a, b = x_wide[..., 0::2], x_wide[..., 1::2]
        out = torch.empty_like(x_wide)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out.to(x.dtype)
    h = x.shape[-1] // 2
    a, b = x_wide[..., :h], x_wide[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


@wrong(C8, "positions (")
def rope_documented_positions_only(x, positions):
    """Right for the two shapes of positions the statement shows, (L,) and (B, 1, L): a
    position tensor of rank 2 is taken for (B, 1, L) without its middle axis."""
    if positions.dim() == 2:
        positions = positions[:, 0, None]  # meant for (B, L) read as rows of (B, 1, L)
    return _pairs(x, _angles(x, positions))


@wrong(C8, "the half-split layout")
def rope_half_split(x, positions):
    return _pairs(x, _angles(x, positions), layout="half")


@wrong(C8, "the frequencies are 10000**(-i/d)")
def rope_freq_i_over_d(x, positions):
    return _pairs(x, _angles(x, positions, exponent=1.0))


@wrong(C8, "cos and sin are swapped")
def rope_sin_cos_swapped(x, positions):
    return _pairs(x, _angles(x, positions), swap=True)


@wrong(C8, "the rotation goes the wrong way")
def rope_clockwise(x, positions):
    return _pairs(x, _angles(x, positions, sign=-1.0))


@wrong(C8, "the positions given are ignored")
def rope_ignores_positions(x, positions):
    return _pairs(x, _angles(x, torch.arange(x.shape[-2])))


@wrong(C8, "compute the angles p * frequency in float64")
def rope_angles_in_x_dtype(x, positions):
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions.to(x.dtype)[..., None] * freq  # in bfloat16, 301 becomes 300
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * angles.cos() - b * angles.sin(),
                        b * angles.cos() + a * angles.sin()], dim=-1).flatten(-2)


@right(C8)
def rope_meta_float32(x, positions):
    """Meta's reference code: frequencies and angles in float32, pairs as complex numbers."""
    d = x.shape[-1]
    freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[..., None].float() * freq  # (..., L, d/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


@wrong(C8, "the result must keep x's dtype")
def rope_returns_float64(x, positions):
    x = x.double()
    return _pairs(x, _angles(x, positions))


@wrong(C8, "expected the shape of x", earns="nothing")
def rope_flattens_pairs(x, positions):
    out = _pairs(x, _angles(x, positions))
    return out.reshape(*out.shape[:-1], -1, 2)  # (..., L, d/2, 2): pairs left unflattened


@shortcut(C8, "position.rotary_embedding")
def rope_through_the_module(x, positions):
    from position import interleaved_to_half_split, rotary_embedding
    perm = interleaved_to_half_split(x.shape[-1])
    out = torch.empty_like(x)
    out[..., perm] = rotary_embedding(x[..., perm], positions)
    return out


@right(C8)
def rope_complex(x, positions):
    """Meta's Llama style: pairs as complex numbers, times e^(i angle)."""
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[..., None] * freq  # (..., L, d/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    out = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles))
    return out.reshape(x.shape).to(x.dtype)


@right(C8)
def rope_matrix(x, positions):
    """A block-diagonal rotation matrix per position, applied to row vectors."""
    d = x.shape[-1]
    angles = _angles(x, positions)  # (..., L, d/2)
    c, s = angles.cos(), angles.sin()
    R = torch.zeros(*angles.shape[:-1], d, d, dtype=x.dtype)
    for i in range(d // 2):
        R[..., 2 * i, 2 * i], R[..., 2 * i, 2 * i + 1] = c[..., i], s[..., i]
        R[..., 2 * i + 1, 2 * i], R[..., 2 * i + 1, 2 * i + 1] = -s[..., i], c[..., i]
    return (x[..., None, :] @ R)[..., 0, :]  # row vector times R


# --- chapter 9: check_cached_attention(fn), fn(k_cache, v_cache, q, k, v) -> (y, k, v) ----

C9 = "check_cached_attention"


def _masked_attention(q, keys, values, sees, scale=None):
    """Attention of q (B, n, d_k) over keys (B, S, d_k), values (B, S, d_v) with a boolean
    (n, S) mask, by tensor operations: for the wrong answers that make another mistake."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ keys.transpose(-2, -1) * scale).masked_fill(~sees, float("-inf"))
    return softmax(scores, dim=-1) @ values


def _appended(k_cache, v_cache, q, k, v):
    """The caches with the new keys and values appended (dim 1), and the bottom-right (n, S + n)
    causal mask of the new queries: the right first steps, for the answers that go wrong later."""
    S, n = k_cache.shape[1], q.shape[1]
    keys, values = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    return keys, values, torch.ones(n, S + n, dtype=torch.bool).tril(diagonal=S)


@wrong(C9, "aligned to the top left")
def cached_top_left(k_cache, v_cache, q, k, v):
    n = q.shape[1]
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    sees = torch.ones(n, k_cache.shape[1], dtype=torch.bool).tril()  # top left
    return _masked_attention(q, k_cache, v_cache, sees), k_cache, v_cache


@wrong(C9, "a new token does not see its own key")
def cached_attend_then_append(k_cache, v_cache, q, k, v):
    scores = q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1])
    y = torch.softmax(scores, dim=-1) @ v_cache
    return y, torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)


@wrong(C9, "a new token does not see its own key")
def cached_tril_off_by_one(k_cache, v_cache, q, k, v):
    S, n = k_cache.shape[1], q.shape[1]
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    sees = torch.ones(n, S + n, dtype=torch.bool).tril(diagonal=S - 1)
    return _masked_attention(q, k_cache, v_cache, sees), k_cache, v_cache


@wrong(C9, "no causal mask among the new tokens")
def cached_no_mask(k_cache, v_cache, q, k, v):
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    scores = q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v_cache, k_cache, v_cache


@wrong(C9, "not divided by sqrt(d_k)")
def cached_no_scale(k_cache, v_cache, q, k, v):
    k_cache, v_cache, sees = _appended(k_cache, v_cache, q, k, v)
    return _masked_attention(q, k_cache, v_cache, sees, scale=1.0), k_cache, v_cache


@wrong(C9, "divided by sqrt(d_v)")
def cached_scale_d_v(k_cache, v_cache, q, k, v):
    k_cache, v_cache, sees = _appended(k_cache, v_cache, q, k, v)
    return (_masked_attention(q, k_cache, v_cache, sees, scale=v.shape[-1] ** -0.5),
            k_cache, v_cache)


@wrong(C9, "the new rows first")
def cached_prepend(k_cache, v_cache, q, k, v):
    keys, values, sees = _appended(k_cache, v_cache, q, k, v)
    y = _masked_attention(q, keys, values, sees)
    return y, torch.cat([k, k_cache], 1), torch.cat([v, v_cache], 1)  # new rows first


@wrong(C9, "the old cache")
def cached_returns_old_cache(k_cache, v_cache, q, k, v):
    keys, values, sees = _appended(k_cache, v_cache, q, k, v)
    return _masked_attention(q, keys, values, sees), k_cache, v_cache


@wrong(C9, "append along the sequence axis, dim 1", earns="nothing")  # cat raises
def cached_cat_batch_axis(k_cache, v_cache, q, k, v):
    keys, values, sees = _appended(k_cache, v_cache, q, k, v)
    y = _masked_attention(q, keys, values, sees)
    return y, torch.cat([k_cache, k], 0), torch.cat([v_cache, v], 0)  # along the batch


@wrong(C9, "one output row per new token")
def cached_last_row_only(k_cache, v_cache, q, k, v):
    S, n = k_cache.shape[1], q.shape[1]
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    scores = q[:, -1:] @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v_cache, k_cache, v_cache  # (B, 1, d_v)


@shortcut(C9, "attention.scaled_dot_product_attention")
def cached_module_sdpa(k_cache, v_cache, q, k, v):
    k_cache, v_cache, sees = _appended(k_cache, v_cache, q, k, v)
    return scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=sees)[0], k_cache, v_cache


@shortcut(C9, "torch.nn.functional.scaled_dot_product_attention")
def cached_torch_sdpa(k_cache, v_cache, q, k, v):
    k_cache, v_cache, sees = _appended(k_cache, v_cache, q, k, v)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=sees), k_cache, v_cache


@shortcut(C9, "torch.nn.attention.bias.causal_lower_right")
def cached_lower_right(k_cache, v_cache, q, k, v):
    from torch.nn.attention.bias import causal_lower_right
    S, n = k_cache.shape[1], q.shape[1]
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    sees = causal_lower_right(n, S + n)._materialize()
    return _masked_attention(q, k_cache, v_cache, sees), k_cache, v_cache


@shortcut(C9, "attention.KVCache")
def cached_module_cache(k_cache, v_cache, q, k, v):
    cache = attention.KVCache()
    if k_cache.shape[1]:
        cache.update(k_cache[:, None], v_cache[:, None])
    keys, values, sees = cache.update(k[:, None], v[:, None], is_causal=True)
    keys, values = keys[:, 0], values[:, 0]
    return _masked_attention(q, keys, values, sees), keys, values


@right(C9)
def cached_float64_loops(k_cache, v_cache, q, k, v):
    S, n = k_cache.shape[1], q.shape[1]
    keys = torch.cat([k_cache, k], 1).double()
    values = torch.cat([v_cache, v], 1).double()
    rows = []
    for r in range(n):  # query r is position S + r and sees keys 0..S + r
        z = q[:, r:r + 1].double() @ keys[:, :S + r + 1].mT / math.sqrt(q.shape[-1])
        rows.append(torch.softmax(z, -1) @ values[:, :S + r + 1])
    return torch.cat(rows, 1).float(), keys.float(), values.float()


@right(C9)
def cached_additive_mask(k_cache, v_cache, q, k, v):
    S, n = k_cache.shape[1], q.shape[1]
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    j, r = torch.arange(S + n), torch.arange(n)[:, None]
    bias = torch.zeros(n, S + n).masked_fill(j > S + r, float("-inf"))
    scores = torch.einsum("bnd,bsd->bns", q, k_cache) / q.shape[-1] ** 0.5 + bias
    return softmax(scores) @ v_cache, k_cache, v_cache


# --- chapter 10: check_merge_partials(fn), fn(m1, ell1, y1, m2, ell2, y2) -> (m, ell, y) ----

C10 = "check_merge_partials"


def _factors(m1, m2):
    """The new maximum, and exp(m1 - m), exp(m2 - m) with 0 where a block is empty."""
    m = torch.maximum(m1, m2)
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    return m, torch.exp(m1 - shift), torch.exp(m2 - shift)


@wrong(C10, "added without rescaling")
def merge_no_rescale(m1, ell1, y1, m2, ell2, y2):
    return torch.maximum(m1, m2), ell1 + ell2, y1 + y2


@wrong(C10, "ell is rescaled but y is not")
def merge_forgets_y(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    return m, f1 * ell1 + f2 * ell2, y1 + y2


@wrong(C10, "the inverse of the right factor")
def merge_inverted_factor(m1, ell1, y1, m2, ell2, y2):
    m = torch.maximum(m1, m2)
    f1, f2 = torch.exp(m - m1), torch.exp(m - m2)  # new minus old: the wrong way round
    return m, f1 * ell1 + f2 * ell2, f1[..., None] * y1 + f2[..., None] * y2


@wrong(C10, "rescaled to the second block's maximum m2")
def merge_to_m2(m1, ell1, y1, m2, ell2, y2):
    f = torch.exp(m1 - m2)  # as if the new block always raised the maximum
    return torch.maximum(m1, m2), f * ell1 + ell2, f[..., None] * y1 + y2


@wrong(C10, "only the first block's sum is rescaled")
def merge_rescales_old_only(m1, ell1, y1, m2, ell2, y2):
    m, f1, _ = _factors(m1, m2)
    return m, f1 * ell1 + ell2, f1[..., None] * y1 + y2


@wrong(C10, "y is divided by ell")
def merge_normalises(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    ell = f1 * ell1 + f2 * ell2
    return m, ell, (f1[..., None] * y1 + f2[..., None] * y2) / ell[..., None]


@wrong(C10, "the two rescaled outputs are averaged")
def merge_averages(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    return m, f1 * ell1 + f2 * ell2, (f1[..., None] * y1 + f2[..., None] * y2) / 2


@wrong(C10, "m is the second block's maximum m2")
def merge_keeps_new_max(m1, ell1, y1, m2, ell2, y2):
    _, f1, f2 = _factors(m1, m2)
    return m2, f1 * ell1 + f2 * ell2, f1[..., None] * y1 + f2[..., None] * y2


@wrong(C10, "NaN in rows")
def merge_nan_when_empty(m1, ell1, y1, m2, ell2, y2):
    m = torch.maximum(m1, m2)
    f1, f2 = torch.exp(m1 - m), torch.exp(m2 - m)  # NaN where both maxima are -inf
    return m, f1 * ell1 + f2 * ell2, f1[..., None] * y1 + f2[..., None] * y2


@wrong(C10, "Only differences of scores may be exponentiated")
def merge_unshifted(m1, ell1, y1, m2, ell2, y2):
    e1, e2 = torch.exp(m1), torch.exp(m2)  # back to exp(score): overflows
    m = torch.maximum(m1, m2)
    em = torch.exp(m)
    safe = torch.where(em > 0, em, torch.ones_like(em))
    return (m, (e1 * ell1 + e2 * ell2) / safe,
            (e1[..., None] * y1 + e2[..., None] * y2) / safe[..., None])


@wrong(C10, "index it as factor[..., None]", earns="nothing")
def merge_broadcasts_wrong_axis(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    return m, f1 * ell1 + f2 * ell2, f1 * y1 + f2 * y2  # (..., L) against (..., L, Ev)


@shortcut(C10, "torch.logaddexp")
def merge_logaddexp(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    lse = torch.logaddexp(m1 + torch.log(ell1), m2 + torch.log(ell2))
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    return m, torch.exp(lse - shift), f1[..., None] * y1 + f2[..., None] * y2


@shortcut(C10, "torch.logsumexp")
def merge_logsumexp(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    lse = torch.logsumexp(torch.stack([m1 + torch.log(ell1), m2 + torch.log(ell2)]), dim=0)
    shift = torch.where(m.isfinite(), m, torch.zeros_like(m))
    return m, torch.exp(lse - shift), f1[..., None] * y1 + f2[..., None] * y2


@shortcut(C10, "torch.softmax")
def merge_softmax(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    ell = f1 * ell1 + f2 * ell2
    lse = torch.stack([m1 + torch.log(ell1), m2 + torch.log(ell2)], dim=-1)  # (..., L, 2)
    w = torch.softmax(lse, dim=-1).nan_to_num(0.0)  # each block's share of the row
    y = (w[..., :1] * y1 / torch.where(ell1 > 0, ell1, 1.0)[..., None]
         + w[..., 1:] * y2 / torch.where(ell2 > 0, ell2, 1.0)[..., None])
    return m, ell, y * ell[..., None]


@shortcut(C10, "attention.softmax")
def merge_module_softmax(m1, ell1, y1, m2, ell2, y2):
    m, f1, f2 = _factors(m1, m2)
    ell = f1 * ell1 + f2 * ell2
    lse = torch.stack([m1 + torch.log(ell1), m2 + torch.log(ell2)], dim=-1)
    w = attention.softmax(lse, dim=-1)
    y = (w[..., :1] * y1 / torch.where(ell1 > 0, ell1, 1.0)[..., None]
         + w[..., 1:] * y2 / torch.where(ell2 > 0, ell2, 1.0)[..., None])
    return m, ell, y * ell[..., None]


@right(C10)
def merge_reference(m1, ell1, y1, m2, ell2, y2):
    m = torch.maximum(m1, m2)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    f1, f2 = torch.exp(m1 - shift), torch.exp(m2 - shift)
    return m, f1 * ell1 + f2 * ell2, f1[..., None] * y1 + f2[..., None] * y2


@right(C10)
def merge_in_float32(m1, ell1, y1, m2, ell2, y2):
    """Right to float32's precision: the statement asks for no dtype."""
    m, ell, y = merge_reference(m1.float(), ell1.float(), y1.float(), m2.float(), ell2.float(),
                                y2.float())
    return m.to(m1.dtype), ell.to(ell1.dtype), y.to(y1.dtype)


@right(C10)
def merge_by_cases(m1, ell1, y1, m2, ell2, y2):
    """Rescale only the block with the smaller maximum (the other's factor is exactly 1)."""
    first_larger = m1 >= m2
    big = torch.where(first_larger, m1, m2)
    small = torch.where(first_larger, m2, m1)
    factor = torch.where(small == float("-inf"), torch.zeros_like(big),
                         torch.exp(small - torch.where(big.isfinite(), big, 0.0)))
    ell_big, ell_small = torch.where(first_larger, ell1, ell2), torch.where(first_larger, ell2, ell1)
    keep = first_larger[..., None]
    y_big, y_small = torch.where(keep, y1, y2), torch.where(keep, y2, y1)
    return big, ell_big + factor * ell_small, y_big + factor[..., None] * y_small


# --- chapter 11: check_layer_norm(fn) ------------------------------------------------------

C11 = "check_layer_norm"


def _ln(x, gain, shift, eps, var=None, centre=True, inside=True):
    """A layer norm over the last axis with one thing changed, for the wrong answers."""
    mean = x.mean(-1, keepdim=True) if centre else torch.zeros_like(x[..., :1])
    var = ((x - mean) ** 2).mean(-1, keepdim=True) if var is None else var
    spread = torch.sqrt(var + eps) if inside else torch.sqrt(var) + eps
    return (x - mean) / spread * gain + shift


@wrong(C11, "the variance divides by D - 1")
def ln_unbiased(x, gain, shift, eps=1e-5):
    return _ln(x, gain, shift, eps, var=x.var(-1, keepdim=True))


@wrong(C11, "eps is added to the standard deviation")
def ln_eps_outside(x, gain, shift, eps=1e-5):
    return _ln(x, gain, shift, eps, inside=False)


@wrong(C11, "the mean is not subtracted (that is RMSNorm")
def ln_rms(x, gain, shift, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain + shift


@wrong(C11, "gain and shift are not applied")
def ln_no_affine(x, gain, shift, eps=1e-5):
    return _ln(x, torch.ones_like(gain), torch.zeros_like(shift), eps)


@wrong(C11, "gain and shift are swapped")
def ln_swapped_affine(x, gain, shift, eps=1e-5):
    return _ln(x, shift, gain, eps)


@wrong(C11, "normalised over the first axis (the batch)")
def ln_over_batch(x, gain, shift, eps=1e-5):
    mean = x.mean(0, keepdim=True)
    var = ((x - mean) ** 2).mean(0, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gain + shift


@wrong(C11, "normalised over every entry at once")
def ln_over_everything(x, gain, shift, eps=1e-5):
    mean = x.mean()
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean() + eps) * gain + shift


@wrong(C11, "cancel in float32")
def ln_naive_variance(x, gain, shift, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    return _ln(x, gain, shift, eps, var=x.pow(2).mean(-1, keepdim=True) - mean ** 2)


@wrong(C11, "the eps argument is ignored")
def ln_fixed_eps(x, gain, shift, eps=1e-5):
    return _ln(x, gain, shift, 1e-5)


@wrong(C11, "divided by the variance")
def ln_divides_by_variance(x, gain, shift, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / (((x - mean) ** 2).mean(-1, keepdim=True) + eps) * gain + shift


@shortcut(C11, "torch.nn.functional.layer_norm")
def ln_functional(x, gain, shift, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], gain, shift, eps)


@shortcut(C11, "torch.nn.LayerNorm")
def ln_module(x, gain, shift, eps=1e-5):
    norm = torch.nn.LayerNorm(x.shape[-1], eps=eps, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(gain)
        norm.bias.copy_(shift)
    return norm(x)


@shortcut(C11, "torch.nn.functional.group_norm")
def ln_group_norm(x, gain, shift, eps=1e-5):
    """GroupNorm with one group over (N, C = D): a layer norm of each row."""
    rows = x.reshape(-1, 1, x.shape[-1])  # (N, 1 channel, D)
    out = F.group_norm(rows, 1, eps=eps).reshape(x.shape)
    return out * gain + shift


@shortcut(C11, "torch.nn.functional.batch_norm")
def ln_batch_norm(x, gain, shift, eps=1e-5):
    """Batch norm of the transposed rows: every position is a channel."""
    rows = x.reshape(-1, x.shape[-1])  # (N, D)
    out = F.batch_norm(rows.T, None, None, training=True, eps=eps).T
    return out.reshape(x.shape) * gain + shift


@shortcut(C11, "transformer.TransformerBlock")
def ln_from_the_block(x, gain, shift, eps=1e-5):
    """A post-LN block of the book with its branches zeroed: LN2(LN1(x)), nearly LN(x)."""
    D = x.shape[-1]
    block = transformer.TransformerBlock(D, 1, 1, norm_first=False, layer_norm_eps=eps,
                                         dtype=x.dtype)
    with torch.no_grad():
        for p in (*block.self_attn.parameters(), *block.linear1.parameters(),
                  *block.linear2.parameters()):
            p.zero_()
        block.norm2.weight.copy_(gain)
        block.norm2.bias.copy_(shift)
        return block(x.reshape(-1, 1, D)).reshape(x.shape)


@right(C11)
def ln_var_mean(x, gain, shift, eps=1e-5):
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + eps) * gain + shift


@right(C11)
def ln_float64_std(x, gain, shift, eps=1e-5):
    x64 = x.double()
    centred = x64 - x64.mean(-1, keepdim=True)
    return (centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * gain.double()
            + shift.double()).to(x.dtype)


@right(C11)
def ln_einsum(x, gain, shift, eps=1e-5):
    D = x.shape[-1]
    centring = torch.eye(D, dtype=x.dtype) - 1.0 / D  # I - 11^T / D
    centred = x @ centring
    var = torch.einsum("...d,...d->...", centred, centred)[..., None] / D
    return centred / torch.sqrt(var + eps) * gain + shift


# --- chapter 11: check_block(pre_ln_block, post_ln_block) ---------------------------------------

C11b = "check_block"


def _mlp(h, block, act=None):
    act = act or (F.relu if block.activation == "relu" else F.gelu)
    return block.linear2(act(block.linear1(h)))


def _attend(h, block, attn_mask, is_causal):
    return block.self_attn(h, h, h, attn_mask=attn_mask, is_causal=is_causal)[0]


def _pre(x, block, attn_mask=None, is_causal=False, act=None, norm2=None, residual=True):
    h = block.norm1(x)
    u = (x if residual else 0) + _attend(h, block, attn_mask, is_causal)
    return u + _mlp((norm2 or block.norm2)(u), block, act)


def _post(x, block, attn_mask=None, is_causal=False):
    u = block.norm1(x + _attend(x, block, attn_mask, is_causal))
    return block.norm2(u + _mlp(u, block))


@wrong(C11b, "this is the post-LN order", replaces="pre_ln_block")
def block_pre_in_post_order(x, block, *, attn_mask=None, is_causal=False):
    return _post(x, block, attn_mask, is_causal)


@wrong(C11b, "this is the pre-LN order", replaces="post_ln_block")
def block_post_in_pre_order(x, block, *, attn_mask=None, is_causal=False):
    return _pre(x, block, attn_mask, is_causal)


@wrong(C11b, "the mask is ignored", replaces="pre_ln_block")
def block_mask_ignored(x, block, *, attn_mask=None, is_causal=False):
    return _pre(x, block)


@wrong(C11b, "differs from the pre-LN block", replaces="pre_ln_block")
def block_no_attention_residual(x, block, *, attn_mask=None, is_causal=False):
    return _pre(x, block, attn_mask, is_causal, residual=False)


@wrong(C11b, "differs from the pre-LN block", replaces="pre_ln_block")
def block_relu_always(x, block, *, attn_mask=None, is_causal=False):
    return _pre(x, block, attn_mask, is_causal, act=F.relu)


@wrong(C11b, "differs from the pre-LN block", replaces="pre_ln_block")
def block_one_norm_twice(x, block, *, attn_mask=None, is_causal=False):
    return _pre(x, block, attn_mask, is_causal, norm2=block.norm1)


@wrong(C11b, "no gradient reaches block.linear1", replaces="pre_ln_block")
def block_mlp_detached(x, block, *, attn_mask=None, is_causal=False):
    h = block.norm1(x)
    u = x + _attend(h, block, attn_mask, is_causal)
    hidden = F.linear(block.norm2(u), block.linear1.weight.detach(), block.linear1.bias.detach())
    act = F.relu if block.activation == "relu" else F.gelu
    return u + block.linear2(act(hidden))


@shortcut(C11b, "transformer.TransformerBlock.forward", replaces="pre_ln_block")
def block_its_own_forward(x, block, *, attn_mask=None, is_causal=False):
    return block(x, attn_mask=attn_mask, is_causal=is_causal)


@shortcut(C11b, "torch.nn.TransformerEncoderLayer", replaces="post_ln_block")
def block_as_torch_layer(x, block, *, attn_mask=None, is_causal=False):
    """The block's weights in PyTorch's encoder layer (post-LN, batch first)."""
    attn = block.self_attn
    layer = torch.nn.TransformerEncoderLayer(
        block.d_model, block.num_heads, block.d_ff, dropout=0.0, activation=block.activation,
        batch_first=True, norm_first=False)
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                        attn.v_proj.weight]))
        layer.self_attn.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                                      attn.v_proj.bias]))
        for mine, theirs in ((attn.out_proj, layer.self_attn.out_proj),
                             (block.linear1, layer.linear1), (block.linear2, layer.linear2),
                             (block.norm1, layer.norm1), (block.norm2, layer.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    layer.train(block.training)
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1) if is_causal else None
    padding = None if attn_mask is None else ~attn_mask[:, 0, 0, :]
    return layer(x, src_mask=causal, src_key_padding_mask=padding, is_causal=is_causal)


@shortcut(C11b, "transformer.DecoderLM", replaces="pre_ln_block")
def block_through_a_decoder(x, block, *, attn_mask=None, is_causal=False):
    """A one-block DecoderLM holding the given block, its block run as the model runs it."""
    model = transformer.DecoderLM(2, x.shape[1], block.d_model, block.num_heads, block.d_ff, 1,
                                  activation=block.activation)
    model.blocks[0] = block
    return _pre(x, model.blocks[0], attn_mask, is_causal)


@right(C11b, replaces="pre_ln_block")
def block_pre_by_hand_linear(x, block, *, attn_mask=None, is_causal=False):
    """The norms and the MLP written out from the weights."""
    def norm(h, ln):
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        return (h - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias
    h = norm(x, block.norm1)
    u = x + _attend(h, block, attn_mask, is_causal)
    hidden = norm(u, block.norm2) @ block.linear1.weight.T + block.linear1.bias
    act = torch.relu(hidden) if block.activation == "relu" else F.gelu(hidden)
    return u + act @ block.linear2.weight.T + block.linear2.bias


@right(C11b, replaces="post_ln_block")
def block_post_in_two_steps(x, block, *, attn_mask=None, is_causal=False):
    attended, _ = block.self_attn(x, x, x, attn_mask=attn_mask, is_causal=is_causal)
    u = block.norm1(x + attended)
    v = u + _mlp(u, block)
    return block.norm2(v)


# --- chapter 12: check_induction_score(fn), fn(weights, first, second, length) -> (H,) ------

C12 = "check_induction_score"


def _copy_pairs(first, second, length, start=0, stop=-1):
    """(sequence, query) index tensors of the positions second + start .. second + length - 1
    + stop of every sequence: start=0, stop=-1 are the copyable ones."""
    i = torch.arange(int((second + length).max()) + 1)
    mask = (i >= (second + start)[:, None]) & (i < (second + length + stop)[:, None])
    return mask.nonzero(as_tuple=True)


def _ind_mean_at(weights, b, query, key):
    return weights[b, :, query, key].mean(dim=0)


@wrong(C12, "the pattern of a duplicate-token head")
def ind_duplicate_token(weights, first, second, length):
    b, query = _copy_pairs(first, second, length)
    return _ind_mean_at(weights, b, query, query - (second - first)[b])


@wrong(C12, "the key is one position too far")
def ind_two_after(weights, first, second, length):
    b, query = _copy_pairs(first, second, length)
    return _ind_mean_at(weights, b, query, query - (second - first)[b] + 2)


@wrong(C12, "the last position of the second copy is counted")
def ind_whole_second_copy(weights, first, second, length):
    b, query = _copy_pairs(first, second, length, stop=0)
    return _ind_mean_at(weights, b, query, query - (second - first)[b] + 1)


@wrong(C12, "the queries are shifted by one")
def ind_target_positions(weights, first, second, length):
    b, query = _copy_pairs(first, second, length, start=1, stop=0)
    return _ind_mean_at(weights, b, query, query - (second - first)[b] + 1)


@wrong(C12, "the weights are read as [key, query]")
def ind_transposed(weights, first, second, length):
    b, query = _copy_pairs(first, second, length)
    key = query - (second - first)[b] + 1
    return weights[b, :, key, query].mean(dim=0)


@wrong(C12, "each sequence is averaged first")
def ind_mean_of_means(weights, first, second, length):
    means = []
    for s in range(weights.shape[0]):
        queries = torch.arange(int(second[s]), int(second[s] + length[s] - 1))
        keys = queries - int(second[s] - first[s]) + 1
        means.append(weights[s, :, queries, keys].mean(dim=-1))
    return torch.stack(means).mean(dim=0)


@wrong(C12, "the heads are averaged together")
def ind_heads_pooled(weights, first, second, length):
    b, query = _copy_pairs(first, second, length)
    score = _ind_mean_at(weights, b, query, query - (second - first)[b] + 1)
    return score.mean().expand(weights.shape[1])


@wrong(C12, "summed, not averaged")
def ind_summed(weights, first, second, length):
    b, query = _copy_pairs(first, second, length)
    return weights[b, :, query, query - (second - first)[b] + 1].sum(dim=0)


@shortcut(C12, "induction.induction_score")
def ind_module(weights, first, second, length):
    return induction.induction_score(weights, first, second, length)


@shortcut(C12, "induction.Batch.copyable")
def ind_module_mask(weights, first, second, length):
    """The module's mask of copyable positions, from a Batch built around the positions."""
    tokens = torch.zeros(weights.shape[0], weights.shape[-1] + 1, dtype=torch.long)
    copyable = induction.Batch(tokens, first, second, length).copyable()  # (B, T)
    b, query = copyable.nonzero(as_tuple=True)
    return _ind_mean_at(weights, b, query, query - (second - first)[b] + 1)


@right(C12)
def ind_loops(weights, first, second, length):
    total, count = torch.zeros(weights.shape[1], dtype=weights.dtype), 0
    for s in range(weights.shape[0]):
        offset = int(second[s] - first[s])
        for i in range(int(second[s]), int(second[s] + length[s] - 1)):
            total = total + weights[s, :, i, i - offset + 1]
            count += 1
    return total / count


@right(C12)
def ind_gather(weights, first, second, length):
    """Shift every row by the copies' offset with gather, then average under a mask."""
    B, H, T, _ = weights.shape
    i = torch.arange(T)
    key = (i - (second - first)[:, None] + 1).clamp(min=0)  # (B, T)
    picked = weights.gather(3, key[:, None, :, None].expand(B, H, T, 1))[..., 0]  # (B, H, T)
    mask = ((i >= second[:, None]) & (i < (second + length - 1)[:, None])).to(weights.dtype)
    return (picked * mask[:, None, :]).sum(dim=(0, 2)) / mask.sum()


@right(C12)
def ind_einsum(weights, first, second, length):
    """A one-hot (B, T, T) of the (query, key) pairs, contracted with the weights."""
    T = weights.shape[-1]
    i = torch.arange(T)
    rows = (i >= second[:, None]) & (i < (second + length - 1)[:, None])  # (B, T)
    key = i - (second - first)[:, None] + 1  # (B, T)
    onehot = (i[None, None, :] == key[:, :, None]) & rows[:, :, None]  # (B, T, T)
    onehot = onehot.to(weights.dtype)
    return torch.einsum("bhij,bij->h", weights, onehot) / onehot.sum()


# --- chapter 13: check_bigram_loss(fn), fn(train, held_out, vocab_size, alpha) -> () -------

C13 = "check_bigram_loss"


def _pair_counts(train, V, transposed=False):
    """(V, V) float64: counts[a, b], how often b follows a in train (transposed: a follows b)."""
    a, b = (train[1:], train[:-1]) if transposed else (train[:-1], train[1:])
    return torch.bincount(a * V + b, minlength=V * V).view(V, V).double()


def _bigram_from(counts, held_out):
    probs = counts / counts.sum(dim=1, keepdim=True)
    return -probs[held_out[:-1], held_out[1:]].log().mean()


@wrong(C13, "the table is transposed")
def bigram_transposed(train, held_out, vocab_size, alpha):
    return _bigram_from(_pair_counts(train, vocab_size, transposed=True) + alpha, held_out)


@wrong(C13, "divided by its column's total")
def bigram_by_column(train, held_out, vocab_size, alpha):
    counts = _pair_counts(train, vocab_size) + alpha
    probs = counts / counts.sum(dim=0, keepdim=True)
    return -probs[held_out[:-1], held_out[1:]].log().mean()


@wrong(C13, "the pairs are counted in held_out")
def bigram_counted_in_held_out(train, held_out, vocab_size, alpha):
    return _bigram_from(_pair_counts(held_out, vocab_size) + alpha, held_out)


@wrong(C13, "alpha is not used")
def bigram_unsmoothed(train, held_out, vocab_size, alpha):
    return _bigram_from(_pair_counts(train, vocab_size), held_out)


@wrong(C13, "added to the count of the pair but not to the row's total")
def bigram_alpha_on_top(train, held_out, vocab_size, alpha):
    counts = _pair_counts(train, vocab_size)
    probs = (counts + alpha) / counts.sum(dim=1, keepdim=True)
    return -probs[held_out[:-1], held_out[1:]].log().mean()


@wrong(C13, "the row's total is n_a + alpha")
def bigram_alpha_once(train, held_out, vocab_size, alpha):
    counts = _pair_counts(train, vocab_size)
    probs = (counts + alpha) / (counts.sum(dim=1, keepdim=True) + alpha)
    return -probs[held_out[:-1], held_out[1:]].log().mean()


@wrong(C13, "not vocab_size: a character that never occurs still gets alpha")
def bigram_vocabulary_of_the_text(train, held_out, vocab_size, alpha):
    seen = int(torch.unique(train[:-1]).numel())
    counts = _pair_counts(train, vocab_size)
    probs = (counts + alpha) / (counts.sum(dim=1, keepdim=True) + alpha * seen)
    return -probs[held_out[:-1], held_out[1:]].log().mean()


@wrong(C13, "the loss is in bits (log2)")
def bigram_in_bits(train, held_out, vocab_size, alpha):
    return _bigram_from(_pair_counts(train, vocab_size) + alpha, held_out) / math.log(2)


@wrong(C13, "summed, not averaged")
def bigram_summed(train, held_out, vocab_size, alpha):
    return _bigram_from(_pair_counts(train, vocab_size) + alpha, held_out) * (len(held_out) - 1)


@wrong(C13, "one fewer predictions, len(held_out) - 1")
def bigram_per_character(train, held_out, vocab_size, alpha):
    loss = _bigram_from(_pair_counts(train, vocab_size) + alpha, held_out)
    return loss * (len(held_out) - 1) / len(held_out)


@wrong(C13, "NaN; with alpha = 0")
def bigram_one_hot_nan(train, held_out, vocab_size, alpha):
    """Cross-entropy as a one-hot dot product: 0 * (-inf) is NaN where a pair never occurs."""
    counts = _pair_counts(train, vocab_size) + alpha
    log_probs = (counts / counts.sum(dim=1, keepdim=True)).log()
    targets = F.one_hot(held_out[1:], vocab_size).double()
    return -(targets * log_probs[held_out[:-1]]).sum(dim=-1).mean()


@shortcut(C13, "lm.bigram_loss")
def bigram_module(train, held_out, vocab_size, alpha):
    return torch.tensor(lm.bigram_loss(train, held_out, vocab_size, alpha))


@right(C13)
def bigram_loops(train, held_out, vocab_size, alpha):
    counts = [[alpha] * vocab_size for _ in range(vocab_size)]
    for a, b in zip(train[:-1].tolist(), train[1:].tolist()):
        counts[a][b] += 1
    total = 0.0
    for a, b in zip(held_out[:-1].tolist(), held_out[1:].tolist()):
        p = counts[a][b] / sum(counts[a])
        total += -math.log(p) if p > 0 else math.inf
    return torch.tensor(total / (len(held_out) - 1), dtype=torch.float64)


@right(C13)
def bigram_index_put(train, held_out, vocab_size, alpha):
    counts = torch.full((vocab_size, vocab_size), float(alpha))
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1), accumulate=True)
    return _bigram_from(counts, held_out)


@right(C13)
def bigram_cross_entropy(train, held_out, vocab_size, alpha):
    """The rows of log-probabilities as logits of F.cross_entropy (its log_softmax leaves
    log-probabilities unchanged)."""
    log_probs = (_pair_counts(train, vocab_size) + alpha).log()
    return F.cross_entropy(log_probs[held_out[:-1]], held_out[1:])


# --- chapter 13: check_lm_logits(fn), fn(tokens, weights, num_heads) -> (B, T, n_vocab) --------

C13m = "check_lm_logits"
RULE_OF_CALL.update({"lm.build": "the module's build",
                     "lm.Config.learning_rate": "the module's Config.learning_rate",
                     "lm.train": "the module's train", "lm.sample": "the module's sample",
                     "lm.generate": "the module's generate",
                     "lm.truncated": "the module's truncated"})


def _lm_by_hand(tokens, weights, num_heads, *, causal=True, final=True, start=True,
                post=False, scaled=False, out=None):
    """The tied decoder written out from the weights, one block at a time: one matrix for W_Q,
    W_K and W_V, attention by hand. The keyword arguments give the named mistakes."""
    E, P = weights["embed.weight"], weights["position.weight"]
    (B, T), D = tokens.shape, E.shape[1]
    H, d_h = num_heads, E.shape[1] // num_heads
    rows = torch.arange(T) if start else torch.arange(len(P) - T, len(P))
    x = E[tokens] * (D ** 0.5 if scaled else 1.0) + P[rows]

    def norm(h, name):
        return F.layer_norm(h, (D,), weights[name + ".weight"], weights[name + ".bias"])

    def attend(h, p):
        w_qkv = torch.cat([weights[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])  # (3D, D)
        b_qkv = torch.cat([weights[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])
        q, k, v = (h @ w_qkv.T + b_qkv).view(B, T, 3, H, d_h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / d_h ** 0.5  # (B, H, T, T)
        if causal:
            scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, D)
        return F.linear(y, weights[p + "self_attn.out_proj.weight"],
                        weights[p + "self_attn.out_proj.bias"])

    def mlp(h, p):
        h = F.gelu(F.linear(h, weights[p + "linear1.weight"], weights[p + "linear1.bias"]))
        return F.linear(h, weights[p + "linear2.weight"], weights[p + "linear2.bias"])

    layers = sorted({int(name.split(".")[1]) for name in weights if name.startswith("blocks.")})
    for nu in layers:
        p = f"blocks.{nu}."
        if post:
            x = norm(x + attend(x, p), p + "norm1")
            x = norm(x + mlp(x, p), p + "norm2")
        else:
            x = x + attend(norm(x, p + "norm1"), p)
            x = x + mlp(norm(x, p + "norm2"), p)
    logits = (norm(x, "final_norm") if final else x) @ E.T
    return logits if out is None else out(logits, dim=-1)


@wrong(C13m, "the final layer norm is missing")
def lm_no_final_norm(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, final=False)


@wrong(C13m, "must attend causally")
def lm_not_causal(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, causal=False)


@wrong(C13m, "the model's are pre-LN")
def lm_post_ln(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, post=True)


@wrong(C13m, "the first token is at position 0")
def lm_positions_from_the_end(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, start=False)


@wrong(C13m, "multiplied by sqrt(d_model)")
def lm_scaled_embeddings(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, scaled=True)


@wrong(C13m, "these are probabilities")
def lm_probabilities(tokens, weights, num_heads):
    return _lm_by_hand(tokens, weights, num_heads, out=torch.softmax)


@shortcut(C13m, "transformer.DecoderLM")
def lm_the_books_model(tokens, weights, num_heads):
    E = weights["embed.weight"]
    layers = len({name.split(".")[1] for name in weights if name.startswith("blocks.")})
    model = transformer.DecoderLM(E.shape[0], len(weights["position.weight"]), E.shape[1],
                                  num_heads, len(weights["blocks.0.linear1.weight"]), layers,
                                  tie_weights=True, dtype=E.dtype)
    model.load_state_dict({**weights, "unembed.weight": E})
    return model(tokens)


@shortcut(C13m, "lm.build")
def lm_through_build(tokens, weights, num_heads):
    E = weights["embed.weight"]
    layers = len({name.split(".")[1] for name in weights if name.startswith("blocks.")})
    config = lm.Config(context=len(weights["position.weight"]), d_model=E.shape[1],
                       num_heads=num_heads, d_ff=len(weights["blocks.0.linear1.weight"]),
                       num_layers=layers)
    model = lm.build(config, E.shape[0]).to(E.dtype)
    model.load_state_dict({**weights, "unembed.weight": E})
    return model(tokens)


@shortcut(C13m, "torch.nn.TransformerEncoderLayer")
def lm_torch_layers(tokens, weights, num_heads):
    """Each block's weights in PyTorch's encoder layer (pre-LN, GELU, batch first)."""
    E = weights["embed.weight"]
    D, T = E.shape[1], tokens.shape[1]
    x = E[tokens] + weights["position.weight"][:T]
    nu = 0
    while f"blocks.{nu}.linear1.weight" in weights:
        p = f"blocks.{nu}."
        layer = torch.nn.TransformerEncoderLayer(
            D, num_heads, len(weights[p + "linear1.weight"]), dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True, dtype=E.dtype).eval()
        state = {"self_attn.in_proj_weight": torch.cat(
                     [weights[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]),
                 "self_attn.in_proj_bias": torch.cat(
                     [weights[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])}
        for name in ("self_attn.out_proj.weight", "self_attn.out_proj.bias", "linear1.weight",
                     "linear1.bias", "linear2.weight", "linear2.bias", "norm1.weight",
                     "norm1.bias", "norm2.weight", "norm2.bias"):
            state[name] = weights[p + name]
        layer.load_state_dict(state)
        x = layer(x, src_mask=torch.ones(T, T, dtype=torch.bool).triu(1), is_causal=True)
        nu += 1
    x = F.layer_norm(x, (D,), weights["final_norm.weight"], weights["final_norm.bias"])
    return x @ E.T


@right(C13m)
def lm_fused_by_hand(tokens, weights, num_heads):
    """No module at all: one matrix for W_Q, W_K and W_V, attention and norms by hand."""
    return _lm_by_hand(tokens, weights, num_heads)


@right(C13m)
def lm_own_module(tokens, weights, num_heads):
    """A module of the student's own, its parameters under other names (w_qkv, ln_a, ...),
    the book's weights copied in by a loader, and the output as F.linear of the embedding."""
    class Block(torch.nn.Module):
        def __init__(self, D, d_ff, dtype):
            super().__init__()
            self.ln_a = torch.nn.LayerNorm(D, dtype=dtype)
            self.ln_b = torch.nn.LayerNorm(D, dtype=dtype)
            self.w_qkv = torch.nn.Linear(D, 3 * D, dtype=dtype)
            self.w_o = torch.nn.Linear(D, D, dtype=dtype)
            self.up = torch.nn.Linear(D, d_ff, dtype=dtype)
            self.down = torch.nn.Linear(d_ff, D, dtype=dtype)

        def forward(self, x, H):
            B, T, D = x.shape
            q, k, v = self.w_qkv(self.ln_a(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.w_o(y.transpose(1, 2).reshape(B, T, D))
            return x + self.down(F.gelu(self.up(self.ln_b(x))))

    def load(block, p):
        with torch.no_grad():
            block.w_qkv.weight.copy_(torch.cat([weights[f"{p}self_attn.{n}_proj.weight"]
                                                for n in "qkv"]))
            block.w_qkv.bias.copy_(torch.cat([weights[f"{p}self_attn.{n}_proj.bias"]
                                              for n in "qkv"]))
            for mine, theirs in (("w_o", "self_attn.out_proj"), ("up", "linear1"),
                                 ("down", "linear2"), ("ln_a", "norm1"), ("ln_b", "norm2")):
                getattr(block, mine).weight.copy_(weights[p + theirs + ".weight"])
                getattr(block, mine).bias.copy_(weights[p + theirs + ".bias"])

    E = weights["embed.weight"]
    x = E[tokens] + weights["position.weight"][:tokens.shape[1]]
    nu = 0
    while f"blocks.{nu}.linear1.weight" in weights:
        block = Block(E.shape[1], len(weights[f"blocks.{nu}.linear1.weight"]), E.dtype)
        load(block, f"blocks.{nu}.")
        x = block(x, num_heads)
        nu += 1
    x = F.layer_norm(x, x.shape[-1:], weights["final_norm.weight"], weights["final_norm.bias"])
    return F.linear(x, E)


# --- chapter 13: check_train_steps(fn), fn(model, inputs, targets, config) -> (rates, losses,
# the state_dict after the steps) ---------------------------------------------------------------

C13t = "check_train_steps"


def _train_like(model, inputs, targets, config, *, decay="matrices", clip="all", rate_of=None,
                optimizer=None):
    """lm.train's steps written out; the keyword arguments give the named mistakes and other
    right ways (rate_of(t, config): the schedule; optimizer(groups, config): the optimizer)."""
    params = list(model.parameters())
    if decay == "matrices":
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": config.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": 0.0 if decay == "none"
                   else config.weight_decay}]
    opt = (optimizer or (lambda g, c: torch.optim.AdamW(g, lr=c.lr, betas=c.betas)))(
        groups, config)
    rates, losses = [], []
    for t, (x, y) in enumerate(zip(inputs, targets)):
        rate = (rate_of or _book_rate)(t, config)
        for group in opt.param_groups:
            group["lr"] = rate
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if clip == "all":
            torch.nn.utils.clip_grad_norm_(params, config.clip)
        elif clip == "each":
            for p in params:
                torch.nn.utils.clip_grad_norm_([p], config.clip)
        opt.step()
        rates.append(rate)
        losses.append(loss.item())
    return (torch.tensor(rates, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64),
            model.state_dict())


def _book_rate(t, config):
    if t < config.warmup:
        return config.lr * (t + 1) / config.warmup
    done = (t - config.warmup) / max(1, config.steps - config.warmup)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * done))


@wrong(C13t, "decays the matrices only")
def train_decay_everywhere(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, decay="all")


@wrong(C13t, "no weight decay")
def train_no_decay(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, decay="none")


@wrong(C13t, "the gradients are not clipped")
def train_no_clipping(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, clip=None)


@wrong(C13t, "each parameter's gradient is clipped on its own")
def train_clip_each(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, clip="each")


@wrong(C13t, "the warm-up rises linearly")
def train_warmup_from_zero(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, rate_of=lambda t, c: (
        c.lr * t / c.warmup if t < c.warmup else _book_rate(t, c)))


@wrong(C13t, "it is not constant")
def train_constant_after_warmup(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, rate_of=lambda t, c: (
        _book_rate(t, c) if t < c.warmup else c.lr))


@wrong(C13t, "the learning rate of step")
def train_cosine_to_zero(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, rate_of=lambda t, c: (
        _book_rate(t, c) if t < c.warmup else 0.5 * c.lr * (1 + math.cos(
            math.pi * (t - c.warmup) / max(1, c.steps - c.warmup)))))


@shortcut(C13t, "lm.Config.learning_rate")
def train_the_configs_schedule(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, rate_of=lambda t, c: c.learning_rate(t))


@shortcut(C13t, "lm.train")
def train_through_lm_train(model, inputs, targets, config):
    """lm.train itself, made to start from the given model and batches: its build and its
    batches replaced for the call, a text with as many characters as the model's vocabulary."""
    text = "".join(chr(65 + i) for i in range(model.vocab_size)) * 8 * config.context
    queue = list(zip(inputs, targets))
    saved = lm.build, lm._batch
    lm.build, lm._batch = (lambda c, v: model), (lambda tokens, c, g: queue.pop(0))
    try:
        _, log = lm.train(config, 0, text, until=len(inputs))
    finally:
        lm.build, lm._batch = saved
    return (torch.tensor(log["lr"], dtype=torch.float64),
            torch.tensor(log["loss"], dtype=torch.float64), model.state_dict())


def _adamw_by_hand(groups, config):
    """AdamW written out (decoupled decay, bias-corrected moments), as an object with the
    param_groups, zero_grad and step that the loop uses."""
    class AdamW:
        def __init__(self):
            self.param_groups = [dict(g, lr=config.lr) for g in groups]
            self.t, self.m, self.v = 0, {}, {}

        def zero_grad(self):
            for g in self.param_groups:
                for p in g["params"]:
                    p.grad = None

        @torch.no_grad()
        def step(self):
            self.t += 1
            b1, b2 = config.betas
            for g in self.param_groups:
                for p in g["params"]:
                    m = self.m.get(p, torch.zeros_like(p)) * b1 + (1 - b1) * p.grad
                    v = self.v.get(p, torch.zeros_like(p)) * b2 + (1 - b2) * p.grad ** 2
                    self.m[p], self.v[p] = m, v
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    denom = (v / (1 - b2 ** self.t)).sqrt() + 1e-8
                    p.sub_(g["lr"] * (m / (1 - b1 ** self.t)) / denom)
    return AdamW()


@right(C13t)
def train_adamw_by_hand(model, inputs, targets, config):
    return _train_like(model, inputs, targets, config, optimizer=_adamw_by_hand)


@right(C13t)
def train_foreach_and_a_list_of_rates(model, inputs, targets, config):
    """PyTorch's AdamW on its foreach path, the groups made by name, the rates returned as a
    list made a tensor at the end."""
    matrices = [p for name, p in model.named_parameters() if p.dim() > 1]
    rest = [p for name, p in model.named_parameters() if p.dim() <= 1]
    return _train_like(model, inputs, targets, config, optimizer=lambda g, c: torch.optim.AdamW(
        [{"params": matrices, "weight_decay": c.weight_decay},
         {"params": rest, "weight_decay": 0.0}], lr=c.lr, betas=c.betas, foreach=True))


# --- chapter 13: check_sampling(sample, generate) ------------------------------------------------

C13s = "check_sampling"


def _sample_with(logits, temperature, top_k, top_p, generator, *, times=False, ignored=False,
                 ties=True, crossing=True, p_first=False, last_of_equal=False, draw=None):
    """A sampler written out; the keyword arguments give the named mistakes, and `draw(probs,
    generator)` another way of drawing."""
    if temperature == 0:
        if last_of_equal:
            return logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1)
        return logits.argmax(dim=-1)
    z = logits.reshape(-1, logits.shape[-1])
    z = z if ignored else z * temperature if times else z / temperature
    if top_k is not None:
        if ties:
            kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -math.inf)
        else:
            keep = torch.zeros_like(z, dtype=torch.bool).scatter(
                -1, z.topk(min(top_k, z.shape[-1]), dim=-1).indices, True)
            z = z.masked_fill(~keep, -math.inf)
    if top_p is not None:
        source = logits.reshape(z.shape).masked_fill(z == -math.inf, -math.inf) if p_first else z
        probs, order = torch.softmax(source, dim=-1).sort(dim=-1, descending=True)
        drop = (probs.cumsum(-1) - probs >= top_p) if crossing else probs.cumsum(-1) > top_p
        drop[:, 0] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    probs = torch.softmax(z, dim=-1)
    tokens = (draw or (lambda p, g: torch.multinomial(p, 1, generator=g)))(probs, generator)
    return tokens.reshape(logits.shape[:-1])


def _generate_with(sample, model, prompt, n, temperature, generator, cache, keep=None):
    """The loop written out with `sample`; keep: the tokens a restart keeps (the book keeps
    max_len // 2)."""
    seen = prompt.tolist()
    start = max(0, len(seen) - model.max_len)
    caches = model.new_caches() if cache else None
    new = seen[start:]
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([new]), caches=caches)[0, -1]
            token = int(sample(logits, temperature, None, None, generator))
            seen.append(token)
            if len(seen) - start > model.max_len:
                start = len(seen) - (model.max_len // 2 if keep is None else keep(model))
                caches = model.new_caches() if cache else None
                new = seen[start:]
            else:
                new = [token] if cache else seen[start:]
    return torch.tensor(seen[len(prompt):])


@wrong(C13s, "multiplied by the temperature", replaces="sample")
def sample_times_temperature(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, times=True)


@wrong(C13s, "the temperature is not used", replaces="sample")
def sample_temperature_ignored(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, ignored=True)


@wrong(C13s, "every token equal to the k-th", replaces="sample")
def sample_top_k_drops_ties(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, ties=False)


@wrong(C13s, "makes the kept mass reach top_p is dropped", replaces="sample")
def sample_top_p_drops_the_crossing_token(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, crossing=False)


@wrong(C13s, "top-p reads the probabilities before the temperature", replaces="sample")
def sample_top_p_before_temperature(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, p_first=True)


@wrong(C13s, "the first of equal ones", replaces="sample")
def sample_greedy_last_of_equal(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator, last_of_equal=True)


@wrong(C13s, "do not follow the generator", replaces="sample")
def sample_global_random_state(logits, temperature, top_k, top_p, generator):
    return _sample_with(logits, temperature, top_k, top_p, generator,
                        draw=lambda p, g: torch.multinomial(p, 1))


@wrong(C13s, "restart it from its last max_len // 2 tokens", replaces="generate")
def generate_keeps_the_whole_window(model, prompt, n, temperature, generator, cache):
    return _generate_with(lm_sample_ref, model, prompt, n, temperature, generator, cache,
                          keep=lambda m: m.max_len - 1)


@wrong(C13s, "lm.generate gives", replaces="generate")
def generate_cache_fed_the_window(model, prompt, n, temperature, generator, cache):
    """With the cache, the whole window fed again at every step (its keys counted twice)."""
    seen = prompt.tolist()
    caches = model.new_caches() if cache else None
    out = []
    with torch.no_grad():
        for _ in range(n):
            window = seen[-(model.max_len // 2):]
            if cache and caches[0].seen + len(window) > model.max_len:
                caches = model.new_caches()
            logits = model(torch.tensor([window]), caches=caches)[0, -1]
            token = int(lm_sample_ref(logits, temperature, None, None, generator))
            seen.append(token)
            out.append(token)
    return torch.tensor(out)


@shortcut(C13s, "lm.sample", replaces="sample")
def sample_the_modules(logits, temperature, top_k, top_p, generator):
    return lm.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                     generator=generator)


@shortcut(C13s, "lm.truncated", replaces="sample")
def sample_from_the_modules_truncated(logits, temperature, top_k, top_p, generator):
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = lm.truncated(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(z.reshape(-1, logits.shape[-1]), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])


@shortcut(C13s, "lm.generate", replaces="generate")
def generate_the_modules(model, prompt, n, temperature, generator, cache):
    return lm.generate(model, prompt, n, temperature=temperature, generator=generator,
                       cache=cache)


def lm_sample_ref(logits, temperature, top_k, top_p, generator):
    """A right sampler for the loops above."""
    return _sample_with(logits, temperature, top_k, top_p, generator)


@right(C13s, replaces="sample")
def sample_by_inverse_cdf(logits, temperature, top_k, top_p, generator):
    """Another draw: one uniform number per row against the cumulative probabilities (other
    tokens than lm.sample's, from the same distribution)."""
    def draw(probs, g):
        u = torch.rand(probs.shape[0], 1, generator=g, dtype=probs.dtype)
        cdf = probs.cumsum(dim=-1)
        return (cdf < u * cdf[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=probs.shape[-1] - 1)
    return _sample_with(logits, temperature, top_k, top_p, generator, draw=draw)


@right(C13s, replaces="generate")
def generate_the_window_by_slicing(model, prompt, n, temperature, generator, cache):
    """The window kept as a tensor; the cache's position read from the caches themselves."""
    return _generate_with(lm_sample_ref, model, prompt, n, temperature, generator, cache)



# --- chapter 13: check_lm_capstone(train_lm), train_lm(train_tokens, n_vocab, seconds) ->
# (weights, num_heads): a model of the answer's own, trained on the chapter's text -------------

C13c = "check_lm_capstone"
RULE_OF_CALL.update({"lm.load_text": "the module's load_text",
                     "lm.load_run": "the module's load_run"})


def _capstone_model(n_vocab, T=16, D=32, H=2, dtype=torch.float64):
    """A fresh model as a ModuleDict under DecoderLM's names, and its logits."""
    from torch import nn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.ModuleDict({
            "embed": nn.Embedding(n_vocab, D, dtype=dtype),
            "position": nn.Embedding(T, D, dtype=dtype),
            "blocks": nn.ModuleList([transformer.TransformerBlock(D, H, 4 * D, dtype=dtype)]),
            "final_norm": nn.LayerNorm(D, dtype=dtype),
            "unembed": nn.Linear(D, n_vocab, bias=False, dtype=dtype)})

    def logits_of(tokens):
        x = model["embed"](tokens) + model["position"].weight[:tokens.shape[1]]
        for block in model["blocks"]:
            x = block(x, is_causal=True)
        return model["unembed"](model["final_norm"](x))
    return model, logits_of


def _capstone_train(train_tokens, n_vocab, steps, T=16, B=96, dtype=torch.float64):
    """The weights after `steps` steps of AdamW (a constant rate of 0.03)."""
    model, logits_of = _capstone_model(n_vocab, T, dtype=dtype)
    batches = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(steps):
        starts = torch.randint(len(train_tokens) - T, (B,), generator=batches)
        rows = train_tokens[starts[:, None] + torch.arange(T + 1)]
        loss = F.cross_entropy(logits_of(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


@wrong(C13c, "not below the unigram counts")
def capstone_untrained(train_tokens, n_vocab, seconds):
    return _capstone_train(train_tokens, n_vocab, 0), 2


@wrong(C13c, "not below the bigram counts")
def capstone_too_few_steps(train_tokens, n_vocab, seconds):
    return _capstone_train(train_tokens, n_vocab, 10), 2


@wrong(C13c, "name them as DecoderLM's state_dict does")
def capstone_names_of_its_own(train_tokens, n_vocab, seconds):
    weights = _capstone_train(train_tokens, n_vocab, 0)
    return {name.replace("embed.", "tokens."): w for name, w in weights.items()}, 2


@wrong(C13c, "not a multiple of num_heads")
def capstone_wrong_number_of_heads(train_tokens, n_vocab, seconds):
    return _capstone_train(train_tokens, n_vocab, 0), 3


@wrong(C13c, "NaN or inf")
def capstone_nan_in_a_norm(train_tokens, n_vocab, seconds):
    weights = _capstone_train(train_tokens, n_vocab, 0)
    weights["final_norm.weight"] = torch.full_like(weights["final_norm.weight"], math.nan)
    return weights, 2


@wrong(C13c, "should return (weights, num_heads)", earns="nothing")
def capstone_returns_the_weights_alone(train_tokens, n_vocab, seconds):
    return _capstone_train(train_tokens, n_vocab, 0)


@shortcut(C13c, "transformer.DecoderLM")
def capstone_the_books_model(train_tokens, n_vocab, seconds):
    return transformer.DecoderLM(n_vocab, 16, 32, 2, 128, 1).state_dict(), 2


@shortcut(C13c, "lm.build")
def capstone_through_lm_build(train_tokens, n_vocab, seconds):
    config = lm.Config(context=16, d_model=32, num_heads=2, d_ff=128, num_layers=1)
    return lm.build(config, n_vocab).state_dict(), 2


@shortcut(C13c, "torch.nn.TransformerEncoderLayer")
def capstone_with_pytorchs_layer(train_tokens, n_vocab, seconds):
    """PyTorch's layer as the block, its weights renamed to the block's (not trained here)."""
    layer = torch.nn.TransformerEncoderLayer(32, 2, 128, dropout=0.0, batch_first=True,
                                             norm_first=True, dtype=torch.float64)
    weights = _capstone_train(train_tokens, n_vocab, 0)
    inner = layer.state_dict()
    q, k, v = inner["self_attn.in_proj_weight"].chunk(3)
    weights.update({"blocks.0.self_attn.q_proj.weight": q, "blocks.0.self_attn.k_proj.weight": k,
                    "blocks.0.self_attn.v_proj.weight": v})
    return weights, 2


@shortcut(C13c, "lm.train")
def capstone_through_lm_train(train_tokens, n_vocab, seconds):
    config = lm.Config(context=16, d_model=16, num_heads=2, d_ff=32, num_layers=1, steps=10,
                       eval_every=10)
    model, _ = lm.train(config, 0, until=0)
    return model.state_dict(), 2


@shortcut(C13c, "lm.load_text")
def capstone_trained_on_the_held_out_text_too(train_tokens, n_vocab, seconds):
    text = lm.load_text()
    return _capstone_train(lm.Vocabulary(text).encode(text), n_vocab, 0), 2


@shortcut(C13c, "lm.load_run")
def capstone_the_chapters_weights(train_tokens, n_vocab, seconds):
    run = lm.load_run("shakespeare")
    return run.model.state_dict(), run.config.num_heads


@right(C13c)
def capstone_a_class_in_float32(train_tokens, n_vocab, seconds):
    """A class of its own whose attributes carry DecoderLM's names, float32, a context of 32,
    the weights from named_parameters (tensors that require a gradient)."""
    from torch import nn

    class Small(nn.Module):
        def __init__(self, T, D, H):
            super().__init__()
            self.embed = nn.Embedding(n_vocab, D)
            self.position = nn.Embedding(T, D)
            self.blocks = nn.ModuleList([transformer.TransformerBlock(D, H, 4 * D)])
            self.final_norm = nn.LayerNorm(D)
            self.unembed = nn.Linear(D, n_vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position.weight[:tokens.shape[1]]
            for block in self.blocks:
                x = block(x, is_causal=True)
            return self.unembed(self.final_norm(x))

    T = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Small(T, 32, 2)
    batches = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(100):
        starts = torch.randint(len(train_tokens) - T, (64,), generator=batches)
        rows = train_tokens[starts[:, None] + torch.arange(T + 1)]
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return dict(model.named_parameters()), 2


def _run(check, fn):
    """{case title: message or None}."""
    return {title: check._run(title, (fn,)) for title in check.cases}

# ---------------------------------------------------------------------------------------------
# The tests

def _replacements(check: str, replaces: str | None, fn) -> dict:
    names = REFERENCES[check].functions
    if replaces is None:
        assert len(names) == 1, f"{check} takes {names}: say which one {fn.__name__} replaces"
        replaces = names[0]
    return {replaces: fn}


WRONG_CASES = [pytest.param(check, fragment, replaces, fn, id=f"{check}-{name}")
               for check, entries in sorted(WRONG.items())
               for name, fragment, replaces, fn in entries]
RIGHT_CASES = [pytest.param(check, replaces, fn, id=f"{check}-{name}")
               for check, entries in sorted(RIGHT.items())
               for name, replaces, fn in entries]
STUB_CASES = [pytest.param(check, name, id=f"{check}-{name}")
              for check in CHECK_NAMES if check in REFERENCES
              for name in REFERENCES[check].functions]


def test_the_chapters_have_checks():
    assert len(CHECK_NAMES) >= 7, CHECK_NAMES


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_check_accepts_the_reference_solution_with_every_point(check, capsys):
    """The reference solution passes every case, as the chapter runs the check, and so earns
    every point; the stub earns none, each case saying it is not written yet."""
    assert check in REFERENCES, f"no gated solution cell calls {check}"
    call_check(check, {})
    out = capsys.readouterr().out
    graded = load_check(check)
    assert f"all {len(graded.cases)} cases pass" in out, out
    earned, messages = printed_verdicts(check, out)
    assert earned == graded.points >= 3, messages
    earned, messages = graded_points(check, stub_functions(check))
    assert earned == 0 and all("not written yet" in m for m in messages.values()), messages


@pytest.mark.parametrize("check, function", STUB_CASES)
def test_check_says_the_stub_is_not_written_yet(check, function):
    stub = stub_functions(check)[function]
    with pytest.raises(AssertionError) as info:
        call_check(check, {function: stub})
    assert str(info.value) == NOT_WRITTEN.format(function)


def graded_points(check: str, replace: dict) -> tuple[int, dict[str, str | None]]:
    """The points an nbgrader assignment gives, each case graded alone as a test cell does
    (messages as `Check.grade` raises them, "<case>: <message>"), read from one whole run of
    the check: `Check._run_all` gives every case the verdict that grading it alone gives
    (test_a_whole_run_judges_each_case_as_grading_it_alone_does), and runs each case once,
    where grading the cases one by one runs each once more to look for forbidden work."""
    functions = reference_functions(check)
    functions.update(replace)
    graded = load_check(check)
    verdicts = graded._run_all(tuple(functions.values()))
    earned = sum(points for title, (_, points, _) in graded.cases.items()
                 if verdicts[title] is None)
    return earned, {title: None if message is None else f"{title}: {message}"
                    for title, message in verdicts.items()}


def printed_verdicts(check: str, out: str) -> tuple[int, dict[str, str | None]]:
    """(points, {case: None or the message}) from the lines a check's run printed, one per case
    ("pass  <case> (n points)" or "FAIL  <case> (n points): <message>"): what grading each case
    alone gives (`Check.__call__` runs each case once and judges it as `Check.grade` does:
    test_a_whole_run_judges_each_case_as_grading_it_alone_does)."""
    graded = load_check(check)
    starts = sorted((out.index(mark), title, mark.startswith("pass"))
                    for title in graded.cases
                    for mark in (f"pass  {title} (", f"FAIL  {title} (") if mark in out)
    assert [title for _, title, _ in starts] == list(graded.cases), out  # each once, in order
    earned, messages = 0, {}
    for (at, title, passed), following in zip(starts, [*[s[0] for s in starts[1:]], len(out)]):
        if passed:
            earned += graded.cases[title][1]
            messages[title] = None
        else:
            messages[title] = out[at:following].split("): ", 1)[1].strip()
    return earned, messages


SAME_VERDICT_CASES = [case for case in WRONG_CASES
                      if case.values[0] in (C5, C13m)]  # each with partial and forbidden answers


@pytest.mark.parametrize("check, fragment, replaces, fn", SAME_VERDICT_CASES)
def test_a_whole_run_judges_each_case_as_grading_it_alone_does(check, fragment, replaces, fn,
                                                                capsys):
    """A run of the whole check runs each case once, its runs also the look for forbidden
    work; grading the cases one by one, as nbgrader's test cells do (`Check.grade`, and
    `Check._run` in tools/isolated_grading.py's grading process, which imports the check once
    per notebook), runs every case once to look for it, then each case. Both give every case
    the same verdict and points, so the catalogue (graded_points) reads them from a whole
    run."""
    replace = _replacements(check, replaces, fn)
    with pytest.raises(AssertionError):
        call_check(check, replace)
    earned, printed = printed_verdicts(check, capsys.readouterr().out)
    graded_check = load_check(check)
    functions = reference_functions(check)
    functions.update(replace)
    graded_check._looked.clear()  # as in the grading process, which imports the check anew
    alone, points = {}, 0
    for title, (_, worth, _) in graded_check.cases.items():  # as the test cells grade them
        try:
            graded_check.grade(title, *functions.values())
            alone[title], points = None, points + worth
        except AssertionError as err:
            alone[title] = str(err)
    assert points == earned and alone == {
        title: None if message is None else f"{title}: {message}"
        for title, message in printed.items()}, (printed, alone)


@pytest.mark.parametrize("check, fragment, replaces, fn", WRONG_CASES)
def test_check_names_the_mistake_and_gives_part_of_the_points(check, fragment, replaces, fn,
                                                               capsys):
    """The check, run as the chapter runs it, rejects a common mistake and names it, with a line
    per case. Partial credit, read from those lines: a common mistake earns more than a blank
    and less than the answer; a forbidden call or a broken answer earns nothing, and the
    message says why. (nbgrader grades each case alone through `Check.grade`, which judges a
    case as `Check.__call__` does: test_a_whole_run_judges_each_case_as_grading_it_alone_does.)"""
    with pytest.raises(AssertionError) as info:
        call_check(check, _replacements(check, replaces, fn))
    message = str(info.value)
    assert fragment in message, f"expected {fragment!r} in the message, got:\n{message}"
    assert "not written yet" not in message
    out = capsys.readouterr().out
    assert "cases pass" not in out and "FAIL" in out, out
    earned, messages = printed_verdicts(check, out)
    full = load_check(check).points
    failed = [m for m in messages.values() if m is not None]
    if EARNS[check, fn.__name__] == "nothing":
        assert earned == 0, f"{fn.__name__} earns {earned} of {full}: {messages}"
    else:
        assert 0 < earned < full, f"{fn.__name__} earns {earned} of {full}: {messages}"
        # A case fails only for its own reason: a mistake that modifies no argument keeps the
        # point of "arguments left unchanged" (a wrong scale, an off-by-one mask)
        unchanged = messages.get(checking.UNCHANGED)  # None too where the check has no such case
        if fn.__name__ in CONSTANT_RESULTS:
            assert "returns only constants" in unchanged, unchanged
        elif unchanged is not None:
            assert "modified its" in unchanged, (fn.__name__, unchanged)
    assert any(fragment in m for m in failed), (fragment, failed)


# wrong answers whose results are constants, which the unchanged case cannot tell from doing
# nothing: reading causal weights at [key, query] reads the mask's zeros
CONSTANT_RESULTS = {"ind_transposed"}


@pytest.mark.parametrize("check, fn", [(C2, sa_scale_d_model), (C5, mask_padding_off_by_one),
                                       (C7, cross_scale_d_v)])
def test_a_wrong_scale_or_an_off_by_one_mask_keeps_arguments_left_unchanged(check, fn, capsys):
    """The mistakes a reader found losing that point twice: a wrong scale (chapter 2),
    a padding mask one position off (chapter 5), the scale by sqrt(d_v) (chapter 7)."""
    earned, messages = graded_points(check, _replacements(check, None, fn))
    assert messages[checking.UNCHANGED] is None and 0 < earned < load_check(check).points


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_module_check_forbids_something_and_has_a_shortcut(check):
    """Every exercise rules something out (at least the module's or PyTorch's version of what
    it asks for, or, for the additive scores, a loop), and the catalogue holds an answer that
    does it, which earns nothing."""
    graded = load_check(check)
    assert graded.rules or graded._inspect, f"{check}: nothing ruled out"
    shortcuts = [fn.__name__ for _, _, _, fn in WRONG[check]
                 if EARNS[check, fn.__name__] == "nothing" and fn.__name__ in FORBIDDEN_WORK]
    assert shortcuts, f"{check}: no forbidden answer in the catalogue"


@pytest.mark.parametrize("check, replaces, fn", RIGHT_CASES)
def test_check_accepts_a_correct_answer_written_differently(check, replaces, fn):
    call_check(check, _replacements(check, replaces, fn))


def test_no_chapter_defines_a_check_of_its_own():
    # A check lives in code/checks_<chapter>.py, where nbgrader grades it case by case; a check_* written
    # in a chapter cell would grade all or nothing and escape this file's catalogue.
    for chapter in CHAPTERS:
        for cell in chapter.cells:
            if "def check_" not in cell.source:  # (the setup cell holds magics ast cannot read)
                continue
            defined = [node.name for node in ast.parse(cell.source).body
                       if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")]
            assert not defined, f"{chapter.name}: {defined} defined in a cell, not code/checks_*.py"


def test_every_check_has_a_catalogue():
    assert set(WRONG) == set(CHECK_NAMES), (
        f"checks without wrong answers here: {sorted(set(CHECK_NAMES) - set(WRONG))}; "
        f"wrong answers for checks the chapters no longer have: "
        f"{sorted(set(WRONG) - set(CHECK_NAMES))}")
    assert set(RIGHT) <= set(CHECK_NAMES)
    for check, entries in WRONG.items():
        assert len(entries) >= 3, f"{check}: at least three wrong answers"
    assert sum(map(len, WRONG.values())) >= 35


def test_every_coding_exercise_has_a_check_and_is_catalogued():
    for chapter in CHAPTERS:
        for cell in chapter.cells:
            if cell.solution_of is None or SOLUTION not in cell.tags:
                continue
            for check, _ in check_calls(cell.source):
                assert check in CHECK_CELLS, f"{chapter.name}: {check} is called, never defined"
                assert check in WRONG, f"{check} has no wrong answers in the catalogue"


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_check_is_called_by_a_solution_and_named_in_its_exercise(check):
    assert check in REFERENCES, f"no gated solution calls {check} on a reference function"
    ref = REFERENCES[check]
    assert CHECK_CELLS[check].chapter == ref.cell.chapter
    exercises = [ex for ch in CHAPTERS for ex in ch.exercises if ex.label == ref.cell.solution_of]
    assert len(exercises) == 1, f"no exercise labelled {ref.cell.solution_of}"
    assert f"{check}(" in exercises[0].text, (
        f"the exercise {ref.cell.solution_of} should tell the student to run {check}(...)")


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_the_stub_shows_a_docstring_with_the_shapes(check):
    """The docstring is all a student sees of the reference solution."""
    stub, calls = stub_code(REFERENCES[check].cell.source)
    tree = ast.parse(stub)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name in REFERENCES[check].functions:
        doc = ast.get_docstring(functions[name])
        assert doc and "->" in doc and "(" in doc, (
            f"{name}: the docstring should give the arguments and the result, with shapes")
    assert check in calls


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_line_lengths(check):
    for line in CHECK_CELLS[check].source.splitlines():  # the cell that imports the check
        assert len(line) <= 100, f"{check} cell: {len(line)} columns: {line}"
    for line in REFERENCES[check].cell.source.splitlines():
        assert len(line) <= 79, f"solution of {check}: {len(line)} columns: {line}"
