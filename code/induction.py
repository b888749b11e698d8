"""Induction heads in a small attention-only Transformer, written to be read.

The task (Olsson et al. 2022): a sequence of random tokens in which a segment appears twice.
Inside the second copy, every token after its first can be predicted by copying: find the
earlier occurrence of the current token and predict the token that followed it. A model of two
attention layers learns to do exactly that by composing two heads (Elhage et al. 2021): a
*previous-token head* in layer 0 writes "the token before me" into every position, and an
*induction head* in layer 1 matches the current token against it and copies what follows.

What is here, in the order the chapter "Induction heads" uses it:

- ``Config``, ``Batch``, ``make_batch`` and ``evaluation_sets``: the data, with the segment's
  length and both positions drawn at random for every sequence;
- ``AttentionOnly``: token and position embeddings, attention layers (the module's causal
  ``MultiHeadAttention``) added to the residual stream, a linear unembedding; no MLP and no
  layer norm;
- ``previous_token_score`` and ``induction_score``, computed from attention weights;
  ``ablate``, a copy of a model with some heads' outputs zeroed; ``repeated_loss`` and
  ``copy_reference_loss``; ``evaluate``;
- ``record_activation`` and ``patch_activation``: activation patching, one run's activation
  at a named site put in place of another run's, by forward hooks (for ``AttentionOnly`` and
  chapter "A language model"'s ``DecoderLM``);
- ``train(config, seed)``, which returns the model and its log, and ``phase_change_step``;
- ``save_run`` and ``load_run``: the runs that tools/models.py trains (``make models``) and
  the chapter loads, with their logs and the SHA-256 of their weights.

Everything is float64 and deterministic: the same config and seed give the same log.

Positions are counted from 0 in the sequence the model reads, whose position 0 holds the
beginning-of-sequence token BOS (``vocab_size``). Shape legend as in ``attention.py``: B
sequences, H heads, T positions (L = S = T in self-attention), D = d_model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import stored
from attention import MultiHeadAttention
from transformer import DecoderLM

__all__ = [
    "Config",
    "Batch",
    "make_batch",
    "evaluation_sets",
    "AttentionOnly",
    "ablate",
    "silence_heads",
    "previous_token_score",
    "induction_score",
    "repeated_loss",
    "copy_reference_loss",
    "evaluate",
    "SITES",
    "record_activation",
    "patch_activation",
    "ov_circuit",
    "copying_score",
    "train",
    "phase_threshold",
    "phase_change_step",
    "save_run",
    "load_run",
    "Run",
]

DTYPE = torch.float64
EVAL_SEED = 1234  # the generator of the fixed evaluation sets, the same for every run


# ---------------------------------------------------------------------------------------------
# The configuration and the data


@dataclass(frozen=True)
class Config:
    """One training run's settings. ``n_tokens`` random tokens follow BOS; the model reads the
    first ``n_tokens`` of those ``n_tokens + 1`` and predicts each next one. The repeated
    segment's length is drawn from ``train_lengths`` (inclusive) in training and from
    ``heldout_lengths`` in the held-out evaluation set."""

    n_layers: int = 2
    n_heads: int = 1
    d_model: int = 32
    vocab_size: int = 32
    n_tokens: int = 24
    train_lengths: tuple = (3, 8)
    heldout_lengths: tuple = (9, 12)
    lr: float = 1e-2
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.01
    batch_size: int = 32
    steps: int = 800
    log_every: int = 25
    eval_size: int = 256

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "d_model", "vocab_size", "n_tokens", "batch_size",
                     "log_every", "eval_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of "
                             f"n_heads={self.n_heads}")
        if self.steps < 0 or self.steps % self.log_every:
            raise ValueError(f"steps={self.steps} must be a multiple of "
                             f"log_every={self.log_every}, so that the last step is logged")
        for name in ("train_lengths", "heldout_lengths", "betas"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # JSON gives lists
        for name in ("train_lengths", "heldout_lengths"):
            _check_lengths(name, getattr(self, name), self.n_tokens)

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        return cls(**values)


def _check_lengths(name: str, lengths, n_tokens: int) -> None:
    if (len(lengths) != 2 or not all(isinstance(n, int) for n in lengths)
            or not 2 <= lengths[0] <= lengths[1] or 2 * lengths[1] > n_tokens):
        raise ValueError(f"{name} must be (shortest, longest) with 2 <= shortest <= longest "
                         f"and two copies of the longest within n_tokens={n_tokens}; "
                         f"got {lengths!r}")


@dataclass
class Batch:
    """B sequences and where their copies are. ``tokens`` is ``(B, n_tokens + 1)``: BOS, then
    the random tokens. The segment of ``length`` tokens starts at position ``first`` and again
    at ``second`` (each ``(B,)``, positions in ``tokens``), with ``second >= first + length``.
    """

    tokens: Tensor
    first: Tensor
    second: Tensor
    length: Tensor

    @property
    def inputs(self) -> Tensor:
        """(B, T): what the model reads, BOS and the first T - 1 random tokens."""
        return self.tokens[:, :-1]

    @property
    def targets(self) -> Tensor:
        """(B, T): the token each position must predict, the one after it."""
        return self.tokens[:, 1:]

    def copyable(self) -> Tensor:
        """(B, T) boolean: the positions whose next token can be predicted by copying. Those
        are the positions of the second copy but its last: position i holds a token of the
        second copy, and the token after it is the token after that token's earlier
        occurrence, at i - (second - first) + 1."""
        i = torch.arange(self.inputs.shape[1])
        start, end = self.second[:, None], (self.second + self.length - 1)[:, None]
        return (i >= start) & (i < end)

    def __len__(self) -> int:
        return self.tokens.shape[0]


def make_batch(n: int, config: Config, lengths, generator: torch.Generator) -> Batch:
    """``n`` sequences of ``config.n_tokens`` random tokens after BOS, each with a segment
    copied once. For every sequence the segment's length is drawn uniformly from ``lengths``
    (inclusive), then the gap between the two copies uniformly among those that fit, then the
    first copy's start uniformly in the room left; the second copy overwrites the tokens
    where it lands."""
    _check_lengths("lengths", tuple(lengths), config.n_tokens)
    N, V = config.n_tokens, config.vocab_size
    body = torch.randint(0, V, (n, N), generator=generator)  # (n, N)
    length = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=generator)
    room = N - 2 * length  # what the gap and the first copy's offset share
    gap = (torch.rand(n, generator=generator, dtype=DTYPE) * (room + 1)).long()
    start = (torch.rand(n, generator=generator, dtype=DTYPE) * (room - gap + 1)).long()
    i = torch.arange(N)
    shift = (length + gap)[:, None]  # the second copy starts this far after the first
    in_second = (i >= start[:, None] + shift) & (i < start[:, None] + shift + length[:, None])
    source = (i - shift).clamp(min=0)  # (n, N): where a token of the second copy comes from
    body = torch.where(in_second, body.gather(1, source), body)
    tokens = torch.cat([torch.full((n, 1), V), body], dim=1)  # BOS first
    return Batch(tokens, start + 1, start + 1 + length + gap, length)


def evaluation_sets(config: Config) -> dict[str, Batch]:
    """The fixed evaluation sets of ``config.eval_size`` sequences each, drawn from one
    generator seeded with EVAL_SEED: "train", with the training lengths, and "heldout", with
    the held-out lengths."""
    generator = torch.Generator().manual_seed(EVAL_SEED)
    return {"train": make_batch(config.eval_size, config, config.train_lengths, generator),
            "heldout": make_batch(config.eval_size, config, config.heldout_lengths, generator)}


# ---------------------------------------------------------------------------------------------
# The model


class AttentionOnly(nn.Module):
    """An attention-only Transformer: the residual stream starts as token embedding plus a
    learned position embedding, each layer adds its causal multi-head attention to it, and a
    linear map reads the logits over the ``vocab_size`` tokens (BOS is never predicted). No
    MLP, no layer norm, no biases; float64.

    ``forward(tokens)`` takes ``(B, T)`` integer tokens and returns the logits ``(B, T,
    vocab_size)`` and each layer's attention weights, ``(B, H, T, T)`` each.
    """

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        D = config.d_model
        self.embed = nn.Embedding(config.vocab_size + 1, D, dtype=DTYPE)  # + BOS
        self.position = nn.Embedding(config.n_tokens, D, dtype=DTYPE)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)
        self.layers = nn.ModuleList(MultiHeadAttention(D, config.n_heads, bias=False, dtype=DTYPE)
                                    for _ in range(config.n_layers))
        # The residual stream that layer l reads (l = n_layers: the unembedding), passed
        # through an identity that a forward hook can see (``patch_activation``); no weights.
        self.streams = nn.ModuleList(nn.Identity() for _ in range(config.n_layers + 1))
        self.unembed = nn.Linear(D, config.vocab_size, bias=False, dtype=DTYPE)

    def stream(self, tokens: Tensor) -> Tensor:
        """(B, T, D): the residual stream before the first layer."""
        T = tokens.shape[1]
        return self.embed(tokens) + self.position(torch.arange(T))

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor]]:
        self._check_tokens(tokens)
        x = self.stream(tokens)  # (B, T, D)
        weights = []
        for layer, seen in zip(self.layers, self.streams):
            x = seen(x)  # the identity
            out, w = layer(x, x, x, is_causal=True)  # (B, T, D), (B, H, T, T)
            x = x + out
            weights.append(w)
        # (B, T, vocab_size), [(B, H, T, T)] * n_layers
        return self.unembed(self.streams[-1](x)), weights

    def _check_tokens(self, tokens) -> None:
        c = self.config
        if (not isinstance(tokens, Tensor) or tokens.dim() != 2
                or tokens.dtype not in (torch.int64, torch.int32)):
            what = (f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
                    if isinstance(tokens, Tensor) else type(tokens).__name__)
            raise ValueError(f"AttentionOnly expects integer tokens of shape (B, T); got {what}")
        if not 1 <= tokens.shape[1] <= c.n_tokens:
            raise ValueError(f"tokens {tuple(tokens.shape)}: T must lie in 1..{c.n_tokens}, "
                             "the positions the model has embeddings for")
        if int(tokens.min()) < 0 or int(tokens.max()) > c.vocab_size:
            raise ValueError(f"tokens must lie in 0..{c.vocab_size} (BOS = {c.vocab_size}); "
                             f"got values from {int(tokens.min())} to {int(tokens.max())}")


def ablate(model: AttentionOnly, heads: Iterable[tuple[int, int]]) -> AttentionOnly:
    """A copy of ``model`` in which each head ``(layer, head)`` of ``heads`` writes nothing
    (``silence_heads``). Its attention weights are unchanged."""
    ablated = copy.deepcopy(model)
    silence_heads(list(ablated.layers), heads)
    return ablated


def silence_heads(attentions: list[MultiHeadAttention], heads: Iterable[tuple[int, int]]) -> None:
    """Zero, in place, the output of each head ``(layer, head)`` of ``heads``, where
    ``attentions[layer]`` is that layer's ``MultiHeadAttention``.

    A layer's output is its heads' outputs side by side, ``(B, T, H * d_h)``, times W_O;
    head h's output meets only the d_h columns of ``out_proj.weight`` (rows of W_O in the
    book's notation) from h * d_h on, so zeroing those zeroes the head's contribution and
    nothing else.
    """
    for layer, head in heads:
        if not (0 <= layer < len(attentions) and 0 <= head < attentions[0].num_heads):
            raise ValueError(f"no head ({layer}, {head}): the model has "
                             f"{len(attentions)} layers of {attentions[0].num_heads} heads")
        attn = attentions[layer]
        width = attn.head_dim
        with torch.no_grad():
            attn.out_proj.weight[:, head * width:(head + 1) * width] = 0.0


# ---------------------------------------------------------------------------------------------
# Scores and losses


def _check_weights(weights) -> None:
    if not isinstance(weights, Tensor) or weights.dim() != 4 or \
            weights.shape[-1] != weights.shape[-2] or not weights.is_floating_point():
        what = (f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor)
                else type(weights).__name__)
        raise ValueError(f"weights must be a floating (B, H, T, T) tensor of one layer's "
                         f"attention; got {what}")


def previous_token_score(weights: Tensor) -> Tensor:
    """(H,): each head's mean weight on the previous position, a_{i, i-1}, over the positions
    i = 1..T-1 of all B sequences. ``weights`` is ``(B, H, T, T)``. A head that always reads
    the token before its own scores 1; uniform causal weights score about (ln T) / T."""
    _check_weights(weights)
    T = weights.shape[-1]
    if T < 2:
        raise ValueError(f"weights {tuple(weights.shape)}: T = {T} has no previous position")
    i = torch.arange(1, T)
    return weights[:, :, i, i - 1].mean(dim=(0, 2))  # (B, H, T - 1) -> (H,)


def induction_score(weights: Tensor, first: Tensor, second: Tensor, length: Tensor) -> Tensor:
    """(H,): each head's mean weight, from each copyable position i of the second copy, on
    the position after the earlier occurrence of its token, i - (second - first) + 1.

    ``weights`` is ``(B, H, T, T)``; ``first``, ``second`` and ``length`` are ``(B,)``: the
    segment of ``length`` tokens starts at ``first`` and again at ``second``. The copyable
    positions are second .. second + length - 2 (``Batch.copyable``); every one of them, in
    every sequence, counts once in the mean."""
    _check_weights(weights)
    B, _, T, _ = weights.shape
    shapes = (f"weights {tuple(weights.shape)}, first {tuple(first.shape)}, "
              f"second {tuple(second.shape)}, length {tuple(length.shape)}")
    if not first.shape == second.shape == length.shape == (B,):
        raise ValueError(f"first, second and length must be (B,) with B = {B}; got {shapes}")
    if bool(((first < 1) | (length < 2) | (second < first + length)
             | (second + length - 1 > T)).any()):
        raise ValueError(f"every sequence needs 1 <= first, length >= 2, first + length <= "
                         f"second and second + length - 1 <= T = {T}; got {shapes}")
    i = torch.arange(T)
    copyable = (i >= second[:, None]) & (i < (second + length - 1)[:, None])  # (B, T)
    b, query = copyable.nonzero(as_tuple=True)  # every copyable (sequence, position)
    key = query - (second - first)[b] + 1  # the position after the earlier occurrence
    return weights[b, :, query, key].mean(dim=0)  # (n, H) -> (H,)


def repeated_loss(logits: Tensor, batch: Batch) -> Tensor:
    """The mean cross-entropy of the copyable targets (``Batch.copyable``), the loss on the
    repeated part; ``logits`` is ``(B, T, vocab_size)``. A scalar tensor."""
    losses = F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")  # (B, T)
    return losses[batch.copyable()].mean()


def copy_reference_loss(batch: Batch) -> float:
    """The repeated-part loss of the ideal one-token copying rule: at each copyable position,
    predict uniformly among the tokens that followed the earlier occurrences of the current
    token. It is above 0 because tokens recur by chance, and it is what an induction head that
    matches one token can reach."""
    total, count = 0.0, 0
    for seq, row in zip(batch.tokens.tolist(), batch.copyable().tolist()):
        for i in (i for i, yes in enumerate(row) if yes):
            followers = [seq[j + 1] for j in range(1, i) if seq[j] == seq[i]]
            total -= math.log(followers.count(seq[i + 1]) / len(followers))
            count += 1
    return total / count


@torch.no_grad()
def evaluate(model: AttentionOnly, sets: dict[str, Batch]) -> dict:
    """The repeated-part loss on the "train" and "heldout" evaluation sets, and on the first,
    each layer's previous-token and induction scores, one per head."""
    logits, weights = model(sets["train"].inputs)
    train = sets["train"]
    heldout_logits, _ = model(sets["heldout"].inputs)
    return {
        "loss": float(repeated_loss(logits, train)),
        "heldout_loss": float(repeated_loss(heldout_logits, sets["heldout"])),
        "previous_token": [previous_token_score(w).tolist() for w in weights],
        "induction": [induction_score(w, train.first, train.second, train.length).tolist()
                      for w in weights],
    }


