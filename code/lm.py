"""A character-level language model on real text, written to be read.

The text is the part of Shakespeare's plays that data/shakespeare.txt holds (data/README.md
gives its source and licence). The model is chapter "The Transformer block"'s ``DecoderLM``:
it reads up to ``Config.context`` characters and predicts, at every position, the next one.

What is here, in the order the chapter "A language model on real text" uses it:

- ``load_text``, ``Vocabulary`` and ``split``: the text, its characters as integers, and the
  split into the first 90 % for training and the rest, held out;
- ``split_text``, ``train_tokenizer``, ``Tokenizer``, ``save_tokenizer`` and
  ``load_tokenizer``: a byte-pair tokenizer trained by SentencePiece on the training text, so
  that ``train(..., tokenizer=...)`` trains the same model on tokens of several characters;
  ``bits_per_character``, the loss that compares a model on tokens with one on characters;
- ``unigram_loss`` and ``bigram_loss``: the baselines, models made of counts;
- ``Config``, ``build`` and ``train(config, seed)``: the model and its training, which returns
  the model and its log; ``evaluate``, the mean loss over a text cut into windows; ``trace``,
  what a traced run also measures at each evaluation (the loss at each position, the
  in-context learning score, ``in_context_score``, and the heads' induction scores on
  repeated passages);
- ``sample``: one token drawn from logits, with a temperature, top-k and top-p (nucleus)
  truncation (``truncated``: the logits it draws from); ``generate``: sampling one character at a time that way, with or without
  chapter "Inference"'s key-value cache;
- ``attention_weights``, ``score_on`` with the keys it scores (``back_keys``, ``last_keys``,
  ``word_start_keys``, all four by name in ``text_keys``), ``repeated_text``,
  ``head_scores`` and ``ablate``: what the heads do; ``ablation_groups`` and
  ``ablation_rises``: what silencing each head or layer costs, window by window;
- ``save_run`` and ``load_run``: the run tools/models.py trains (``make models``) and the
  chapter loads, with its log and the SHA-256 of its weights; ``predictions``, ``analyse``,
  ``save_analysis`` and ``load_analysis``: its predictions and ablation costs on the whole
  held-out text, which tools/models.py measures from the committed weights and the chapter
  loads.

Training is float64 and deterministic: the same config and seed give the same log. Shape
legend as in ``attention.py``: B sequences, H heads, T positions, V characters in the
vocabulary, D = d_model.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import stored
from induction import induction_score, silence_heads
from transformer import DecoderLM

__all__ = [
    "load_text",
    "Vocabulary",
    "split",
    "split_text",
    "train_tokenizer",
    "Tokenizer",
    "save_tokenizer",
    "load_tokenizer",
    "bits_per_character",
    "unigram_loss",
    "bigram_loss",
    "Config",
    "build",
    "windows",
    "evaluate",
    "train",
    "trace",
    "in_context_score",
    "truncated",
    "sample",
    "generate",
    "attention_weights",
    "score_on",
    "back_keys",
    "last_keys",
    "word_start_keys",
    "text_keys",
    "repeated_text",
    "head_scores",
    "ablate",
    "ablation_groups",
    "predictions",
    "ablation_rises",
    "save_run",
    "load_run",
    "Run",
    "analyse",
    "save_analysis",
    "load_analysis",
    "Analysis",
]

DTYPE = torch.float64
DATA = "data"  # in the repository, beside code/
TEXT = "shakespeare.txt"
MODELS = pathlib.Path("models") / "lm"
_MAKE = "run `make models` to train the run the chapter loads"


# ---------------------------------------------------------------------------------------------
# The text


def load_text(folder: Optional[pathlib.Path] = None) -> str:
    """The corpus, data/shakespeare.txt: from ``folder``, else the repository's data/, else
    data/ beside this file, where it is fetched once (``stored.locate``)."""
    where = stored.locate(DATA, [TEXT], folder, make="it is part of the repository")
    return (where / TEXT).read_text(encoding="utf-8")


class Vocabulary:
    """The characters of a text, sorted, each numbered by its place: ``encode`` turns text
    into a ``(N,)`` tensor of integers in [0, V), ``decode`` turns integers back into text."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("Vocabulary needs a non-empty string")
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        unknown = sorted(set(text) - set(self._index))
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown[:5]}")
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if any(not 0 <= i < len(self) for i in ids):
            raise ValueError(f"ids must lie in [0, {len(self)})")
        return "".join(self.chars[i] for i in ids)


def split(tokens: Tensor, fraction: float = 0.9) -> tuple[Tensor, Tensor]:
    """The first ``fraction`` of ``tokens`` for training, the rest held out: a contiguous
    split, so that no held-out line was seen in training."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie strictly between 0 and 1, got {fraction}")
    n = int(fraction * len(tokens))
    return tokens[:n], tokens[n:]


def split_text(text: str, fraction: float = 0.9) -> tuple[str, str]:
    """``text`` split where ``split`` splits its characters: the first ``fraction`` of the
    characters for training, the rest held out. A tokenizer is trained on the first part and
    each part is encoded on its own, so a character model and a token model hold out the
    same text."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie strictly between 0 and 1, got {fraction}")
    n = int(fraction * len(text))
    return text[:n], text[n:]


