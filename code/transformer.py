"""The Transformer block, built on the book's ``MultiHeadAttention``, written to be read.

One block is attention followed by a position-wise MLP, each wrapped in a residual connection
and a layer normalisation. Two orders are in use:

    post-LN (Vaswani et al. 2017):       x = LN1(x + Attn(x));   x = LN2(x + MLP(x))
    pre-LN  (GPT-2 and most models since): x = x + Attn(LN1(x));  x = x + MLP(LN2(x))

``norm_first=True`` gives pre-LN, as in ``torch.nn.TransformerEncoderLayer``, whose weights
``TransformerBlock.from_torch`` copies; the tests check that both give the same output, masked
or causal, in both orders and with either activation.

Shapes are batch first: ``x`` is ``(B, T, D)`` with ``D = d_model``. The mask convention is
the module's (code/attention.py): a boolean ``attn_mask`` is True where a query *may attend*;
``torch.nn.TransformerEncoderLayer``'s ``src_mask`` is True where it may *not*.

The experiments of chapter "The Transformer block" are here too, for tools/models.py (``make
models``) to run once and commit to models/block/, and for the chapter to load: post-LN against
pre-LN learning to reverse a sequence with and without a warm-up (``ReversalConfig``,
``train_reversal``), and the gradients of both orders at initialisation, over depth
(``GradientConfig``, ``measure_gradients``), also with GPT-2's scaled initialisation of the
residual projections (``GradientConfig(scaled=True)``, ``residual_scale``); ``save_run`` and
``load_run`` write and read them with the SHA-256 of their tensors. All float64 and
deterministic: the same config and seed give the same log.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import stored
from attention import KVCache, MultiHeadAttention

__all__ = ["TransformerBlock", "DecoderLM", "ACTIVATIONS", "ReversalConfig", "reversal_batch",
           "reversal_model", "reversal_loss", "evaluate_reversal", "train_reversal",
           "GradientConfig", "residual_scale", "gradients_at_init", "measure_gradients",
           "save_run", "load_run",
           "Run"]

# The MLP's nonlinearity. "swiglu" is a gated unit (Shazeer 2020): the first linear layer
# gives 2 * d_ff features, a gate g and a value u, and the MLP keeps silu(g) * u.
ACTIVATIONS = ("relu", "gelu", "swiglu")


class TransformerBlock(nn.Module):
    """Self-attention and a position-wise MLP, each with a residual connection and a layer norm.

    ``d_model`` is the width of the residual stream, ``num_heads`` the attention heads (a divisor
    of ``d_model``), ``d_ff`` the MLP's hidden width. ``norm_first`` picks the order (True: pre-LN;
    False: post-LN, as in the 2017 paper). ``dropout`` is applied where PyTorch's encoder layer
    applies it: to the attention weights, after the MLP's activation, and to each branch before
    it is added to the residual stream. ``bias`` gives every linear map and layer norm a bias.

    For ``relu`` and ``gelu``, as many parameters as ``torch.nn.TransformerEncoderLayer``, the
    MLP's and the norms' under the same names (its attention stacks W_Q, W_K and W_V in one
    matrix, this block's keeps three; see ``from_torch``); ``swiglu``'s first linear map is
    twice as wide.
    """

    def __init__(
        self, d_model: int, num_heads: int, d_ff: int, *, norm_first: bool = True,
        activation: str = "gelu", dropout: float = 0.0, bias: bool = True,
        layer_norm_eps: float = 1e-5, device=None, dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if d_ff < 1:
            raise ValueError(f"d_ff must be positive, got {d_ff}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        place = {"device": device, "dtype": dtype}
        self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
        self.norm_first, self.activation = norm_first, activation
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias, **place)
        hidden = 2 * d_ff if activation == "swiglu" else d_ff
        self.linear1 = nn.Linear(d_model, hidden, bias=bias, **place)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias, **place)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **place)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **place)
        self.dropout = nn.Dropout(dropout)  # after the MLP's activation
        self.dropout1 = nn.Dropout(dropout)  # the attention branch
        self.dropout2 = nn.Dropout(dropout)  # the MLP branch

    def forward(
        self, x: Tensor, *, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
        need_weights: bool = False, cache: Optional[KVCache] = None,
    ):
        """The block applied to ``x`` ``(B, T, d_model)``; returns ``(B, T, d_model)``.

        ``attn_mask`` (True = may attend, or a float mask added to the scores) broadcasts to
        ``(B, H, T, T)``; ``is_causal`` lets position i attend to positions up to i. With
        ``need_weights`` the attention weights ``(B, H, T, S)`` are returned too, as
        ``(output, weights)``. A ``cache`` (``KVCache``) makes the block decode: ``x`` holds
        the new positions only, and attention also reads the cached ones.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"TransformerBlock expects x of shape (B, T, d_model) with "
                             f"d_model={self.d_model}; got {shape}")
        mask = {"attn_mask": attn_mask, "is_causal": is_causal, "cache": cache}
        if self.norm_first:
            attended, weights = self._attention(self.norm1(x), **mask)
            x = x + attended
            x = x + self._mlp(self.norm2(x))
        else:
            attended, weights = self._attention(x, **mask)
            x = self.norm1(x + attended)
            x = self.norm2(x + self._mlp(x))
        return (x, weights) if need_weights else x

    def _attention(self, x: Tensor, **mask) -> tuple[Tensor, Tensor]:
        out, weights = self.self_attn(x, x, x, **mask)
        return self.dropout1(out), weights

    def _mlp(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)  # the exact GELU, x * Phi(x), as PyTorch's default
        else:
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        return self.dropout2(self.linear2(self.dropout(h)))

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> "TransformerBlock":
        """A block with the weights of ``layer``, a ``torch.nn.TransformerEncoderLayer`` built
        with ``batch_first=True``, either ``norm_first``, and ReLU or (exact) GELU.

        The two then compute the same function, with one difference of convention: pass
        ``attn_mask=~src_mask`` here for a boolean ``src_mask`` there.
        """
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"from_torch expects torch.nn.TransformerEncoderLayer, "
                            f"got {type(layer).__name__}")
        if not layer.self_attn.batch_first:
            raise ValueError("from_torch needs a layer built with batch_first=True: this block "
                             "reads (B, T, d_model), the layer would read (T, B, d_model)")
        activation = _activation_name(layer.activation)
        attn = layer.self_attn
        weight = layer.linear1.weight
        new = cls(
            attn.embed_dim, attn.num_heads, layer.linear1.out_features,
            norm_first=layer.norm_first, activation=activation, dropout=layer.dropout.p,
            bias=layer.linear1.bias is not None, layer_norm_eps=layer.norm1.eps,
            device=weight.device, dtype=weight.dtype,
        )
        new.self_attn = MultiHeadAttention.from_torch(attn)
        with torch.no_grad():
            for name in ("linear1", "linear2", "norm1", "norm2"):
                theirs, ours = getattr(layer, name), getattr(new, name)
                ours.weight.copy_(theirs.weight)
                if theirs.bias is not None:
                    ours.bias.copy_(theirs.bias)
        new.train(layer.training)
        return new


