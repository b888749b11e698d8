"""Two lookups per query: the task, the model and the training of chapter "Multi-head attention".

The task: sequences of ``T`` numbers drawn from ``0 .. N_VOCAB - 1``, one position per
sequence *marked* (its token is drawn from a second copy of the vocabulary, ids ``N_VOCAB ..
2 * N_VOCAB - 1``), and at every position after the first the target ``(u_{t-1} + u_{t*}) mod
N_VOCAB``: one value found by position (the previous token), one by content (the marked token).

- ``make_batch(n, generator)``: tokens, targets and the marked positions;
- ``TwoLookups(num_heads)``: token and learned position embeddings, one module
  ``MultiHeadAttention`` (no mask) and a per-position MLP read-out, in float64;
- ``train(num_heads, seed)``: Adam on fresh batches; returns the model and the loss of every
  step;
- ``evaluation_loss(model)``: the loss on a fixed set of sequences, which ``make models``
  records with each run;
- ``save_run`` and ``load_run``: the runs tools/models.py trains (``make models``) and commits
  to models/lookups/, which the chapter loads, with the SHA-256 of their weights.

Everything is float64 and deterministic: the same number of heads and seed give the same log.
In float32 the training is chaotic enough that a CPU's rounding changes its outcome. Shape
legend as in ``attention.py``: B sequences, H heads, T positions, D = d_model.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import stored
from attention import MultiHeadAttention

__all__ = ["N_VOCAB", "T", "D", "STEPS", "BATCH", "LR", "make_batch", "TwoLookups", "train",
           "EVAL_SEED", "evaluation_loss",
           "MODELS", "Run", "save_run", "load_run"]

N_VOCAB, T, D = 8, 10, 32  # vocabulary, sequence length, model width
STEPS, BATCH, LR = 150, 128, 1e-2  # Adam's steps, sequences per step, learning rate
EVAL_SEED, EVAL_SIZE = 7, 1000  # the fixed evaluation set: make_batch(1000, seed 7)
MODELS = pathlib.Path("models") / "lookups"  # in the repository, beside code/
_MAKE = "run `make models` to train the runs the chapter loads"


def make_batch(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens with one marked position; the target of every position after the first."""
    u = torch.randint(N_VOCAB, (n, T), generator=gen)  # (n, T): the numbers u_t
    mark = torch.randint(T, (n,), generator=gen)  # (n,): the marked index t* - 1
    rows = torch.arange(n)
    ids = u.clone()
    ids[rows, mark] += N_VOCAB  # ids N_VOCAB..2 * N_VOCAB - 1 are the marked copies
    target = (u[:, :-1] + u[rows, mark][:, None]) % N_VOCAB  # (n, T - 1)
    return ids, target, mark


class TwoLookups(nn.Module):
    """Embeddings, one multi-head attention layer, a per-position MLP."""

    def __init__(self, num_heads: int, dtype=torch.float64):
        super().__init__()
        self.tok = nn.Embedding(2 * N_VOCAB, D, dtype=dtype)
        self.pos = nn.Embedding(T, D, dtype=dtype)
        self.attn = MultiHeadAttention(D, num_heads, dtype=dtype)
        self.readout = nn.Sequential(nn.Linear(D, 64, dtype=dtype), nn.ReLU(),
                                     nn.Linear(64, N_VOCAB, dtype=dtype))

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:  # ids (B, T)
        if ids.dim() != 2 or ids.shape[1] != T:
            raise ValueError(f"ids must have shape (B, {T}), got {tuple(ids.shape)}")
        x = self.tok(ids) + self.pos(torch.arange(T))  # (B, T, D)
        out, weights = self.attn(x, x, x)  # (B, T, D), (B, H, T, T)
        return self.readout(out)[:, 1:], weights  # logits for t >= 2


def train(num_heads: int, seed: int, steps: int = STEPS) -> tuple[TwoLookups, list[float]]:
    """Adam on fresh batches of ``BATCH`` sequences for ``steps`` steps; the model and the
    loss of every step."""
    torch.manual_seed(seed)
    model = TwoLookups(num_heads)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = torch.Generator().manual_seed(seed + 100)
    losses = []
    for _ in range(steps):
        ids, target, _ = make_batch(BATCH, data)
        logits, _ = model(ids)  # (B, T - 1, N_VOCAB)
        loss = F.cross_entropy(logits.reshape(-1, N_VOCAB), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def evaluation_loss(model: TwoLookups) -> float:
    """The model's cross-entropy on ``EVAL_SIZE`` sequences drawn from seed ``EVAL_SEED``."""
    ids, target, _ = make_batch(EVAL_SIZE, torch.Generator().manual_seed(EVAL_SEED))
    with torch.no_grad():
        logits, _ = model(ids)
    return F.cross_entropy(logits.reshape(-1, N_VOCAB), target.reshape(-1)).item()


# ---------------------------------------------------------------------------------------------
# Trained runs: written by tools/models.py (make models), read by the chapter


@dataclass
class Run:
    """A trained run: its name, number of heads, seed and steps, its log (``"loss"``: the loss
    of every step; ``"eval_loss"``: ``evaluation_loss`` of the trained model), the model with
    its weights, and the CPU seconds ``make models`` took."""
    name: str
    num_heads: int
    seed: int
    steps: int
    log: dict
    model: TwoLookups
    cpu_seconds: Optional[float] = None


def save_run(folder: pathlib.Path, name: str, num_heads: int, seed: int, steps: int,
             model: TwoLookups, log: dict, cpu_seconds: Optional[float] = None) -> dict:
    """Write ``<name>.pt`` (the state_dict) and ``<name>.json`` (heads, seed, steps, CPU
    seconds, log, torch's version and the .pt's SHA-256) into ``folder``."""
    head = {"name": name, "num_heads": num_heads, "seed": seed, "steps": steps,
            "cpu_seconds": cpu_seconds}
    return stored.save_run(folder, name, model.state_dict(), head, log)


def load_run(name: str, folder: Optional[pathlib.Path] = None) -> Run:
    """The trained run ``name``, read from ``folder``: by default the repository's
    models/lookups/, else models/lookups/ beside this file (Colab, a download), fetched once.
    The weights' SHA-256 must be the one their JSON records."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    model = TwoLookups(record["num_heads"])
    model.load_state_dict(state)
    model.eval()
    return Run(name, record["num_heads"], record["seed"], record["steps"], record["log"], model,
               record.get("cpu_seconds"))