# ---------------------------------------------------------------------------------------------
# Tokens of several characters: a byte-pair tokenizer (SentencePiece)

# SentencePiece's options for a lossless tokenizer of a stream of text, trained the same way
# every time: no text dropped, spaces kept as they are (written "▁" in a piece), no space added
# in front, the line break a piece of its own, no BOS or EOS, one thread, every line read in
# order (not sampled); id 0 is the unknown piece, which ``Tokenizer.encode`` refuses.
TOKENIZER_OPTIONS = dict(model_type="bpe", character_coverage=1.0, byte_fallback=False,
                         normalization_rule_name="identity", add_dummy_prefix=False,
                         remove_extra_whitespaces=False, split_by_whitespace=True,
                         user_defined_symbols=["\n"], unk_id=0, bos_id=-1, eos_id=-1,
                         pad_id=-1, num_threads=1, input_sentence_size=0,
                         shuffle_input_sentence=False, minloglevel=2)


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise ImportError("the tokenizer needs SentencePiece: pip install sentencepiece "
                          "(requirements.txt gives the version)") from None
    return sentencepiece


def train_tokenizer(text: str, vocab_size: int) -> bytes:
    """A byte-pair tokenizer of ``vocab_size`` pieces, trained by SentencePiece
    (``TOKENIZER_OPTIONS``) on the lines of ``text``: the bytes of its .model file. Its pieces
    are the unknown piece, the line break, the merged pieces in the order of their merges,
    then the single characters of ``text``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("train_tokenizer needs a non-empty string")
    spm = _sentencepiece()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.split("\n")), model_writer=model,
                                   vocab_size=vocab_size, **TOKENIZER_OPTIONS)
    return model.getvalue()


class Tokenizer:
    """A SentencePiece model with ``Vocabulary``'s interface: ``encode`` turns text into a
    ``(N,)`` tensor of token ids in [0, V), ``decode`` turns ids back into text. ``pieces``
    are the tokens as text (a space is "▁"); ``lengths`` ``(V,)`` the characters each token
    stands for."""

    def __init__(self, model: bytes, name: Optional[str] = None):
        self.model, self.name = bytes(model), name
        self.sha256 = hashlib.sha256(self.model).hexdigest()
        self._processor = _sentencepiece().SentencePieceProcessor(model_proto=self.model)
        self.pieces = [self._processor.id_to_piece(i) for i in range(len(self))]
        self.lengths = torch.tensor([0 if self._processor.is_unknown(i) else
                                     len(p.replace("▁", " ")) for i, p in enumerate(self.pieces)])

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    def encode(self, text: str) -> Tensor:
        ids = torch.tensor(self._processor.encode(text), dtype=torch.long)
        if bool((ids == self._processor.unk_id()).any()):
            unknown = sorted({c for c in text if self._processor.piece_to_id(c) ==
                              self._processor.unk_id() and c not in " \n"})
            raise ValueError(f"characters not in the tokenizer: {unknown[:5]}")
        return ids

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if any(not 0 <= i < len(self) for i in ids):
            raise ValueError(f"ids must lie in [0, {len(self)})")
        return self._processor.decode(ids)


def save_tokenizer(folder: pathlib.Path, name: str, model: bytes, head: dict) -> dict:
    """Write ``<name>.model`` (``train_tokenizer``'s bytes) and ``<name>.json`` (``head``,
    what it was trained on and how, SentencePiece's version, the number of pieces and the
    .model's SHA-256) into ``folder``. Returns what the JSON holds."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.model").write_bytes(model)
    record = {"name": name, **head, "sentencepiece": _sentencepiece().__version__,
              "pieces": len(Tokenizer(model)), "sha256": stored.sha256(folder / f"{name}.model")}
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_tokenizer(name: str, folder: Optional[pathlib.Path] = None) -> Tokenizer:
    """The committed tokenizer ``name``, found as ``load_run`` finds a run; the .model's
    SHA-256 must be the one its JSON records."""
    where = stored.locate(MODELS.as_posix(), [f"{name}.json", f"{name}.model"], folder,
                          make=_MAKE)
    record = json.loads((where / f"{name}.json").read_text())
    tokenizer = Tokenizer((where / f"{name}.model").read_bytes(), name)
    if tokenizer.sha256 != record["sha256"]:
        raise ValueError(f"{where / name}.model: its SHA-256 is {tokenizer.sha256}, but "
                         f"{name}.json records {record['sha256']}; {_MAKE}")
    return tokenizer


def bits_per_character(loss: float, n_tokens: int, n_chars: int) -> float:
    """A held-out loss of ``loss`` nats per token over ``n_tokens`` predicted tokens that
    spell ``n_chars`` characters, in bits per character: ``loss * n_tokens / n_chars / ln 2``
    (for characters, ``n_tokens = n_chars``: the loss over ln 2)."""
    if n_tokens < 1 or n_chars < 1:
        raise ValueError(f"need at least one token and one character, got {n_tokens} and "
                         f"{n_chars}")
    return loss * n_tokens / n_chars / math.log(2)


# ---------------------------------------------------------------------------------------------
# Baselines: models made of counts


def _check_tokens(name: str, tokens, vocab_size: int, least: int) -> None:
    if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
        shape = (tuple(tokens.shape), tokens.dtype) if isinstance(tokens, Tensor) else (
            type(tokens).__name__)
        raise ValueError(f"{name} must be a (N,) tensor of int64 tokens, got {shape}")
    if len(tokens) < least:
        raise ValueError(f"{name} needs at least {least} tokens, got {len(tokens)}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got values from "
                         f"{int(tokens.min())} to {int(tokens.max())}")


def unigram_loss(train: Tensor, held_out: Tensor, vocab_size: int, alpha: float = 1.0) -> float:
    """Mean cross-entropy (nats) of ``held_out[1:]`` under character frequencies counted in
    ``train``, each count plus ``alpha``: the best guess that ignores the context."""
    _check_tokens("train", train, vocab_size, 1)
    _check_tokens("held_out", held_out, vocab_size, 2)
    counts = torch.bincount(train, minlength=vocab_size).double() + alpha
    return float(-(counts / counts.sum()).log()[held_out[1:]].mean())


def bigram_loss(train: Tensor, held_out: Tensor, vocab_size: int, alpha: float = 1.0) -> float:
    """Mean cross-entropy (nats) of ``held_out[t + 1]`` given ``held_out[t]``, under counts of
    the pairs of consecutive characters in ``train``, each count plus ``alpha`` (add-alpha
    smoothing; ``alpha = 0`` gives infinity if a held-out pair never occurs in training)."""
    _check_tokens("train", train, vocab_size, 2)
    _check_tokens("held_out", held_out, vocab_size, 2)
    counts = torch.full((vocab_size, vocab_size), float(alpha), dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64),
                      accumulate=True)  # counts[a, b]: how often b follows a
    log_p = (counts / counts.sum(dim=1, keepdim=True)).log()  # row a: p(next | a)
    return float(-log_p[held_out[:-1], held_out[1:]].mean())


