"""`make models`: train the runs that the chapter "Induction heads" loads, and write them.

    python tools/models.py            every run of RUNS
    python tools/models.py NAME ...   only these

Each run is `train(config, seed)` of code/induction.py, one after another on one thread, in
float64. It is written to models/induction/ as `<name>.pt` (the state_dict) and `<name>.json`
(its config, seed and log, the torch version and the .pt's SHA-256), which are committed: the
chapter loads them instead of training in its cells (README says why), and
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

from induction import MODELS, Config, phase_change_step, phase_threshold, save_run, train  # noqa: E402

FOLDER = ROOT / MODELS
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="runs to train (default: all)")
    names = parser.parse_args(argv).names or list(RUNS)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"no run {unknown[0]!r}; the runs: {', '.join(RUNS)}")
    torch.set_num_threads(1)
    total = time.process_time()
    for name in names:
        config, seed = RUNS[name]
        start = time.process_time()
        model, log = train(config, seed)
        save_run(FOLDER, name, config, seed, model, log)
        step = phase_change_step(log, phase_threshold(config))
        print(f"{name}: {time.process_time() - start:.1f} s of CPU, phase change at step "
              f"{step}, final loss on the repeated part {log[-1]['loss']:.3f}", flush=True)
    print(f"{len(names)} runs in {time.process_time() - total:.1f} s of CPU, written to "
          f"{FOLDER.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