# ---------------------------------------------------------------------------------------------
# Activation patching


SITES = ("stream", "query", "key", "value", "head")  # what ``site[0]`` may name


def _attention_modules(model) -> list[MultiHeadAttention]:
    if isinstance(model, AttentionOnly):
        return list(model.layers)
    if isinstance(model, DecoderLM):
        return [block.self_attn for block in model.blocks]
    raise ValueError(f"activation patching reads an AttentionOnly or a DecoderLM, got "
                     f"{type(model).__name__}")


def _hook_point(model, site) -> tuple[nn.Module, bool, int, Optional[slice]]:
    """Where ``site`` is: the module to hook, whether its output (True, a forward hook) or
    one of its inputs (False, a forward pre-hook) is the activation, which input, and the
    slice of the last axis (a head's features) or None (all of it). Raises ValueError,
    naming the model's sizes, for a site it does not have."""
    attentions = _attention_modules(model)
    n_layers, n_heads = len(attentions), attentions[0].num_heads
    sizes = f"the model has {n_layers} layers of {n_heads} heads"
    if not isinstance(site, tuple) or len(site) < 2 or site[0] not in SITES or \
            len(site) != (3 if site[0] == "head" else 2):
        raise ValueError(f"a site is (kind, layer) with kind one of {SITES[:4]}, or "
                         f"('head', layer, head); got {site!r}")
    kind, layer = site[0], site[1]
    top = n_layers if kind == "stream" else n_layers - 1  # stream n_layers: the unembedding's
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= top:
        raise ValueError(f"site {site!r}: layer must lie in 0..{top}; {sizes}")
    if kind == "stream":
        if isinstance(model, AttentionOnly):
            return model.streams[layer], True, 0, None
        module = model.blocks[layer] if layer < n_layers else model.final_norm
        return module, False, 0, None  # what the block (or the final norm) reads
    attention = attentions[layer]
    if kind != "head":
        return attention, False, ("query", "key", "value").index(kind), None
    head = site[2]
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < n_heads:
        raise ValueError(f"site {site!r}: head must lie in 0..{n_heads - 1}; {sizes}")
    width = attention.head_dim  # the head's output, before W_O: its slice of out_proj's input
    return attention.out_proj, False, 0, slice(head * width, (head + 1) * width)