# ---------------------------------------------------------------------------------------------
# The model and its training


@dataclass(frozen=True)
class Config:
    """One training run's settings: the model (``DecoderLM``, pre-LN, GELU, no dropout,
    untied), the batches (``batch_size`` windows of ``context + 1`` characters drawn from the
    training text, a share ``repeat`` of them made to hold a passage twice: ``_batch``) and
    AdamW with a linear warm-up and a cosine decay to ``min_lr``."""

    context: int = 64
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    num_layers: int = 4
    batch_size: int = 32
    steps: int = 1500
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 100
    fraction: float = 0.9
    repeat: float = 0.0  # the share of training windows that hold a passage twice (_batch)
    repeat_min: int = 0  # 0: the passage is context // 2 long; else from repeat_min to that

    def __post_init__(self):
        for name in ("context", "d_model", "num_heads", "d_ff", "num_layers", "batch_size",
                     "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of "
                             f"num_heads={self.num_heads}")
        if self.steps < 0 or self.steps % self.eval_every:
            raise ValueError(f"steps={self.steps} must be a multiple of "
                             f"eval_every={self.eval_every}, so that the last step is evaluated")
        if not 0.0 <= self.repeat <= 1.0:  # also refuses NaN
            raise ValueError(f"Config.repeat must lie in [0, 1], got {self.repeat!r}")
        if (isinstance(self.repeat_min, bool) or not isinstance(self.repeat_min, int)
                or not 0 <= self.repeat_min <= self.context // 2):
            raise ValueError(f"Config.repeat_min must be an integer in [0, context // 2], got "
                             f"{self.repeat_min!r}")
        object.__setattr__(self, "betas", tuple(self.betas))  # JSON gives a list

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        return cls(**values)

    def learning_rate(self, step: int) -> float:
        """The rate of step ``step``: linear from lr / warmup up to lr over the first
        ``warmup`` steps, then a cosine from lr down to min_lr at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * done))


def build(config: Config, vocab_size: int) -> DecoderLM:
    """A fresh float64 ``DecoderLM`` of ``config``'s shape (its weights from the global random
    state: ``train`` seeds it)."""
    return DecoderLM(vocab_size, config.context, config.d_model, config.num_heads, config.d_ff,
                     config.num_layers, norm_first=True, activation="gelu", dtype=DTYPE)


def windows(tokens: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """``tokens`` cut into consecutive, non-overlapping windows of ``context + 1``: inputs
    ``(N, context)`` and targets ``(N, context)``, the inputs shifted by one."""
    n = (len(tokens) - 1) // context
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {context + 1}")
    x = tokens[:n * context].view(n, context)
    y = tokens[1:n * context + 1].view(n, context)
    return x, y


def evaluate(model: DecoderLM, tokens: Tensor, *, batch: int = 128) -> float:
    """Mean cross-entropy (nats per character) of ``model`` on ``tokens`` cut into windows of
    the model's context (``windows``). Each window starts afresh, so the mean is over
    predictions made from 1, 2, ..., context characters."""
    x, y = windows(tokens, model.max_len)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch])
            total += float(F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                           reduction="sum"))
    return total / y.numel()


def _batch(tokens: Tensor, config: Config, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` windows of ``context + 1`` characters, starting anywhere. With
    ``config.repeat > 0`` each window is, with that probability, made a passage twice: its
    first character and a passage of ``n`` characters, the passage again, then the text that
    followed the passage, up to ``context + 1`` in all. ``n`` is ``context // 2`` (the layout
    of ``repeated_text``), or with ``config.repeat_min > 0`` drawn for each window from
    ``repeat_min`` to ``context // 2``, so that the second copy starts at no fixed place."""
    starts = torch.randint(len(tokens) - config.context, (config.batch_size,), generator=generator)
    rows = torch.stack([tokens[s:s + config.context + 1] for s in starts.tolist()])
    if config.repeat > 0:  # no draw otherwise: the batches of repeat = 0 stay the same
        half = config.context // 2
        chosen = torch.rand(config.batch_size, generator=generator,
                            dtype=torch.float64) < config.repeat  # (B,)
        if config.repeat_min:
            lengths = torch.randint(config.repeat_min, half + 1, (config.batch_size,),
                                    generator=generator).tolist()
        else:
            lengths = [half] * config.batch_size
        twice = torch.stack([torch.cat([r[:n + 1], r[1:n + 1], r[n + 1:config.context + 1 - n]])
                             for r, n in zip(rows, lengths)])  # (B, context + 1)
        rows = torch.where(chosen[:, None], twice, rows)
    return rows[:, :-1], rows[:, 1:]


