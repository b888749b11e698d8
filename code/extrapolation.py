"""Train short, test long: the task, the models and the training of chapter "Position".

The task: sequences of random tokens from a vocabulary of ``VOCAB``; the target at position
``p >= 1`` is a token seen before, the previous one (``previous_token``) or the first
(``first_token``). Models train on sequences of ``T_TRAIN`` tokens and are tested on
``T_TEST``: with causal attention one test sequence gives the accuracy at the trained
positions and at the positions never seen.

- ``CopyPrevious(method)``: ``SEEDS`` one-layer causal attention models side by side, one per
  seed, with ``HEADS`` heads, token embeddings and a linear read-out; ``method`` says how
  position enters: ``"none"``, ``"sinusoidal"`` or ``"learned"`` vectors added to the token
  embeddings, ``"rope"`` on each head's queries and keys, ``"alibi"``'s bias;
- ``train(method, ...)``: Adam on fresh batches; returns the models and the loss of every step;
- ``accuracy(models, ...)``: each seed's accuracy at the trained and at the unseen positions;
- ``save_run`` and ``load_run``: the runs tools/models.py trains (``make models``) and commits
  to models/position/, which the chapter loads, with the SHA-256 of their weights.

Everything is float64 and deterministic: the same method, target and steps give the same log.
Shape legend as in ``attention.py``, with N the seeds trained side by side.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import stored
from attention import causal_mask, scaled_dot_product_attention
from position import alibi_bias, rotary_embedding, sinusoidal_encoding

__all__ = ["VOCAB", "D", "HEADS", "T_TRAIN", "T_TEST", "SEEDS", "STEPS", "METHODS", "TARGETS",
           "CopyPrevious", "sequences", "previous_token", "first_token", "train", "accuracy",
           "MODELS", "RUNS", "Run", "save_run", "load_run"]

VOCAB, D, HEADS, T_TRAIN, T_TEST, SEEDS = 16, 32, 4, 16, 32, 3
STEPS = 100  # Adam's steps on batches of 32 sequences, at learning rate 1e-2
METHODS = ("none", "sinusoidal", "learned", "rope", "alibi")
f64 = torch.float64
SINUSOIDS = sinusoidal_encoding(T_TEST, D, dtype=f64)  # (T_TEST, D)
ALIBI = alibi_bias(HEADS, T_TEST, dtype=f64)  # (H, T_TEST, T_TEST)
CAUSAL = causal_mask(T_TEST)  # (T_TEST, T_TEST)
MODELS = pathlib.Path("models") / "position"  # in the repository, beside code/
_MAKE = "run `make models` to train the runs the chapter loads"


class CopyPrevious(nn.Module):
    """SEEDS one-layer causal attention models, one per seed, side by side."""

    def __init__(self, method):
        super().__init__()
        self.method = method
        self.rope = {}  # keyword arguments of rotary_embedding, for "rope"
        self.qk_scale = 1.0  # a factor on the rotated queries and keys

        def param(shape, scale):  # one independent draw per seed
            return nn.Parameter(torch.stack([scale * torch.randn(
                *shape, dtype=f64, generator=torch.Generator().manual_seed(s))
                for s in range(SEEDS)]))

        self.embed = param((VOCAB, D), 1.0)  # (N, VOCAB, D), N = SEEDS
        self.positions = param((T_TEST, D), 1.0)  # learned table (N, T_TEST, D)
        self.w_qkv = param((D, 3 * D), D ** -0.5)  # (N, D, 3D)
        self.w_out = param((D, VOCAB), D ** -0.5)  # (N, D, VOCAB)

    def forward(self, tokens):  # (N, B, T) -> logits (N, B, T, VOCAB)
        n, B, T = tokens.shape
        x = self.embed[torch.arange(n)[:, None, None], tokens]  # (N, B, T, D)
        if self.method == "sinusoidal":
            x = x + SINUSOIDS[:T]
        elif self.method == "learned":
            x = x + self.positions[:, None, :T]
        qkv = torch.einsum("nbtd,nde->nbte", x, self.w_qkv)  # each model its own W
        qkv = qkv.view(n, B, T, 3, HEADS, D // HEADS)
        # each (N, B, H, T, d_h), copied once so that what follows reads contiguous memory
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).contiguous()
        if self.method == "rope":
            q, k = (self.qk_scale * rotary_embedding(u, **self.rope) for u in (q, k))
        mask = ALIBI[:, :T, :T] if self.method == "alibi" else CAUSAL[:T, :T]
        y, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.einsum("nbtd,ndv->nbtv", y.transpose(2, 3).reshape(n, B, T, D),
                            self.w_out)


def sequences(batch, T, gen):
    return torch.randint(VOCAB, (SEEDS, batch, T), generator=gen)  # (N, B, T)


def previous_token(tokens):  # (N, B, T) -> the targets at positions 1..T-1
    return tokens[:, :, :-1]


def first_token(tokens):  # (N, B, T) -> token 0, the target at positions 1..T-1
    return tokens[:, :, :1].expand(-1, -1, tokens.shape[-1] - 1)


TARGETS = {"previous": previous_token, "first": first_token}


def train(method, steps=STEPS, batch=32, target=previous_token, T=T_TRAIN,
          model=None) -> tuple[CopyPrevious, list[float]]:
    """The models after ``steps`` Adam steps (from ``model``, else fresh ones)
    and the loss of every step, the mean of the seeds' cross-entropies."""
    model = CopyPrevious(method) if model is None else model
    data = torch.Generator().manual_seed(100)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        tokens = sequences(batch, T, data)
        logits = model(tokens)[:, :, 1:]  # predict the target at p >= 1
        loss = SEEDS * F.cross_entropy(logits.reshape(-1, VOCAB),
                                       target(tokens).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item() / SEEDS)
    return model, losses


