"""`make models`: train the runs that the chapters "Multi-head attention", "Position",
"Inference", "The Transformer block", "Induction heads" and "A language model on real text"
load, and write them.

    python tools/models.py            every run of POSITION_RUNS, LOOKUP_RUNS, BLOCK_RUNS, RUNS,
                                      LM_RUNS, LM_ANALYSES, LM_TRACES, SINK_RUNS, LM_TOKENIZERS
                                      and LM_COMPARISON
    python tools/models.py NAME ...   only these

Each run is `train(config, seed)` of code/induction.py (RUNS) or code/lm.py (LM_RUNS), or, for
chapter "Multi-head attention" (LOOKUP_RUNS), `train(num_heads, seed)` of code/lookups.py, or,
for chapter "Position" (POSITION_RUNS), `train(method, target=...)` of code/extrapolation.py
(three seeds side by side), or,
for chapter "The Transformer block" (BLOCK_RUNS), `train_reversal(config, seed)` or
`measure_gradients(config)` of code/transformer.py, one after another on one thread, in
float64; an analysis of LM_ANALYSES measures, from the committed weights of a run of LM_RUNS
(not retrained), its predictions on the held-out text and what silencing each head and each
layer costs there (`analyse` of code/lm.py); a run of LM_TRACES is the first `until` steps of
`train(config, seed, until=..., traced=True)` of code/lm.py, which also logs the gradient's
norm and `trace`'s measurements (the in-context learning score, the induction scores); a run of
SINK_RUNS, for chapter "Inference", is
`train(config, seed, text)` of code/lm.py on a made-up text (`recent_copies_text`); a tokenizer
of LM_TOKENIZERS, for chapter 13, is SentencePiece's byte-pair tokenizer trained on the training
text (`train_tokenizer` of code/lm.py), written as `<name>.model` and `<name>.json`, and a run
of LM_COMPARISON is `train(config, seed, tokenizer=...)` on its tokens, or on characters. Each is
written to models/induction/, models/lm/, models/lookups/, models/position/, models/block/ or
models/sinks/ as
`<name>.pt` (the state_dict; for a measurement its numbers as tensors) and `<name>.json` (its
config, seed and log, the torch version and the .pt's SHA-256), which are
committed: the chapters load them instead of training in their cells (README says why), and
tests/test_models.py checks them against the book's code. The CPU seconds of each run and of
the whole are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import extrapolation  # noqa: E402
import lm  # noqa: E402
import lookups  # noqa: E402
import transformer  # noqa: E402
from induction import MODELS, Config, phase_change_step, phase_threshold, save_run, train  # noqa: E402

FOLDER = ROOT / MODELS
LM_FOLDER = ROOT / lm.MODELS
TWO = Config()  # the chapter's model: two attention layers of one head, random positions
ONE = Config(n_layers=1)  # the one-layer control
FIXED = dict(train_lengths=(12, 12), heldout_lengths=(3, 8))  # the careless set-up: 12 of 24
SEEDS = range(5)

# name -> (config, seed): every run the chapter shows
RUNS = {
    **{f"two-layer-seed{s}": (TWO, s) for s in SEEDS},
    **{f"one-layer-seed{s}": (ONE, s) for s in SEEDS},
    **{f"one-layer-fixed-seed{s}": (Config(n_layers=1, **FIXED), s) for s in range(3)},
    **{f"two-layer-fixed-seed{s}": (Config(**FIXED), s) for s in range(3)},
}

# name -> (config, seed): the language model of chapter 13, on data/shakespeare.txt
LM_RUNS = {"shakespeare": (lm.Config(), 0)}
# name -> run: a committed run of LM_RUNS on every window of the held-out text, measured from
# its weights as committed (not retrained): its predictions, and what silencing each head, then
# each layer, costs
LM_ANALYSES = {"shakespeare-held-out": "shakespeare"}
# name -> (config, seed, until): chapter 13's traced runs, the first `until` steps of a run of
# the chapter's recipe (its schedule still the one that ends at config.steps), logging every
# step's gradient norm and, at every evaluation, `lm.trace`'s measurements (the held-out loss
# at each position, the induction scores): the committed run's start, and the same model and
# seed on windows that each hold a passage twice, the second copy 32 characters after the first,
# or after 8 to 32 (so that only the passage's content, not a position, says where to copy from)
LM_TRACES = {"shakespeare-traced": (lm.Config(), 0, 800),
             "shakespeare-repeats": (lm.Config(repeat=1.0), 0, 800),
             "shakespeare-repeats-varied": (lm.Config(repeat=1.0, repeat_min=8), 0, 800)}
# name -> vocab_size: chapter 13's byte-pair tokenizer, trained by SentencePiece on the training
# part of the text only (lm.split_text), twice, to check that it comes out the same; written as
# <name>.model and <name>.json
LM_TOKENIZERS = {"bpe512": 512}
# name -> (config, seed, tokenizer): chapter 13's comparison at equal compute, one config smaller
# than the chapter's (two blocks, 800 steps) trained on characters (None) and on the tokens of a
# tokenizer of LM_TOKENIZERS: the same widths, context in positions, batch and steps
LM_SMALL = lm.Config(num_layers=2, steps=800)
LM_COMPARISON = {"small-chars": (LM_SMALL, 0, None), "small-bpe512": (LM_SMALL, 0, "bpe512")}

# name -> (config, seed): chapter 11's warm-up experiment, three seeds of each setting (post-LN
# at the full rate at once, post-LN with a warm-up of 20 steps, pre-LN at once), and its
# measurement of the gradients at initialisation over depth (seeds 0 to 3, no training)
BLOCK_FOLDER = ROOT / transformer.MODELS
BLOCK_SETTINGS = {"post-ln": transformer.ReversalConfig(norm_first=False, warmup=0),
                  "post-ln-warmup": transformer.ReversalConfig(norm_first=False, warmup=20),
                  "pre-ln": transformer.ReversalConfig(norm_first=True, warmup=0)}
BLOCK_RUNS = {
    **{f"{setting}-seed{s}": (config, s) for setting, config in BLOCK_SETTINGS.items()
       for s in range(3)},
    "gradients-at-init": (transformer.GradientConfig(), None),
    "gradients-at-init-scaled": (transformer.GradientConfig(scaled=True), None),  # GPT-2's
}
# name -> (heads, seed): chapter 6's two-lookup task, four seeds with two heads of width 16 and
# the same four seeds with one head of width 32
LOOKUP_FOLDER = ROOT / lookups.MODELS
LOOKUP_RUNS = {f"heads{h}-seed{s}": (h, s) for h in (2, 1) for s in range(4)}
# name -> (config, seed, text): chapter 9's model with an attention sink, a small language model
# of code/lm.py trained on a made-up text (``recent_copies_text``) in which a head must often
# find nothing; its held-out tenth is written beside the run as <name>-held-out.txt
SINK_FOLDER = ROOT / "models" / "sinks"
SINK_TEXT = dict(length=200_000, letters=16, reach=8, p_copy=0.8, seed=0)
SINK_RUNS = {"recent-copies": (lm.Config(context=32, d_model=32, num_heads=2, d_ff=64,
                                         num_layers=2, steps=3000, warmup=30, eval_every=500),
                               0, SINK_TEXT)}
# name -> (method, target): chapter 8's previous-token task, three seeds side by side per run
POSITION_FOLDER = ROOT / extrapolation.MODELS
POSITION_RUNS = extrapolation.RUNS
ALL_RUNS = [*POSITION_RUNS, *LOOKUP_RUNS, *BLOCK_RUNS, *RUNS, *LM_RUNS,
            *LM_ANALYSES, *LM_TRACES,  # the analyses after the runs they read
            *SINK_RUNS, *LM_TOKENIZERS, *LM_COMPARISON]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="runs to train (default: all)")
    names = parser.parse_args(argv).names or ALL_RUNS
    unknown = [name for name in names if name not in ALL_RUNS]
    if unknown:
        parser.error(f"no run {unknown[0]!r}; the runs: {', '.join(ALL_RUNS)}")
    torch.set_num_threads(1)
    total = time.process_time()
    for name in names:
        if name in LM_RUNS:
            train_language_model(name)
            continue
        if name in LM_ANALYSES:
            analyse_language_model(name)
            continue
        if name in LM_TRACES:
            trace_language_model(name)
            continue
        if name in LM_TOKENIZERS:
            train_tokenizer(name)
            continue
        if name in LM_COMPARISON:
            train_comparison_model(name)
            continue
        if name in SINK_RUNS:
            train_sink_model(name)
            continue
        if name in BLOCK_RUNS:
            run_block_experiment(name)
            continue
        if name in LOOKUP_RUNS:
            train_lookups(name)
            continue
        if name in POSITION_RUNS:
            train_position_models(name)
            continue
        config, seed = RUNS[name]
        start = time.process_time()
        model, log = train(config, seed)
        save_run(FOLDER, name, config, seed, model, log)
        step = phase_change_step(log, phase_threshold(config))
        print(f"{name}: {time.process_time() - start:.1f} s of CPU, phase change at step "
              f"{step}, final loss on the repeated part {log[-1]['loss']:.3f}", flush=True)
    folders = sorted({folder_of(name).relative_to(ROOT).as_posix() for name in names})
    print(f"{len(names)} runs in {time.process_time() - total:.1f} s of CPU, written to "
          f"{' and '.join(f'{folder}/' for folder in folders)}")


def folder_of(name: str) -> pathlib.Path:
    """Where the run ``name`` is written."""
    if name in LM_RUNS or name in LM_ANALYSES or name in LM_TRACES or name in LM_TOKENIZERS or (
            name in LM_COMPARISON):
        return LM_FOLDER
    if name in LOOKUP_RUNS:
        return LOOKUP_FOLDER
    if name in POSITION_RUNS:
        return POSITION_FOLDER
    if name in SINK_RUNS:
        return SINK_FOLDER
    return BLOCK_FOLDER if name in BLOCK_RUNS else FOLDER


def train_lookups(name: str) -> None:
    """Chapter 6's run ``name``: one model of the two-lookup task trained."""
    num_heads, seed = LOOKUP_RUNS[name]
    start = time.process_time()
    model, losses = lookups.train(num_heads, seed)
    seconds = round(time.process_time() - start, 1)
    log = {"loss": losses, "eval_loss": lookups.evaluation_loss(model)}
    lookups.save_run(LOOKUP_FOLDER, name, num_heads, seed, lookups.STEPS, model, log,
                     cpu_seconds=seconds)
    print(f"{name}: {seconds:.1f} s of CPU, mean loss of the last 10 steps "
          f"{sum(losses[-10:]) / 10:.4f}, evaluation loss {log['eval_loss']:.4f}", flush=True)