TRACE_SEED = 2024  # the generator of the repeated passages a trace is measured on
TRACE_SEQUENCES = 64  # how many
ICL_EARLY, ICL_LATE = 5, 50  # the characters read by the two predictions of the ICL score


def in_context_score(model: DecoderLM, tokens: Tensor, early: int = ICL_EARLY,
                     late: int = ICL_LATE, *, losses: Optional[Tensor] = None) -> Tensor:
    """(n,): for each window of ``tokens`` (``windows``), the loss of its prediction made from
    ``late`` characters minus the loss of the prediction of the same character made from
    ``early`` characters, in the windows that start ``late - early`` characters later (read
    as windows of ``early`` characters, which is all that prediction sees); the mean is the
    in-context learning score of Olsson et al. (2022), negative when the longer
    context helps. ``losses``: ``predictions(model, tokens)[0]``, if already computed."""
    C = model.max_len
    if not 1 <= early < late <= C:
        raise ValueError(f"need 1 <= early < late <= context = {C}, got {early} and {late}")
    losses = predictions(model, tokens)[0] if losses is None else losses  # (N, C)
    x, y = windows(tokens[late - early:], C)  # the window's character `late` at `early`
    with torch.no_grad():  # causal: the first `early` characters are all the prediction reads
        logits = model(x[:, :early])[:, early - 1]  # (n, V)
    n = min(len(losses), len(x))
    early_losses = F.cross_entropy(logits[:n], y[:n, early - 1], reduction="none")  # (n,)
    return losses[:n, late - 1] - early_losses


def trace(model: DecoderLM, held_out: Tensor) -> dict:
    """What ``train(..., trace=True)`` measures at each evaluation, on the held-out tokens:
    "by_position", the mean loss at each position of the windows of ``evaluate`` (``context``
    numbers: the prediction made from 1, 2, ..., context characters); "icl", the mean of
    ``in_context_score`` (from ``ICL_EARLY`` and ``ICL_LATE`` characters, or the whole
    context if shorter) and its standard error over the windows; on ``TRACE_SEQUENCES``
    sequences of ``repeated_text`` (a character, a held-out passage of ``context // 2``
    characters, the passage again; drawn with ``TRACE_SEED``) "copies", the mean loss of the
    predictions of the passage's first copy and of its second, each from its second character
    on, and "induction", each head's induction score ``(num_layers, H)`` as a nested
    list."""
    losses, _ = predictions(model, held_out)  # (N, context)
    late = min(ICL_LATE, model.max_len)  # a shorter context: its last prediction
    icl = in_context_score(model, held_out, min(ICL_EARLY, late - 1), late, losses=losses)
    half = model.max_len // 2
    repeated = repeated_text(held_out, TRACE_SEQUENCES, half,
                             torch.Generator().manual_seed(TRACE_SEED))  # (n, 2 * half + 1)
    with torch.no_grad():
        logits, weights = model(repeated[:, :-1], need_weights=True)
    per = F.cross_entropy(logits.transpose(1, 2), repeated[:, 1:], reduction="none")  # (n, 2h)
    n = repeated.shape[0]
    first, second = torch.ones(n, dtype=torch.long), torch.full((n,), 1 + half)
    induction = torch.stack([induction_score(w, first, second, torch.full((n,), half))
                             for w in weights])  # (num_layers, H)
    return {"by_position": losses.mean(dim=0).tolist(),
            "icl": [float(icl.mean()), float(icl.std() / len(icl) ** 0.5)],
            "copies": [float(per[:, 1:half].mean()), float(per[:, half + 1:].mean())],
            "induction": induction.tolist()}