def _activation_name(activation) -> str:
    """"relu" or "gelu" for what an encoder layer holds (a function or a module)."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or isinstance(activation, nn.GELU) and activation.approximate == "none":
        return "gelu"
    raise ValueError(f"from_torch copies layers whose activation is ReLU or the exact GELU; "
                     f"got {activation!r}")


class DecoderLM(nn.Module):
    """A decoder-only language model: token embedding plus a learned position embedding, a
    stack of ``num_layers`` causal ``TransformerBlock``s, a final layer norm when the blocks
    are pre-LN (post-LN blocks end on a norm already, as in GPT-2 against the 2017 paper), and
    a linear map to the vocabulary, whose weight is the embedding's with ``tie_weights``.

    ``forward(tokens)`` takes ``(B, T)`` integer tokens and returns ``(B, T, vocab_size)``
    logits, row t predicting token t + 1. With ``caches`` (one ``KVCache`` per block, from
    ``new_caches()``) it decodes: ``tokens`` are the new positions only, placed after the
    ``caches[0].seen`` already processed. With ``need_weights`` it returns ``(logits,
    weights)``, ``weights`` a list of each block's attention weights ``(B, H, T, S)``.
    With ``attn_mask`` every block uses that mask in place of the causal one (see
    ``forward``), for instance a sliding window, ``causal_mask(T, window=w)``.
    """

    def __init__(
        self, vocab_size: int, max_len: int, d_model: int, num_heads: int, d_ff: int,
        num_layers: int, *, norm_first: bool = True, activation: str = "gelu",
        dropout: float = 0.0, tie_weights: bool = False, device=None, dtype=None,
    ):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("max_len", max_len),
                            ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        place = {"device": device, "dtype": dtype}
        self.vocab_size, self.max_len, self.norm_first = vocab_size, max_len, norm_first
        self.embed = nn.Embedding(vocab_size, d_model, **place)
        self.position = nn.Embedding(max_len, d_model, **place)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, norm_first=norm_first,
                             activation=activation, dropout=dropout, **place)
            for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(d_model, **place) if norm_first else nn.Identity()
        self.unembed = nn.Linear(d_model, vocab_size, bias=False, **place)
        if tie_weights:
            self.unembed.weight = self.embed.weight

    def new_caches(self) -> list[KVCache]:
        """One empty key-value cache per block, for ``forward(..., caches=...)``."""
        return [KVCache() for _ in self.blocks]

    def forward(self, tokens: Tensor, *, caches: Optional[list[KVCache]] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None):
        """Logits ``(B, T, vocab_size)`` for integer ``tokens`` ``(B, T)``.

        ``caches``: None, or one ``KVCache`` per block to decode with (see the class).
        ``need_weights``: also return each block's weights ``(B, H, T, S)``, as
        ``(logits, weights)``. ``attn_mask``: None (causal attention), or a mask that every
        block uses *instead of* the causal mask: boolean, True where a query may attend, or
        floating, added to the scores; ``(T, T)``, or 4-D and broadcasting to
        ``(B, H, T, T)``. ``causal_mask(T)`` gives the default's logits; a mask that lets a
        query see a later position lets it read the token it predicts. Not with ``caches``
        (a cache makes its own mask).
        """
        if (not isinstance(tokens, Tensor) or tokens.dim() != 2
                or tokens.dtype not in (torch.int64, torch.int32)):
            shape = (tuple(tokens.shape), tokens.dtype) if isinstance(tokens, Tensor) else (
                type(tokens).__name__)
            raise ValueError(f"DecoderLM expects integer tokens of shape (B, T); got {shape}")
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches must hold one KVCache per block ({len(self.blocks)}), "
                             f"got {len(caches)}")
        start = 0 if caches is None else caches[0].seen
        T = tokens.shape[1]
        if attn_mask is not None:
            self._check_mask(attn_mask, tokens, caches)
        if start + T > self.max_len:
            raise ValueError(f"positions {start}..{start + T - 1} of tokens {tuple(tokens.shape)}"
                             f" go past max_len={self.max_len}")
        if T and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"tokens must lie in [0, {self.vocab_size}); got values from "
                             f"{int(tokens.min())} to {int(tokens.max())}")
        where = torch.arange(start, start + T, device=tokens.device)
        x = self.drop(self.embed(tokens) + self.position(where))  # (B, T, d_model)
        weights = []
        mask = {"is_causal": True} if attn_mask is None else {"attn_mask": attn_mask}
        for i, block in enumerate(self.blocks):
            x, w = block(x, need_weights=True, cache=None if caches is None else caches[i],
                         **mask)
            weights.append(w)  # (B, H, T, S)
        logits = self.unembed(self.final_norm(x))  # (B, T, vocab_size)
        return (logits, weights) if need_weights else logits

    def _check_mask(self, attn_mask, tokens: Tensor, caches) -> None:
        """Raise, naming the shapes, unless ``attn_mask`` can replace the causal mask."""
        if caches is not None:
            raise ValueError("give attn_mask or caches, not both: a KVCache makes the mask of "
                             "the positions it holds")
        if not isinstance(attn_mask, Tensor):
            raise ValueError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be boolean (True = may attend) or floating "
                             f"(added to the scores), got dtype {attn_mask.dtype}")
        B, T = tokens.shape
        target = (B, self.blocks[0].num_heads, T, T)
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits or attn_mask.dim() not in (2, 4):  # a 3-D mask would read as (B * H, ...)
            raise ValueError(f"attn_mask must be (T, T) or 4-D, broadcasting to (B, H, T, T) = "
                             f"{target} for tokens {tuple(tokens.shape)}; got "
                             f"{tuple(attn_mask.shape)}")


# ---------------------------------------------------------------------------------------------
# The experiments of chapter "The Transformer block": run by tools/models.py (make models),
# committed to models/block/, loaded by the chapter

DTYPE = torch.float64
MODELS = pathlib.Path("models") / "block"  # in the repository, beside code/
EVAL_SEED = 4321  # the generator of the fixed evaluation sequences, the same for every run
_MAKE = "run `make models` to train the runs the chapter loads"


def _positive_ints(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive integer, "
                             f"got {value!r}")


@dataclass(frozen=True)
class ReversalConfig:
    """The warm-up experiment. A ``DecoderLM`` of ``num_layers`` blocks (pre-LN if
    ``norm_first``, else post-LN; ReLU; every matrix of the blocks drawn by Glorot's uniform
    initialisation) reads ``half`` random tokens of ``vocab``, a separator (token ``vocab``)
    and learns to write the ``half`` tokens reversed. Adam with ``betas`` at the rate ``lr``,
    reached at once (``warmup = 0``) or linearly over the first ``warmup`` steps, on
    ``batch_size`` fresh sequences a step, for ``steps`` steps; ``eval_size`` fixed sequences
    evaluate the model."""

    norm_first: bool = False
    warmup: int = 0
    vocab: int = 16
    half: int = 4
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    num_layers: int = 6
    batch_size: int = 16
    steps: int = 60
    lr: float = 0.004
    betas: tuple = (0.9, 0.98)
    eval_size: int = 128

    def __post_init__(self):
        _positive_ints(self, ("vocab", "half", "d_model", "num_heads", "d_ff", "num_layers",
                              "batch_size", "steps", "eval_size"))
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"ReversalConfig.warmup must be an integer >= 0, got "
                             f"{self.warmup!r}")
        object.__setattr__(self, "betas", tuple(self.betas))  # JSON gives a list

    @classmethod
    def from_dict(cls, values: dict) -> "ReversalConfig":
        return cls(**values)

    def learning_rate(self, step: int) -> float:
        """The rate of step ``step`` (from 0): ``lr * (step + 1) / warmup`` during the
        warm-up, ``lr`` after it, ``lr`` throughout without one."""
        ramp = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        return self.lr * ramp


def reversal_batch(config: ReversalConfig, generator: torch.Generator,
                   batch: Optional[int] = None) -> Tensor:
    """``(batch, 2 * half + 1)`` sequences (``batch`` defaults to ``config.batch_size``):
    ``half`` random tokens, the separator ``config.vocab``, the ``half`` tokens reversed."""
    batch = config.batch_size if batch is None else batch
    tokens = torch.randint(config.vocab, (batch, config.half), generator=generator)
    sep = torch.full((batch, 1), config.vocab)
    return torch.cat([tokens, sep, tokens.flip(1)], dim=1)


def reversal_model(config: ReversalConfig) -> DecoderLM:
    """A fresh float64 ``DecoderLM`` for the task, every matrix of its blocks re-drawn by
    Glorot's uniform initialisation (as in Xiong et al.'s analysis); its weights come from
    the global random state (``train_reversal`` seeds it)."""
    model = DecoderLM(config.vocab + 1, 2 * config.half, config.d_model, config.num_heads,
                      config.d_ff, config.num_layers, norm_first=config.norm_first,
                      activation="relu", dtype=DTYPE)
    for p in model.blocks.parameters():
        if p.dim() > 1:  # every matrix of the blocks
            nn.init.xavier_uniform_(p)
    return model


def reversal_loss(model: DecoderLM, sequences: Tensor, half: int) -> Tensor:
    """The cross-entropy of the model's predictions of the reversed half of ``sequences``
    ``(B, 2 * half + 1)``: the model reads all but the last token, and row t predicts token
    t + 1, so rows ``half`` to ``2 * half - 1`` predict the reversed tokens."""
    logits = model(sequences[:, :-1])  # (B, 2 * half, vocab + 1)
    return F.cross_entropy(logits[:, half:].flatten(0, 1), sequences[:, half + 1:].flatten())


def evaluate_reversal(model: DecoderLM, config: ReversalConfig) -> dict:
    """On ``config.eval_size`` fixed sequences (drawn with ``EVAL_SEED``): the loss of the
    reversed half (``reversal_loss``) and the share of its tokens that the model's most likely
    prediction gets right."""
    sequences = reversal_batch(config, torch.Generator().manual_seed(EVAL_SEED),
                               config.eval_size)
    with torch.no_grad():
        logits = model(sequences[:, :-1])[:, config.half:]
        loss = F.cross_entropy(logits.flatten(0, 1), sequences[:, config.half + 1:].flatten())
        right = (logits.argmax(-1) == sequences[:, config.half + 1:]).double().mean()
    return {"loss": float(loss), "accuracy": float(right)}


def train_reversal(config: ReversalConfig, seed: int, *,
                   until: Optional[int] = None) -> tuple[DecoderLM, dict]:
    """Train a fresh model (``reversal_model``, its weights from ``seed``, drawn without
    touching the global random state) on batches from a generator seeded with ``1000 +
    seed``. The log holds, for every step, the rate and the batch's loss (before the step),
    and under "eval" ``evaluate_reversal`` after the last step. ``until`` stops the same run
    after that many steps: its log is the start of the full run's, without the evaluation.
    Returns the model and the log."""
    until = config.steps if until is None else until
    if not 0 <= until <= config.steps:
        raise ValueError(f"until must lie in [0, {config.steps}], got {until}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the initial weights
        model = reversal_model(config)
    data = torch.Generator().manual_seed(1000 + seed)  # the batches
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, betas=config.betas)
    log = {"lr": [], "loss": [], "eval": []}
    for step in range(until):
        rate = config.learning_rate(step)
        opt.param_groups[0]["lr"] = rate
        loss = reversal_loss(model, reversal_batch(config, data), config.half)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log["lr"].append(rate)
        log["loss"].append(loss.item())
    if until == config.steps:
        log["eval"].append({"step": config.steps, **evaluate_reversal(model, config)})
    return model, log


@dataclass(frozen=True)
class GradientConfig:
    """The measurement of gradients at initialisation: stacks of each depth of ``depths``, in
    both orders, of ``TransformerBlock``s of width ``d_model`` (``num_heads`` heads, d_ff = 4
    d_model, ReLU, Glorot's initialisation), reading ``batch_size`` random sequences of
    ``length`` positions with entries of unit variance, a final layer norm for pre-LN, a
    linear readout to ``n_classes`` classes and the cross-entropy against random targets;
    ``seeds`` seeds, 0 to ``seeds - 1``. With ``scaled`` the two matrices of each block that
    write into the residual stream, attention's W_O (``out_proj``) and the MLP's W_down
    (``linear2``), are multiplied by 1 / sqrt(2 * depth) after Glorot's initialisation, as
    GPT-2 scales its residual projections (``residual_scale``)."""

    depths: tuple = (2, 4, 8, 16, 32)
    seeds: int = 4
    d_model: int = 64
    num_heads: int = 4
    n_classes: int = 32
    batch_size: int = 16
    length: int = 16
    scaled: bool = False

    def __post_init__(self):
        _positive_ints(self, ("seeds", "d_model", "num_heads", "n_classes", "batch_size",
                              "length"))
        if not isinstance(self.scaled, bool):
            raise ValueError(f"GradientConfig.scaled must be True or False, got "
                             f"{self.scaled!r}")
        object.__setattr__(self, "depths", tuple(self.depths))  # JSON gives a list

    @classmethod
    def from_dict(cls, values: dict) -> "GradientConfig":
        return cls(**values)


ORDERS = {"post-LN": False, "pre-LN": True}  # the orders' names and their norm_first


def residual_scale(depth: int) -> float:
    """GPT-2's factor for the residual projections of a stack of ``depth`` blocks,
    1 / sqrt(2 * depth): each block adds two branches to the stream, so the stream receives
    2 * depth additions, and dividing each by sqrt(2 * depth) keeps their summed variance at
    initialisation independent of the depth (Radford et al. 2019; nanoGPT's 0.02 /
    sqrt(2 * n_layer))."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive integer, got {depth!r}")
    return (2 * depth) ** -0.5