def train_position_models(name: str) -> None:
    """Chapter 8's run ``name``: one method's three seeds trained side by side on one target."""
    method, target = POSITION_RUNS[name]
    start = time.process_time()
    model, losses = extrapolation.train(method, target=extrapolation.TARGETS[target])
    seconds = round(time.process_time() - start, 1)
    seen, unseen = extrapolation.accuracy(model, extrapolation.TARGETS[target])
    log = {"loss": losses, "seen": seen.tolist(), "unseen": unseen.tolist()}
    extrapolation.save_run(POSITION_FOLDER, name, method, target, extrapolation.STEPS, model, log,
                           cpu_seconds=seconds)
    print(f"{name}: {seconds:.1f} s of CPU, accuracy at positions 1-15 "
          f"{float(seen.mean()):.3f}, at 16-31 {float(unseen.mean()):.3f}", flush=True)


def run_block_experiment(name: str) -> None:
    """Chapter 11's run ``name``: a reversal run trained, or the gradients measured."""
    config, seed = BLOCK_RUNS[name]
    start = time.process_time()
    if isinstance(config, transformer.GradientConfig):
        log = transformer.measure_gradients(config)
        seconds = round(time.process_time() - start, 1)
        transformer.save_run(BLOCK_FOLDER, name, config, seed, log, cpu_seconds=seconds)
        print(f"{name}: {seconds:.1f} s of CPU, depths {list(config.depths)}, "
              f"{config.seeds} seeds", flush=True)
        return
    model, log = transformer.train_reversal(config, seed)
    seconds = round(time.process_time() - start, 1)
    transformer.save_run(BLOCK_FOLDER, name, config, seed, log, model, cpu_seconds=seconds)
    print(f"{name}: {seconds:.1f} s of CPU, mean loss of the last 10 steps "
          f"{sum(log['loss'][-10:]) / 10:.3f}, evaluation loss {log['eval'][-1]['loss']:.3f}",
          flush=True)


