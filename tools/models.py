"""`make models`: train the runs that the chapters "Multi-head attention", "The Transformer
block", "Induction heads" and "A language model on real text" load, and write them.

    python tools/models.py            every run of LOOKUP_RUNS, BLOCK_RUNS, RUNS, LM_RUNS and
                                      LM_ANALYSES
    python tools/models.py NAME ...   only these

Each run is `train(config, seed)` of code/induction.py (RUNS) or code/lm.py (LM_RUNS), or, for
chapter "Multi-head attention" (LOOKUP_RUNS), `train(num_heads, seed)` of code/lookups.py, or,
for chapter "The Transformer block" (BLOCK_RUNS), `train_reversal(config, seed)` or
`measure_gradients(config)` of code/transformer.py, one after another on one thread, in
float64; an analysis of LM_ANALYSES measures, from the committed weights of a run of LM_RUNS
(not retrained), its predictions on the held-out text and what silencing each head and each
layer costs there (`analyse` of code/lm.py). Each is written to models/induction/, models/lm/,
models/lookups/ or models/block/ as `<name>.pt` (the state_dict; for a measurement its numbers as tensors) and
`<name>.json` (its config, seed and log, the torch version and the .pt's SHA-256), which are
committed: the chapters load them instead of training in their cells (README says why), and
tests/test_models.py checks them against the book's code. The CPU seconds of each run and of
the whole are printed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

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
}
# name -> (heads, seed): chapter 6's two-lookup task, four seeds with two heads of width 16 and
# the same four seeds with one head of width 32
LOOKUP_FOLDER = ROOT / lookups.MODELS
LOOKUP_RUNS = {f"heads{h}-seed{s}": (h, s) for h in (2, 1) for s in range(4)}
ALL_RUNS = [*LOOKUP_RUNS, *BLOCK_RUNS, *RUNS, *LM_RUNS, *LM_ANALYSES]  # analyses after the runs they read


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
        if name in BLOCK_RUNS:
            run_block_experiment(name)
            continue
        if name in LOOKUP_RUNS:
            train_lookups(name)
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
    if name in LM_RUNS or name in LM_ANALYSES:
        return LM_FOLDER
    if name in LOOKUP_RUNS:
        return LOOKUP_FOLDER
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


if __name__ == "__main__":
    main()