def gradients_at_init(config: GradientConfig, depth: int, norm_first: bool,
                      seed: int) -> tuple[list[float], float]:
    """One stack at initialisation: the Frobenius norm of the loss's gradient with respect to
    ``W_down`` (``linear2.weight``) of each block, first to last, and the root mean square of
    the stream at the top of the stack. Weights from ``seed`` (without touching the global
    random state), inputs and targets from a generator seeded with ``100 + seed``."""
    d = config.d_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = nn.ModuleList(TransformerBlock(d, config.num_heads, 4 * d,
                                                norm_first=norm_first, activation="relu",
                                                dtype=DTYPE) for _ in range(depth))
        for p in blocks.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if config.scaled:
            with torch.no_grad():
                for b in blocks:  # the two projections that write into the stream
                    b.self_attn.out_proj.weight.mul_(residual_scale(depth))
                    b.linear2.weight.mul_(residual_scale(depth))
        final = nn.LayerNorm(d, dtype=DTYPE) if norm_first else nn.Identity()
        readout = nn.Linear(d, config.n_classes, dtype=DTYPE)
    gen = torch.Generator().manual_seed(100 + seed)
    stream = torch.randn(config.batch_size, config.length, d, generator=gen, dtype=DTYPE)
    targets = torch.randint(config.n_classes, (config.batch_size, config.length), generator=gen)
    for block in blocks:
        stream = block(stream, is_causal=True)
    logits = readout(final(stream))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return ([float(b.linear2.weight.grad.norm()) for b in blocks],
            float(stream.detach().pow(2).mean().sqrt()))


