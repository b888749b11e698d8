"""`make models`: train the runs that the chapters "Induction heads" and "A language model on
real text" load, and write them.

    python tools/models.py            every run of RUNS and LM_RUNS
    python tools/models.py NAME ...   only these

Each run is `train(config, seed)` of code/induction.py (RUNS) or code/lm.py (LM_RUNS), one
after another on one thread, in float64. It is written to models/induction/ or models/lm/ as
`<name>.pt` (the state_dict) and `<name>.json` (its config, seed and log, the torch version and
the .pt's SHA-256), which are committed: the chapters load them instead of training in their
cells (README says why), and tests/test_models.py checks them against the book's code. The
CPU seconds of each run and of the whole are printed.
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="runs to train (default: all)")
    names = parser.parse_args(argv).names or [*RUNS, *LM_RUNS]
    unknown = [name for name in names if name not in RUNS and name not in LM_RUNS]
    if unknown:
        parser.error(f"no run {unknown[0]!r}; the runs: {', '.join([*RUNS, *LM_RUNS])}")
    torch.set_num_threads(1)
    total = time.process_time()
    for name in names:
        if name in LM_RUNS:
            train_language_model(name)
            continue
        config, seed = RUNS[name]
        start = time.process_time()
        model, log = train(config, seed)
        save_run(FOLDER, name, config, seed, model, log)
        step = phase_change_step(log, phase_threshold(config))
        print(f"{name}: {time.process_time() - start:.1f} s of CPU, phase change at step "
              f"{step}, final loss on the repeated part {log[-1]['loss']:.3f}", flush=True)
    folders = sorted({(LM_FOLDER if name in LM_RUNS else FOLDER).relative_to(ROOT).as_posix()
                      for name in names})
    print(f"{len(names)} runs in {time.process_time() - total:.1f} s of CPU, written to "
          f"{' and '.join(f'{folder}/' for folder in folders)}")


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