def _run_hooked(model, tokens: Tensor, site, change):
    """``model(tokens)`` with ``change(activation)`` in place of the activation at ``site``
    (``change`` may return it unchanged, having looked). The hook is removed afterwards, even
    when the run raises."""
    module, is_output, index, features = _hook_point(model, site)

    def replace(value: Tensor) -> Tensor:
        if features is None:
            return change(value)
        value = value.clone()
        value[..., features] = change(value[..., features])
        return value

    if is_output:
        handle = module.register_forward_hook(lambda mod, args, out: replace(out))
    else:
        def pre_hook(mod, args):
            args = list(args)
            args[index] = replace(args[index])
            return tuple(args)
        handle = module.register_forward_pre_hook(pre_hook)
    try:
        with torch.no_grad():
            return model(tokens)
    finally:
        handle.remove()


def record_activation(model, tokens: Tensor, site) -> Tensor:
    """The activation at ``site`` when ``model`` (an ``AttentionOnly`` or a ``DecoderLM``)
    reads ``tokens`` ``(B, T)``: ``(B, T, D)`` for a stream, a query, key or value input,
    ``(B, T, d_h)`` for a head. The sites (``SITES``):

    - ``("stream", l)``: the residual stream that layer (block) l reads; l = n_layers, the
      stream the unembedding reads (in a pre-LN ``DecoderLM``, before the final norm);
    - ``("query", l)``, ``("key", l)``, ``("value", l)``: what layer l's attention reads as
      its queries, keys or values (in a pre-LN block, the normalised stream);
    - ``("head", l, h)``: head h's output in layer l, before ``W_O`` mixes the heads."""
    seen = []

    def look(value: Tensor) -> Tensor:
        seen.append(value.detach().clone())
        return value

    _run_hooked(model, tokens, site, look)
    return seen[0]