def measure_gradients(config: GradientConfig, depths: Optional[tuple] = None) -> dict:
    """``gradients_at_init`` for every order, depth (of ``depths``, default the config's) and
    seed: ``{order: {str(depth): {"grads": [per seed: per block], "rms": [per seed]}}}``."""
    out = {}
    for order, norm_first in ORDERS.items():
        out[order] = {}
        for depth in config.depths if depths is None else depths:
            seeds = [gradients_at_init(config, depth, norm_first, s) for s in range(config.seeds)]
            out[order][str(depth)] = {"grads": [g for g, _ in seeds], "rms": [r for _, r in seeds]}
    return out


def _gradient_tensors(log: dict) -> dict:
    """The measurement as float64 tensors: ``"<order>/<depth>/grads"`` (seeds, depth) and
    ``"<order>/<depth>/rms"`` (seeds,)."""
    return {f"{order}/{depth}/{key}": torch.tensor(values, dtype=DTYPE)
            for order, by_depth in log.items() for depth, record in by_depth.items()
            for key, values in record.items()}


@dataclass
class Run:
    """A committed run of models/block/: its name, kind (``"reversal"``: a trained model, or
    ``"gradients"``: a measurement), config and seed, its log, the model (``None`` for a
    measurement) and the CPU seconds ``make models`` took."""
    name: str
    kind: str
    config: Union[ReversalConfig, GradientConfig]
    seed: Optional[int]
    log: dict
    model: Optional[DecoderLM] = None
    cpu_seconds: Optional[float] = None