def train(config: Config, seed: int, text: Optional[str] = None, *,
          until: Optional[int] = None, traced: bool = False,
          tokenizer: Optional["Tokenizer"] = None) -> tuple[DecoderLM, dict]:
    """Train a fresh model on the training part of ``text`` (default: ``load_text()``),
    whose characters make its vocabulary (``Vocabulary(text)``).

    The initial weights come from ``seed`` (drawn without touching the global random state),
    the batches from a generator seeded with ``seed``. The log holds, for every step, the
    learning rate, the batch's loss (before the step) and the norm of the gradient before it
    is clipped ("grad_norm"), and every ``eval_every`` steps from 0 to ``steps`` the held-out
    loss (``evaluate``); with ``traced`` each evaluation also holds ``trace``'s measurements.
    ``until`` stops the same run after that many steps (the schedule still ends at
    ``steps``): its log is the start of the full run's. With ``tokenizer`` (a ``Tokenizer``)
    the model reads its tokens instead of characters: the text is split as characters
    (``split_text``) and each part encoded, so the held-out text is the same. Returns the
    model and the log."""
    until = config.steps if until is None else until
    if not 0 <= until <= config.steps:
        raise ValueError(f"until must lie in [0, {config.steps}], got {until}")
    text = load_text() if text is None else text
    vocab = Vocabulary(text) if tokenizer is None else tokenizer
    if tokenizer is None:
        train_part, held_out = split(vocab.encode(text), config.fraction)
    else:
        train_part, held_out = (tokenizer.encode(part)
                                for part in split_text(text, config.fraction))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config, len(vocab))
    data = torch.Generator().manual_seed(seed)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]  # biases, layer norms' gains
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": config.weight_decay},
                             {"params": others, "weight_decay": 0.0}],
                            lr=config.lr, betas=config.betas)
    log = {"lr": [], "loss": [], "grad_norm": [], "eval": []}
    for step in range(until + 1):
        if step % config.eval_every == 0:
            model.eval()
            log["eval"].append({"step": step, "held_out": evaluate(model, held_out)})
            if traced:
                log["eval"][-1].update(trace(model, held_out))
            model.train()
        if step == until:
            break
        rate = config.learning_rate(step)
        for group in opt.param_groups:
            group["lr"] = rate
        x, y = _batch(train_part, config, data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)  # unclipped
        opt.step()
        log["lr"].append(rate)
        log["loss"].append(loss.item())
        log["grad_norm"].append(norm.item())
    model.eval()
    return model, log


# ---------------------------------------------------------------------------------------------
# Sampling


def _check_sampling(logits, temperature, top_k, top_p) -> None:
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError("logits must be a floating tensor (..., V), got "
                         + (f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, Tensor)
                            else repr(logits)))
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def truncated(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
              top_p: Optional[float] = None) -> Tensor:
    """The logits ``(..., V)`` that ``sample`` draws from, for ``temperature > 0``: divided by
    ``temperature``, with every token that ``top_k`` and ``top_p`` drop at -inf (see
    ``sample``)."""
    _check_sampling(logits, temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature 0 draws nothing: it takes the most likely token")
    z = (logits / temperature).reshape(-1, logits.shape[-1])  # (N, V)
    if top_k is not None:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]  # (N, 1)
        z = z.masked_fill(z < kth, float("-inf"))  # ties with the k-th are kept
    if top_p is not None:  # Hugging Face's rule: drop the least likely while their mass <= 1 - p
        ascending, order = torch.sort(z, dim=-1, stable=True)  # equal logits: by index
        drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False  # never the most likely: never fewer than one
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z.reshape(logits.shape)