def analyse_language_model(name: str) -> None:
    """The analysis ``name`` of LM_ANALYSES, from the committed weights of its run."""
    start = time.process_time()
    run = lm.load_run(LM_ANALYSES[name], LM_FOLDER)
    text = lm.load_text()
    _, held_out = lm.split(lm.Vocabulary(text).encode(text), run.config.fraction)
    groups = lm.ablation_groups(run.config.num_layers, run.config.num_heads)
    tensors = lm.analyse(run, held_out, groups)
    seconds = round(time.process_time() - start, 1)
    lm.save_analysis(LM_FOLDER, name, run, groups, tensors, cpu_seconds=seconds)
    print(f"{name}: {seconds:.1f} s of CPU, {run.name} on {len(tensors['losses'])} held-out "
          f"windows, {len(groups)} groups of heads silenced", flush=True)


def train_language_model(name: str) -> None:
    config, seed = LM_RUNS[name]
    start = time.process_time()
    text = lm.load_text()
    model, log = lm.train(config, seed, text)
    lm.save_run(LM_FOLDER, name, config, seed, model, log, lm.Vocabulary(text),
                cpu_seconds=round(time.process_time() - start, 1))
    print(f"{name}: {time.process_time() - start:.1f} s of CPU, held-out loss "
          f"{log['eval'][0]['held_out']:.3f} at step 0, {log['eval'][-1]['held_out']:.3f} at step "
          f"{log['eval'][-1]['step']}", flush=True)