def accuracy(model, target=previous_token, n=500):
    """(N,) accuracies at positions 1..15 (seen) and 16..31 (unseen)."""
    tokens = sequences(n, T_TEST, torch.Generator().manual_seed(7))
    with torch.no_grad():
        guess = model(tokens)[:, :, 1:].argmax(-1)  # (N, n, T_TEST - 1)
    hit = (guess == target(tokens)).double()
    return hit[:, :, :T_TRAIN - 1].mean((1, 2)), hit[:, :, T_TRAIN - 1:].mean((1, 2))


# ---------------------------------------------------------------------------------------------
# Trained runs: written by tools/models.py (make models), read by the chapter

# name -> (method, target): the five methods on the previous token, RoPE on the first token
RUNS = {**{f"previous-{method}": (method, "previous") for method in METHODS},
        "first-rope": ("rope", "first")}


@dataclass
class Run:
    """A trained run: its name, method, target and steps, its log (``"loss"``: the loss of
    every step; ``"seen"`` and ``"unseen"``: each seed's ``accuracy`` of the trained models),
    the models with their weights, and the CPU seconds ``make models`` took."""
    name: str
    method: str
    target: str
    steps: int
    log: dict
    model: CopyPrevious
    cpu_seconds: Optional[float] = None


def save_run(folder: pathlib.Path, name: str, method: str, target: str, steps: int,
             model: CopyPrevious, log: dict, cpu_seconds: Optional[float] = None) -> dict:
    """Write ``<name>.pt`` (the state_dict) and ``<name>.json`` (method, target, steps, CPU
    seconds, log, torch's version and the .pt's SHA-256) into ``folder``."""
    head = {"name": name, "method": method, "target": target, "steps": steps,
            "cpu_seconds": cpu_seconds}
    return stored.save_run(folder, name, model.state_dict(), head, log)


def load_run(name: str, folder: Optional[pathlib.Path] = None) -> Run:
    """The trained run ``name``, read from ``folder``: by default the repository's
    models/position/, else models/position/ beside this file (Colab, a download), fetched
    once. The weights' SHA-256 must be the one their JSON records."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    model = CopyPrevious(record["method"])
    model.load_state_dict(state)
    return Run(name, record["method"], record["target"], record["steps"], record["log"], model,
               record.get("cpu_seconds"))