def sample(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None,
           generator: Optional[torch.Generator] = None) -> Tensor:
    """One token drawn from each row of ``logits`` ``(..., V)``: a tensor of token ids of shape
    ``logits.shape[:-1]``.

    In the order of Hugging Face's and nanoGPT's samplers: the logits are divided by
    ``temperature`` (0: the most likely token, the first of equal ones, nothing drawn); ``top_k``
    keeps the ``top_k`` largest logits and every logit equal to the k-th (ties are kept);
    ``top_p`` then keeps the smallest set of the most likely tokens whose probability reaches
    ``top_p`` (never fewer than one), by Hugging Face's rule: the least likely tokens go while
    their total probability is at most ``1 - top_p`` (of equal logits, the one with the lower
    index goes first); the token is drawn from the softmax of what is kept (``truncated``).
    A negative ``temperature``, ``top_k < 1`` or ``top_p`` outside (0, 1] raises ValueError
    naming the value."""
    _check_sampling(logits, temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = truncated(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(z.reshape(-1, logits.shape[-1]), dim=-1)  # (N, V)
    tokens = torch.multinomial(probs, 1, generator=generator)  # (N, 1)
    return tokens.reshape(logits.shape[:-1])


def generate(model: DecoderLM, prompt: Tensor, n: int, *, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             generator: Optional[torch.Generator] = None, cache: bool = True) -> Tensor:
    """``n`` characters ``(n,)`` sampled one at a time after ``prompt`` ``(T0,)``.

    Each is drawn by ``sample`` from the logits of the last position, with ``temperature``,
    ``top_k`` and ``top_p`` (``temperature = 0``: the most likely character). The model reads a window of the text so far that starts
    at position 0 of its learned positions: it grows one character per step, and when it
    would outgrow the context it restarts from the last ``context // 2`` characters. With ``cache`` each block keeps the window's keys and values in a
    ``KVCache``, so a step reads one new character, and a restart reads the kept ones again;
    without it every step reads the whole window. Both compute the same logits."""
    if not isinstance(prompt, Tensor) or prompt.dim() != 1 or len(prompt) < 1:
        raise ValueError(f"prompt must be a non-empty (T0,) tensor of tokens, got "
                         f"{tuple(prompt.shape) if isinstance(prompt, Tensor) else prompt!r}")
    _check_sampling(torch.zeros(1), temperature, top_k, top_p)  # before any work
    seen = prompt.tolist()
    start = max(0, len(seen) - model.max_len)
    keep = model.max_len // 2

    def read(tokens, caches):
        return model(torch.tensor([tokens]), caches=caches)[0, -1]

    with torch.no_grad():
        caches = model.new_caches() if cache else None
        logits = read(seen[start:], caches)
        for _ in range(n):
            token = int(sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=generator))
            seen.append(token)
            if len(seen) == len(prompt) + n:
                break
            if len(seen) - start > model.max_len:  # the window is full: restart it
                start = len(seen) - keep
                caches = model.new_caches() if cache else None
                logits = read(seen[start:], caches)
            else:
                logits = read([token] if cache else seen[start:], caches)
    return torch.tensor(seen[len(prompt):], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# What the heads do


def attention_weights(model: DecoderLM, tokens: Tensor) -> list[Tensor]:
    """Each block's attention weights ``(B, H, T, T)`` on ``tokens`` ``(B, T)``."""
    with torch.no_grad():
        _, weights = model(tokens, need_weights=True)
    return weights


def score_on(weights: Tensor, keys: Tensor) -> Tensor:
    """(H,): each head's mean weight a_{i, k(i)} on a chosen key, over the queries that have
    one. ``weights`` is ``(B, H, T, T)``; ``keys`` ``(B, T)`` holds each query's key k(i) (at
    most i), or -1 for a query that has none."""
    if not isinstance(weights, Tensor) or weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be (B, H, T, T), got "
                         f"{tuple(weights.shape) if isinstance(weights, Tensor) else weights!r}")
    B, _, T, _ = weights.shape
    if tuple(keys.shape) != (B, T):
        raise ValueError(f"keys must be (B, T) = {(B, T)} for weights {tuple(weights.shape)}, "
                         f"got {tuple(keys.shape)}")
    if bool((keys > torch.arange(T)).any()):
        raise ValueError("a key lies after its query: causal weights there are 0")
    b, query = (keys >= 0).nonzero(as_tuple=True)
    if len(b) == 0:
        raise ValueError("no query has a key")
    return weights[b, :, query, keys[b, query]].mean(dim=0)  # (n, H) -> (H,)


def back_keys(tokens: Tensor, k: int) -> Tensor:
    """(B, T): the key k positions back, i - k, or -1 where i < k."""
    i = torch.arange(tokens.shape[-1]).expand(tokens.shape)
    return torch.where(i >= k, i - k, -1)


def last_keys(tokens: Tensor, ids: Iterable[int]) -> Tensor:
    """(B, T): the most recent position at or before i that holds one of the tokens ``ids``,
    or -1 where there is none."""
    i = torch.arange(tokens.shape[-1]).expand(tokens.shape)
    hit = torch.isin(tokens, torch.tensor(list(ids)))
    return torch.cummax(torch.where(hit, i, -1), dim=-1).values


def word_start_keys(tokens: Tensor, boundaries: Iterable[int], after: int = 3) -> Tensor:
    """(B, T): the first letter of the word that position i is in (the position after the most
    recent boundary, a space or line break, before i), for the positions at least ``after``
    characters past it; -1 elsewhere. Nearer positions are left out so that the key is never
    a fixed offset of 0 to ``after - 1`` characters, which a head could find without knowing
    where the word starts."""
    last = last_keys(tokens, boundaries)
    i = torch.arange(tokens.shape[-1]).expand(tokens.shape)
    return torch.where((last >= 0) & (i - (last + 1) >= after), last + 1, -1)


def repeated_text(tokens: Tensor, n: int, length: int, generator: torch.Generator) -> Tensor:
    """``(n, 2 * length + 1)`` sequences: a character, then a passage of ``length``
    characters of ``tokens``, then the same passage again, from random places."""
    if len(tokens) < length + 2:
        raise ValueError(f"{len(tokens)} tokens hold no passage of {length + 1}")
    starts = torch.randint(len(tokens) - length - 1, (n,), generator=generator).tolist()
    rows = [torch.cat([tokens[s:s + length + 1], tokens[s + 1:s + length + 1]]) for s in starts]
    return torch.stack(rows)


def text_keys(text_windows: Tensor, vocab: Vocabulary) -> dict[str, Tensor]:
    """The keys ``(B, T)`` of the four scores on text, by name: the previous character
    ("previous"), the one before it ("two back"), the first letter of the current word, three
    or more characters back ("word start": after the last space or line break) and the last
    line break ("line break")."""
    return {"previous": back_keys(text_windows, 1), "two back": back_keys(text_windows, 2),
            "word start": word_start_keys(text_windows, vocab.encode(" \n").tolist()),
            "line break": last_keys(text_windows, vocab.encode("\n").tolist())}


def head_scores(model: DecoderLM, text_windows: Tensor, repeated: Tensor,
                vocab: Vocabulary) -> dict[str, Tensor]:
    """Each head's scores ``(num_layers, H)``: the four of ``text_keys`` on ``text_windows``
    ``(B, T)``, and on ``repeated`` (``repeated_text``: a passage at 1 and again at 1 +
    length) the induction score of chapter "Induction heads" ("induction")."""
    on_text = attention_weights(model, text_windows)
    scores = {name: torch.stack([score_on(w, keys) for w in on_text])
              for name, keys in text_keys(text_windows, vocab).items()}
    length = (repeated.shape[1] - 1) // 2
    B = repeated.shape[0]
    first, second = torch.ones(B, dtype=torch.long), torch.full((B,), 1 + length)
    scores["induction"] = torch.stack([
        induction_score(w, first, second, torch.full((B,), length))
        for w in attention_weights(model, repeated)])
    return scores


def ablate(model: DecoderLM, heads: Iterable[tuple[int, int]]) -> DecoderLM:
    """A copy of ``model`` in which each head ``(block, head)`` of ``heads`` writes nothing
    into the residual stream; its attention weights are unchanged."""
    ablated = copy.deepcopy(model)
    silence_heads([block.self_attn for block in ablated.blocks], heads)
    return ablated


def ablation_groups(num_layers: int, num_heads: int) -> list[list[tuple[int, int]]]:
    """The heads silenced together in the chapter's ablations: every head alone, layer by
    layer, then every layer's heads together."""
    return ([[(layer, head)] for layer in range(num_layers) for head in range(num_heads)]
            + [[(layer, head) for head in range(num_heads)] for layer in range(num_layers)])


def predictions(model: DecoderLM, tokens: Tensor, *, batch: int = 128) -> tuple[Tensor, Tensor]:
    """``tokens`` cut into windows as ``evaluate`` cuts them (``windows``), read ``batch``
    windows at a time: the cross-entropy of every prediction ``(N, context)``, whose mean is
    ``evaluate``'s loss, and the log-probabilities of each window's last prediction
    ``(N, V)``, the one made from a whole window."""
    x, y = windows(tokens, model.max_len)
    losses, last = [], []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            log_probs = torch.log_softmax(model(x[i:i + batch]), dim=-1)  # (b, T, V)
            losses.append(-log_probs.gather(-1, y[i:i + batch, :, None])[..., 0])
            last.append(log_probs[:, -1])
    return torch.cat(losses), torch.cat(last)


def ablation_rises(model: DecoderLM, tokens: Tensor, groups, *, batch: int = 128) -> Tensor:
    """(len(groups), N): for each group of heads (a list of ``(block, head)``), how much the
    mean loss of each window of ``tokens`` (``predictions``) rises when those heads are
    silenced (``ablate``). The mean of a row is what the group is worth on ``tokens``; the
    windows give its spread."""
    base = predictions(model, tokens, batch=batch)[0].mean(dim=1)
    return torch.stack([predictions(ablate(model, heads), tokens, batch=batch)[0].mean(dim=1)
                        - base for heads in groups])


# ---------------------------------------------------------------------------------------------
# The trained run: written by tools/models.py (make models), read by the chapter


@dataclass
class Run:
    """A trained run: its name, config and seed, its log, and the model with its weights."""
    name: str
    config: Config
    seed: int
    log: dict
    model: DecoderLM
    vocab: Vocabulary  # or the Tokenizer of a run on tokens
    cpu_seconds: Optional[float] = None  # what training took, as tools/models.py measured it
    sha256: Optional[str] = None  # of the weights, as its JSON records it
    until: Optional[int] = None  # the steps trained, when the run stopped before config.steps


def save_run(folder: pathlib.Path, name: str, config: Config, seed: int, model: DecoderLM,
             log: dict, vocab: Vocabulary, cpu_seconds: Optional[float] = None,
             until: Optional[int] = None) -> dict:
    """Write ``<name>.pt`` (the state_dict) and ``<name>.json`` (config, seed, the
    vocabulary's characters, the CPU seconds the training took if given, log, torch's version
    and the .pt's SHA-256) into ``folder``; a run stopped early (``train``'s ``until``) also
    records where. A run on tokens (``vocab`` a ``Tokenizer``) records the tokenizer's name
    and SHA-256 instead of the characters."""
    if len(vocab) != model.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab)} characters, the model "
                         f"{model.vocab_size}")
    head = {"name": name, "config": dataclasses.asdict(config), "seed": seed,
            **({"tokenizer": vocab.name, "tokenizer_sha256": vocab.sha256}
               if isinstance(vocab, Tokenizer) else {"chars": "".join(vocab.chars)}),
            "cpu_seconds": cpu_seconds}
    if until is not None:
        head["until"] = until
    return stored.save_run(folder, name, model.state_dict(), head, log)