def _positions_mask(positions, B: int, T: int) -> Tensor:
    """(B, T) boolean: True where the activation is patched."""
    if positions is None:
        return torch.ones(B, T, dtype=torch.bool)
    if isinstance(positions, Tensor) and positions.dtype == torch.bool:
        try:
            return positions.expand(B, T)
        except RuntimeError:
            raise ValueError(f"a boolean positions mask must broadcast to (B, T) = {(B, T)}; "
                             f"got {tuple(positions.shape)}") from None
    index = torch.as_tensor(positions)
    if index.dim() != 1 or index.is_floating_point() or index.numel() and not (
            0 <= int(index.min()) and int(index.max()) < T):
        raise ValueError(f"positions must be None, a boolean (B, T) mask or positions in "
                         f"0..{T - 1}; got {positions!r}")
    mask = torch.zeros(T, dtype=torch.bool)
    mask[index] = True
    return mask.expand(B, T)


def patch_activation(model, source, target: Tensor, site, *, positions=None):
    """Activation patching: what ``model`` returns on ``target`` tokens ``(B, T)`` when the
    activation at ``site`` is replaced by the one from ``source``, at ``positions``.

    ``model`` is an ``AttentionOnly`` (it returns ``(logits, weights)``) or a ``DecoderLM``
    (logits); ``site`` is one of ``record_activation``'s. ``source`` is either integer tokens
    of the same shape as ``target`` (the activation is recorded from ``model`` reading them),
    or a floating tensor, the activation itself (from ``record_activation``, perhaps of another
    model, such as an ``ablate``-d copy), of the shape the site has on ``target``.
    ``positions``: None (every position), positions in 0..T-1, or a boolean mask broadcasting
    to ``(B, T)``, True where the source's activation is used; elsewhere the target's own is
    kept. Everything downstream of the site is recomputed; nothing upstream changes. Runs
    without gradients; for comparable runs the model should be in eval mode (no dropout).

    The loss of the patched run, against the loss of the two unpatched ones, says how much of
    the difference between them passes through the site. Patching a run's activation into
    itself returns the run's output exactly; patching all of ``("stream", 0)`` returns the
    source's."""
    if not isinstance(target, Tensor) or target.dim() != 2 or target.is_floating_point():
        raise ValueError(f"target must be integer tokens (B, T); got "
                         f"{tuple(target.shape) if isinstance(target, Tensor) else target!r}")
    if not isinstance(source, Tensor):
        raise ValueError(f"source must be tokens or an activation tensor, got "
                         f"{type(source).__name__}")
    if source.is_floating_point():
        activation = source
    elif source.shape != target.shape:
        raise ValueError(f"source tokens {tuple(source.shape)} and target tokens "
                         f"{tuple(target.shape)} must have the same shape")
    else:
        activation = record_activation(model, source, site)
    B, T = target.shape
    mask = _positions_mask(positions, B, T)[..., None]  # (B, T, 1)

    def put(value: Tensor) -> Tensor:
        if activation.shape != value.shape:
            raise ValueError(f"the source's activation at {site!r} is "
                             f"{tuple(activation.shape)}; the target's is {tuple(value.shape)}")
        return torch.where(mask, activation.to(value.dtype), value)

    return _run_hooked(model, target, site, put)