def trace_language_model(name: str) -> None:
    """The traced run ``name`` of LM_TRACES: the first ``until`` steps of its recipe."""
    config, seed, until = LM_TRACES[name]
    start = time.process_time()
    text = lm.load_text()
    model, log = lm.train(config, seed, text, until=until, traced=True)
    seconds = round(time.process_time() - start, 1)
    lm.save_run(LM_FOLDER, name, config, seed, model, log, lm.Vocabulary(text),
                cpu_seconds=seconds, until=until)
    norms = torch.tensor(log["grad_norm"])
    print(f"{name}: {seconds:.1f} s of CPU, {until} of {config.steps} steps, held-out loss "
          f"{log['eval'][-1]['held_out']:.3f}, gradient clipped at {int((norms > config.clip).sum())}"
          f" steps, highest induction score {max(max(r) for r in log['eval'][-1]['induction']):.2f}",
          flush=True)


def train_tokenizer(name: str) -> None:
    """The tokenizer ``name`` of LM_TOKENIZERS, trained twice on the training text (the same
    bytes both times, or nothing is written) and written with its provenance."""
    vocab_size = LM_TOKENIZERS[name]
    start = time.process_time()
    train_text, _ = lm.split_text(lm.load_text(), lm.Config().fraction)
    model = lm.train_tokenizer(train_text, vocab_size)
    if lm.train_tokenizer(train_text, vocab_size) != model:
        raise RuntimeError(f"{name}: a second training gave another tokenizer")
    seconds = round(time.process_time() - start, 2)
    head = {"vocab_size": vocab_size, "text": f"{lm.DATA}/{lm.TEXT}",
            "fraction": lm.Config().fraction, "characters": len(train_text),
            "text_sha256": hashlib.sha256(train_text.encode("utf-8")).hexdigest(),
            "options": lm.TOKENIZER_OPTIONS, "cpu_seconds": seconds}
    lm.save_tokenizer(LM_FOLDER, name, model, head)
    tokenizer = lm.load_tokenizer(name, LM_FOLDER)
    print(f"{name}: {seconds:.2f} s of CPU for two trainings, {len(tokenizer)} pieces, "
          f"{len(train_text) / len(tokenizer.encode(train_text)):.2f} characters per token on "
          "the training text", flush=True)