def load_run(name: str, folder: Optional[pathlib.Path] = None) -> Run:
    """The trained run ``name``, read from ``folder``: by default the repository's models/lm/,
    else models/lm/ beside this file (Colab, a download), fetched once. The weights' SHA-256
    must be the one their JSON records; a run on tokens also loads its tokenizer
    (``load_tokenizer``), which must be the one it was trained with."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    config = Config.from_dict(record["config"])
    if "tokenizer" in record:
        vocab = load_tokenizer(record["tokenizer"], folder)
        if vocab.sha256 != record["tokenizer_sha256"]:
            raise ValueError(f"{name} was trained with another {record['tokenizer']}.model; "
                             f"{_MAKE}")
    else:
        vocab = Vocabulary(record["chars"])
    model = build(config, len(vocab))
    model.load_state_dict(state)
    model.eval()
    return Run(name, config, record["seed"], record["log"], model, vocab,
               record.get("cpu_seconds"), record["sha256"], record.get("until"))


@dataclass
class Analysis:
    """What a committed run does on the held-out text, measured by tools/models.py from its
    weights: the run's name and the SHA-256 of those weights, the groups of heads silenced,
    ``losses`` ``(N, context)`` and ``last`` ``(N, V)`` (``predictions`` on the N held-out
    windows) and ``rises`` ``(len(groups), N)`` (``ablation_rises``)."""
    name: str
    run: str
    run_sha256: str
    groups: list
    losses: Tensor
    last: Tensor
    rises: Tensor
    cpu_seconds: Optional[float] = None


def analyse(run: Run, held_out: Tensor, groups) -> dict[str, Tensor]:
    """The tensors of an ``Analysis`` of ``run`` on ``held_out``: "losses" and "last"
    (``predictions``), "rises" (``ablation_rises`` of ``groups``)."""
    losses, last = predictions(run.model, held_out)
    return {"losses": losses, "last": last,
            "rises": ablation_rises(run.model, held_out, groups)}


def save_analysis(folder: pathlib.Path, name: str, run: Run, groups, tensors: dict,
                  cpu_seconds: Optional[float] = None) -> dict:
    """Write ``tensors`` (``analyse`` of ``run`` and ``groups``) into ``folder`` as
    ``<name>.pt`` and ``<name>.json``: the run's name and weights' SHA-256, the groups, the
    number of windows, the CPU seconds the measurement took if given, and as its log the
    held-out loss and each group's mean rise."""
    rises, losses = tensors["rises"], tensors["losses"]
    if rises.dim() != 2 or rises.shape != (len(groups), losses.shape[0]):
        raise ValueError(f"rises must be (len(groups), N) = ({len(groups)}, {losses.shape[0]}),"
                         f" got {tuple(rises.shape)}")
    head = {"name": name, "run": run.name, "run_sha256": run.sha256,
            "groups": [[list(h) for h in heads] for heads in groups],
            "windows": losses.shape[0], "cpu_seconds": cpu_seconds}
    log = {"held_out": float(losses.mean()), "cost": rises.mean(dim=1).tolist()}
    return stored.save_run(folder, name, tensors, head, log)


def load_analysis(name: str, folder: Optional[pathlib.Path] = None) -> Analysis:
    """The analysis ``name``, read and checked like ``load_run``'s weights."""
    record, state = stored.load_run(MODELS.as_posix(), name, folder, make=_MAKE)
    n, groups = record["windows"], [[tuple(h) for h in heads] for heads in record["groups"]]
    if (state["losses"].shape[0], state["last"].shape[0], tuple(state["rises"].shape)) != (
            n, n, (len(groups), n)):
        raise ValueError(f"{name}.pt does not hold one row per window ({n}) and group "
                         f"({len(groups)})")
    return Analysis(name, record["run"], record["run_sha256"], groups, state["losses"],
                    state["last"], state["rises"], record.get("cpu_seconds"))