def save_run(folder: pathlib.Path, name: str, config, seed: Optional[int], log: dict,
             model: Optional[DecoderLM] = None, cpu_seconds: Optional[float] = None) -> dict:
    """Write ``<name>.pt`` and ``<name>.json`` into ``folder``: for a ``ReversalConfig`` the
    model's state_dict, for a ``GradientConfig`` the measurement as tensors (the log's
    numbers); the JSON holds the kind, config, seed, CPU seconds, log, torch's version and the
    .pt's SHA-256."""
    if isinstance(config, ReversalConfig):
        if model is None:
            raise ValueError("a reversal run is saved with its model")
        kind, state = "reversal", model.state_dict()
    elif isinstance(config, GradientConfig):
        kind, state = "gradients", _gradient_tensors(log)
    else:
        raise TypeError(f"config must be a ReversalConfig or a GradientConfig, got "
                        f"{type(config).__name__}")
    head = {"name": name, "kind": kind, "config": dataclasses.asdict(config), "seed": seed,
            "cpu_seconds": cpu_seconds}
    return stored.save_run(folder, name, state, head, log)


def load_run(name: str, folder: Optional[pathlib.Path] = None) -> Run:
    """The committed run ``name``, read from ``folder``: by default the repository's
    models/block/, else models/block/ beside this file (Colab, a download), fetched once. The
    tensors' SHA-256 must be the one their JSON records; a measurement's tensors must be its
    log's numbers."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    kind = record["kind"]
    if kind == "reversal":
        config = ReversalConfig.from_dict(record["config"])
        model = reversal_model(config)
        model.load_state_dict(state)
        model.eval()
    elif kind == "gradients":
        config, model = GradientConfig.from_dict(record["config"]), None
        expected = _gradient_tensors(record["log"])
        if sorted(state) != sorted(expected) or any(
                not torch.equal(state[k], expected[k]) for k in expected):  # a copy: bitwise
            raise ValueError(f"{name}.pt does not hold the numbers of {name}.json's log")
    else:
        raise ValueError(f"{name}.json: unknown kind {kind!r}")
    return Run(name, kind, config, record["seed"], record["log"], model,
               record.get("cpu_seconds"))