def train_comparison_model(name: str) -> None:
    """The run ``name`` of LM_COMPARISON: on characters, or on the tokens of its tokenizer
    (committed: run its entry of LM_TOKENIZERS first)."""
    config, seed, tokenizer_name = LM_COMPARISON[name]
    start = time.process_time()
    text = lm.load_text()
    tokenizer = None if tokenizer_name is None else lm.load_tokenizer(tokenizer_name, LM_FOLDER)
    model, log = lm.train(config, seed, text, tokenizer=tokenizer)
    seconds = round(time.process_time() - start, 1)
    lm.save_run(LM_FOLDER, name, config, seed, model, log,
                lm.Vocabulary(text) if tokenizer is None else tokenizer, cpu_seconds=seconds)
    print(f"{name}: {seconds:.1f} s of CPU, held-out loss {log['eval'][-1]['held_out']:.3f} "
          f"nats per {'character' if tokenizer is None else 'token'}", flush=True)


def recent_copies_text(length: int, letters: int, reach: int, p_copy: float, seed: int) -> str:
    """Chapter 9's made-up text of ``length`` characters from the first ``letters`` of a-z.
    After character t: if the same character occurred at most ``reach`` places earlier, at its
    latest occurrence j, then with probability ``p_copy`` the next character is the one that
    followed it, at j + 1; otherwise it is drawn uniformly. A model predicts the copies by
    finding a recent match, and must find nothing (and take nothing from older matches) when
    there is none."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(letters, (length,), generator=generator).tolist()
    coins = torch.rand(length, generator=generator, dtype=torch.float64).tolist()
    text, latest = [draws[0]], {}  # latest: character -> its last position before t
    for t in range(length - 1):
        j = latest.get(text[t])
        latest[text[t]] = t
        copy = j is not None and t - j <= reach and coins[t] < p_copy
        text.append(text[j + 1] if copy else draws[t + 1])
    return "".join(chr(ord("a") + c) for c in text)


def train_sink_model(name: str) -> None:
    """The run ``name`` of SINK_RUNS: its text made, the model trained on it, the held-out
    part written beside the run, and the text's recipe added to the run's JSON."""
    config, seed, recipe = SINK_RUNS[name]
    start = time.process_time()
    text = recent_copies_text(**recipe)
    model, log = lm.train(config, seed, text)
    seconds = round(time.process_time() - start, 1)
    vocab = lm.Vocabulary(text)
    lm.save_run(SINK_FOLDER, name, config, seed, model, log, vocab, cpu_seconds=seconds)
    held_out = text[int(config.fraction * len(text)):]  # lm.split's part, as text
    (SINK_FOLDER / f"{name}-held-out.txt").write_text(held_out, encoding="utf-8")
    path = SINK_FOLDER / f"{name}.json"
    record = json.loads(path.read_text())
    record = {**{k: v for k, v in record.items() if k != "log"},  # the recipe before the log
              "text": {"recipe": "recent_copies_text", **recipe}, "log": record["log"]}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{name}: {seconds:.1f} s of CPU, held-out loss {log['eval'][0]['held_out']:.3f} at "
          f"step 0, {log['eval'][-1]['held_out']:.3f} at step {log['eval'][-1]['step']}",
          flush=True)


if __name__ == "__main__":
    main()
