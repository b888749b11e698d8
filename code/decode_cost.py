"""What one decoding step costs a whole decoder-only model: weights, cache and arithmetic.

Chapter "Inference: the key-value cache" counts one attention layer's cached step: ``c_proj``
multiply-adds per token for the four projections, ``2 t H d_h`` more per sequence for the scores
and the weighted sum over its ``t`` keys, and the bytes of the weights and of the cache that the
step must read (its proposition "The arithmetic intensity of a decoding step"). A model's layer
also has an MLP, and the model ends in a readout to the vocabulary; this module counts them all,
for a configuration as a paper's table gives it (``DecoderConfig``), and from the counts:

``decode_step(config, batch, length)``
    multiply-adds, bytes of weights and bytes of cache of one step for ``batch`` sequences (B),
    each attending over ``length`` keys (t, its new one included), for one layer's attention,
    one layer's MLP, one layer, or the whole model.
``critical_batch(config, length, machine)``
    the smallest batch at which the step's arithmetic intensity reaches the machine's balance
    (the step turns compute-bound), with or without the cache's bytes; None if no batch does.
``longest_context(config, machine)``
    the largest ``length`` at which some batch still turns the step compute-bound.
``roofline_time(config, machine, batch, length)``
    the roofline's lower bound on the step's time: its arithmetic at the machine's peak rate and
    its bytes at the peak bandwidth; a bound, not a measurement.
``fitting_batch(config, machine, length)``
    the most sequences whose caches fit in the machine's memory beside the weights.

Counts are exact integers and the machine's balance an exact fraction, so that every number is
the same on every computer. Multiply-adds, as in the chapter: a FLOP/s figure counts two
floating-point operations per multiply-add. Left out, as O(B d_model) per layer against the
O(d_model^2) of the matrices: the norms, the biases, the embedding rows a step looks up, the
activations read and written between the products. The bytes are those that must be read at
least, each weight and each cached key or value once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

__all__ = ["DecoderConfig", "StepCost", "Machine", "A100", "decode_step", "parameter_count",
           "critical_batch", "longest_context", "roofline_time", "fitting_batch"]

SCOPES = ("attention", "mlp", "layer", "model")


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only Transformer's sizes: ``n_layers`` pre-norm blocks of attention with
    ``num_heads`` query heads and ``num_kv_heads`` key-value heads (G, dividing the heads) of
    width ``head_dim`` (default ``d_model // num_heads``), and an MLP of hidden width ``d_ff``:
    three ``d_model x d_ff`` matrices if ``gated`` (SwiGLU: W_gate, W_up, W_down), two
    otherwise (W_up, W_down); then a final norm and a readout to ``n_vocab`` logits.

    For ``parameter_count`` only: ``tied`` (the readout is the embedding's matrix),
    ``norm_params`` per norm and per feature (1: RMSNorm's gain; 2: LayerNorm's gain and
    shift), ``bias`` (every linear map of the blocks has one; the readout has none) and
    ``n_positions`` (learned position embeddings; 0 for rotary positions). ``source`` says
    where the numbers come from.
    """

    name: str
    n_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    gated: bool
    n_vocab: int
    head_dim: Optional[int] = None
    tied: bool = False
    norm_params: int = 1
    bias: bool = False
    n_positions: int = 0
    source: str = ""

    def __post_init__(self):
        owner = f"DecoderConfig {self.name!r}"
        for field in ("n_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "n_vocab"):
            _positive_int(owner, field, getattr(self, field))
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"{owner}: d_model={self.d_model} is not a multiple of "
                                 f"num_heads={self.num_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        _positive_int(owner, "head_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{owner}: num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        for field in ("gated", "tied", "bias"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{owner}: {field} must be True or False, "
                                 f"got {getattr(self, field)!r}")
        if self.norm_params not in (1, 2) or isinstance(self.norm_params, bool):
            raise ValueError(f"{owner}: norm_params must be 1 (RMSNorm) or 2 (LayerNorm), "
                             f"got {self.norm_params!r}")
        if (isinstance(self.n_positions, bool) or not isinstance(self.n_positions, int)
                or self.n_positions < 0):
            raise ValueError(f"{owner}: n_positions must be a whole number >= 0, "
                             f"got {self.n_positions!r}")

    @property
    def attention_weights(self) -> int:
        """c_proj: the numbers of W_Q, W_K, W_V and W_O of one layer, which are also its
        multiply-adds per token."""
        H, G, d_h, d = self.num_heads, self.num_kv_heads, self.head_dim, self.d_model
        return 2 * d * H * d_h + 2 * d * G * d_h

    @property
    def mlp_weights(self) -> int:
        """c_mlp: the numbers of one layer's MLP matrices (3 or 2 of d_model x d_ff)."""
        return (3 if self.gated else 2) * self.d_model * self.d_ff

    @property
    def readout_weights(self) -> int:
        """The readout's d_model x n_vocab matrix."""
        return self.d_model * self.n_vocab

    @property
    def weights(self) -> int:
        """c_model: every matrix a decoding step reads, all layers and the readout."""
        return self.n_layers * (self.attention_weights + self.mlp_weights) + self.readout_weights

    def cache_per_position(self, n_bytes: int = 2) -> int:
        """Bytes of keys and values that one position of one sequence holds in all layers."""
        return 2 * self.n_layers * self.num_kv_heads * self.head_dim * n_bytes


def parameter_count(config: DecoderConfig) -> int:
    """Every parameter of the model: the layers' matrices, biases and norms, the final norm,
    the embedding (and position embeddings), and the readout unless it is tied."""
    c = config
    biases = 0
    if c.bias:
        attention = c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim + c.d_model
        mlp = (2 if c.gated else 1) * c.d_ff + c.d_model
        biases = attention + mlp
    norms = c.norm_params * c.d_model
    per_layer = c.attention_weights + c.mlp_weights + biases + 2 * norms
    embeddings = (c.n_vocab + c.n_positions) * c.d_model
    readout = 0 if c.tied else c.readout_weights
    return c.n_layers * per_layer + norms + embeddings + readout


@dataclass(frozen=True)
class StepCost:
    """What a decoding step computes and reads: ``macs`` multiply-adds, ``weight_bytes`` of
    matrices and ``cache_bytes`` of cached keys and values."""

    macs: int
    weight_bytes: int
    cache_bytes: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def intensity(self) -> Fraction:
        """Multiply-adds per byte read, exactly."""
        return Fraction(self.macs, self.bytes)


def _check_step(batch, length, n_bytes) -> None:
    _positive_int("decode_step", "batch", batch)
    _positive_int("decode_step", "length", length)
    _positive_int("decode_step", "n_bytes", n_bytes)


def decode_step(config: DecoderConfig, batch: int, length: int, *, n_bytes: int = 2,
                scope: str = "model") -> StepCost:
    """One decoding step of ``batch`` sequences (B), each attending over ``length`` keys (t,
    its new one included), with ``n_bytes`` bytes per number.

    ``scope`` is ``"attention"`` (one layer's attention: B c_proj + 2 B t H d_h multiply-adds,
    c_proj weights, 2 B t G d_h cached numbers), ``"mlp"`` (one layer's MLP: B c_mlp and c_mlp
    weights, no cache), ``"layer"`` (both) or ``"model"`` (every layer and the readout:
    B d_model n_vocab multiply-adds and d_model n_vocab weights more).
    """
    _check_step(batch, length, n_bytes)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    c, B, t = config, batch, length
    attention = StepCost(B * c.attention_weights + 2 * B * t * c.num_heads * c.head_dim,
                         c.attention_weights * n_bytes,
                         2 * B * t * c.num_kv_heads * c.head_dim * n_bytes)
    mlp = StepCost(B * c.mlp_weights, c.mlp_weights * n_bytes, 0)
    if scope == "attention":
        return attention
    if scope == "mlp":
        return mlp
    layers = 1 if scope == "layer" else c.n_layers
    readout = 0 if scope == "layer" else c.readout_weights
    return StepCost(layers * (attention.macs + mlp.macs) + B * readout,
                    layers * (attention.weight_bytes + mlp.weight_bytes) + readout * n_bytes,
                    layers * attention.cache_bytes)


@dataclass(frozen=True)
class Machine:
    """A processor as its datasheet gives it: ``flops`` peak floating-point operations per
    second (two per multiply-add), ``bandwidth`` bytes per second from its memory, ``memory``
    bytes of it. ``balance`` is the chapter's I_hw, multiply-adds per byte."""

    name: str
    flops: int
    bandwidth: int
    memory: int

    def __post_init__(self):
        for field in ("flops", "bandwidth", "memory"):
            _positive_int(f"Machine {self.name!r}", field, getattr(self, field))

    @property
    def balance(self) -> Fraction:
        return Fraction(self.flops, 2 * self.bandwidth)


# NVIDIA's A100 datasheet: the 80GB SXM module, BFLOAT16 on the tensor cores without sparsity
# (312 TFLOPS), HBM2e at 2,039 GB/s; its 80GB taken as 80 * 10^9 bytes.
A100 = Machine("A100 80GB SXM, bfloat16", 312 * 10**12, 2039 * 10**9, 80 * 10**9)


def critical_batch(config: DecoderConfig, length: int, machine: Machine, *, n_bytes: int = 2,
                   cache: bool = True, scope: str = "model") -> Optional[int]:
    """The smallest batch B whose step reaches the machine's balance, macs / bytes >= I_hw;
    None if no batch does. With ``cache=False`` the cache's bytes are left out, as if reading
    it cost nothing.

    The step's multiply-adds are B a and its bytes W + B c (a and c per sequence, W the
    weights'), so the condition is B (a - I_hw c) >= I_hw W: B* = ceil(I_hw W / (a - I_hw c))
    when a > I_hw c, and no batch otherwise.
    """
    one = decode_step(config, 1, length, n_bytes=n_bytes, scope=scope)
    two = decode_step(config, 2, length, n_bytes=n_bytes, scope=scope)
    a = two.macs - one.macs  # per sequence
    c = (two.cache_bytes - one.cache_bytes) if cache else 0
    W = one.weight_bytes
    room = a - machine.balance * c
    if room <= 0:
        return None
    return max(1, math.ceil(machine.balance * W / room))


def longest_context(config: DecoderConfig, machine: Machine, *, n_bytes: int = 2,
                    scope: str = "model") -> Optional[int]:
    """The largest length t at which some batch turns the step compute-bound (0 if none);
    None if every length has one, which happens when attention alone reaches the balance,
    H >= I_hw n_bytes G."""
    one, two = (decode_step(config, 1, t, n_bytes=n_bytes, scope=scope) for t in (1, 2))
    alpha = two.macs - one.macs  # multiply-adds per sequence per key
    gamma = two.cache_bytes - one.cache_bytes  # bytes per sequence per key
    base = one.macs - alpha  # per sequence, before the keys: the weights' multiply-adds
    excess = machine.balance * gamma - alpha
    if excess <= 0:
        return None
    return max(0, math.ceil(base / excess) - 1)  # base + t (alpha - I_hw gamma) > 0


def roofline_time(config: DecoderConfig, machine: Machine, batch: int, length: int, *,
                  n_bytes: int = 2) -> tuple[float, float]:
    """(seconds of arithmetic at the peak rate, seconds of reading at the peak bandwidth) for
    the whole model's step. The larger of the two is a lower bound on the step's time (the
    roofline): a real step also waits for what the count leaves out, and reaches neither peak."""
    step = decode_step(config, batch, length, n_bytes=n_bytes)
    return (float(Fraction(2 * step.macs, machine.flops)),
            float(Fraction(step.bytes, machine.bandwidth)))


def fitting_batch(config: DecoderConfig, machine: Machine, length: int, *,
                  n_bytes: int = 2) -> int:
    """The most sequences of ``length`` positions whose caches fit in the machine's memory
    beside every parameter (activations and the rest left out); 0 if the weights alone do not
    fit."""
    _positive_int("fitting_batch", "length", length)
    _positive_int("fitting_batch", "n_bytes", n_bytes)
    room = machine.memory - parameter_count(config) * n_bytes
    return max(0, room // (config.cache_per_position(n_bytes) * length))