# ---------------------------------------------------------------------------------------------
# Training


def ov_circuit(model: AttentionOnly, layer: int, head: int) -> Tensor:
    """The ``(V, V)`` matrix of head ``head`` of layer ``layer`` read from token to logit
    (Elhage et al., 2021): row a is what the head adds to the logits when it attends, with
    weight 1, to a position holding token a, through the token embedding, the head's value and
    output maps and the unembedding, ``E W_V^h W_O^h U``. The position embedding and what
    earlier layers wrote are left out; BOS, never predicted, has no row."""
    c = model.config
    if not (0 <= layer < c.n_layers and 0 <= head < c.n_heads):
        raise ValueError(f"layer {layer}, head {head}: the model has {c.n_layers} layers of "
                         f"{c.n_heads} heads")
    attn = model.layers[layer]
    hd = c.d_model // c.n_heads
    rows = slice(head * hd, (head + 1) * hd)  # the head's features
    with torch.no_grad():
        embed = model.embed.weight[:c.vocab_size]  # (V, D), without BOS
        w_v = attn.v_proj.weight[rows].T  # (D, hd): x -> the head's value
        w_o = attn.out_proj.weight[:, rows].T  # (hd, D): the head's share of the output
        return embed @ w_v @ w_o @ model.unembed.weight.T  # (V, V)


def copying_score(circuit: Tensor) -> float:
    """Elhage et al.'s copying score of a square circuit: the sum of its eigenvalues over the
    sum of their absolute values, 1 when every eigenvalue is positive (the head raises the
    logit of the token it reads), -1 when every one is negative."""
    if not isinstance(circuit, Tensor) or circuit.dim() != 2 or circuit.shape[0] != circuit.shape[1]:
        raise ValueError(f"the circuit must be a square matrix, got "
                         f"{tuple(circuit.shape) if isinstance(circuit, Tensor) else circuit!r}")
    eig = torch.linalg.eigvals(circuit)
    return float(eig.sum().real / eig.abs().sum())


def train(config: Config, seed: int) -> tuple[AttentionOnly, list[dict]]:
    """Train a fresh model with AdamW on the repeated-part loss of fresh batches.

    The model's initial weights come from ``seed`` (drawn without touching the global random
    state), the batches from a generator seeded with ``seed``. Every ``config.log_every``
    steps, from step 0 to ``config.steps``, the log gets a record: the step and what
    ``evaluate`` measures on the fixed evaluation sets. Returns the model and the log."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AttentionOnly(config)
    data = torch.Generator().manual_seed(seed)
    sets = evaluation_sets(config)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                            weight_decay=config.weight_decay)
    log = []
    for step in range(config.steps + 1):
        if step % config.log_every == 0:
            log.append({"step": step, **evaluate(model, sets)})
        if step == config.steps:
            break
        batch = make_batch(config.batch_size, config, config.train_lengths, data)
        logits, _ = model(batch.inputs)
        loss = repeated_loss(logits, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, log


def phase_threshold(config: Config) -> float:
    """Halfway between a uniform guess, ln(vocab_size), and the copy reference loss of the
    training-length evaluation set: the loss a run must fall below to have changed phase."""
    return (math.log(config.vocab_size) + copy_reference_loss(evaluation_sets(config)["train"])) / 2


def phase_change_step(log: list[dict], threshold: float) -> Optional[int]:
    """The first logged step whose repeated-part loss is below ``threshold``; None if none."""
    return next((record["step"] for record in log if record["loss"] < threshold), None)


# ---------------------------------------------------------------------------------------------
# Trained runs: written by tools/models.py (make models), read by the chapter


MODELS = pathlib.Path("models") / "induction"  # in the repository, beside code/
CODE_URL = stored.CODE_URL  # the address of the book's code/ folder; the setup cell sets it
_MAKE = "run `make models` to train the runs the chapter loads"


@dataclass
class Run:
    """A trained run: its name, config and seed, its log, and the model with its weights."""
    name: str
    config: Config
    seed: int
    log: list
    model: AttentionOnly


def save_run(folder: pathlib.Path, name: str, config: Config, seed: int,
             model: AttentionOnly, log: list[dict]) -> dict:
    """Write ``<name>.pt`` (the state_dict) and ``<name>.json`` (config, seed, log, torch's
    version and the .pt's SHA-256) into ``folder``; returns what the JSON holds."""
    head = {"name": name, "config": dataclasses.asdict(config), "seed": seed}
    return stored.save_run(folder, name, model.state_dict(), head, log)


def load_run(name: str, folder: Optional[pathlib.Path] = None) -> Run:
    """The trained run ``name``, read from ``folder``: by default the repository's
    models/induction/ when this file sits in its code/ folder, else models/induction/ beside
    this file (Colab, a download), where the run is fetched once from the published
    repository (``stored.locate``). The weights' SHA-256 must be the one their JSON records."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    config = Config.from_dict(record["config"])
    model = AttentionOnly(config)
    model.load_state_dict(state)
    model.eval()
    return Run(name, config, record["seed"], record["log"], model)
