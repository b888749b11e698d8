"""The trained runs committed in models/induction/ and models/lm/ (`make models`,
tools/models.py), which the chapters "Induction heads" and "A language model on real text" load:
each is one of the runs tools/models.py trains, its weights are the ones its JSON's hash names,
the book's code retrained for its first steps (50 of an induction run, 10 of the language
model) reproduces the start of its log, and its weights, evaluated by the book's code, give the
end of its log.

Tolerance: the logs are float64. Retraining the first 50 steps of a two-layer, a one-layer and a
fixed-length run under ATEN_CPU_CAPABILITY=default and =avx2 gave logs that differ by at most
4.4e-16 (the committed runs were trained on an AVX2 machine); TOLERANCE leaves six orders of
magnitude above that, far below the 3-digit numbers the chapter prints. Run this file under
both capabilities to check (`ATEN_CPU_CAPABILITY=default pytest tests/test_models.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

import induction as ind
import models

torch.set_num_threads(1)

TOLERANCE = 1e-10  # absolute, on losses and scores
RETRAINED_STEPS = 50
FOLDER = models.FOLDER
COMMITTED = sorted(path.stem for path in FOLDER.glob("*.json"))


def values(record: dict) -> list[float]:
    """A log record's numbers, in a fixed order."""
    return [record["loss"], record["heldout_loss"],
            *(x for layer in record["previous_token"] for x in layer),
            *(x for layer in record["induction"] for x in layer)]


def assert_records_close(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        a, b = values(g), values(w)
        assert len(a) == len(b)
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst <= TOLERANCE, f"step {g['step']}: differs by {worst:.3g}"


def test_the_committed_runs_are_the_runs_make_models_trains():
    assert COMMITTED == sorted(models.RUNS), "run `make models` and commit models/induction/"
    assert sorted(p.name for p in FOLDER.iterdir()) == sorted(
        f"{name}{suffix}" for name in COMMITTED for suffix in (".json", ".pt"))


@pytest.mark.parametrize("name", COMMITTED)
def test_the_json_names_the_weights_and_the_run(name):
    record = json.loads((FOLDER / f"{name}.json").read_text())
    assert record["sha256"] == hashlib.sha256((FOLDER / f"{name}.pt").read_bytes()).hexdigest()
    config, seed = models.RUNS[name]
    assert record["name"] == name and record["seed"] == seed
    assert ind.Config.from_dict(record["config"]) == config
    assert record["torch"].startswith("2.")
    assert [r["step"] for r in record["log"]] == list(range(0, config.steps + 1,
                                                            config.log_every))
    assert (FOLDER / f"{name}.pt").stat().st_size < 120_000  # small files only


@pytest.mark.parametrize("name", COMMITTED)
def test_retraining_the_first_steps_reproduces_the_log(name):
    run = ind.load_run(name, FOLDER)
    short = dataclasses.replace(run.config, steps=RETRAINED_STEPS)
    _, log = ind.train(short, run.seed)
    assert_records_close(log, run.log[:len(log)])


@pytest.mark.parametrize("name", COMMITTED)
def test_the_weights_give_the_logs_final_values(name):
    run = ind.load_run(name, FOLDER)
    final = {"step": run.config.steps,
             **ind.evaluate(run.model, ind.evaluation_sets(run.config))}
    assert_records_close([final], run.log[-1:])


# --- the language model of chapter 13 (models/lm/) ---------------------------------------------

import lm  # noqa: E402

LM_FOLDER = models.LM_FOLDER
LM_COMMITTED = sorted(path.stem for path in LM_FOLDER.glob("*.json"))
LM_RETRAINED_STEPS = 10


def test_the_committed_language_model_is_the_run_make_models_trains():
    assert LM_COMMITTED == sorted(models.LM_RUNS), "run `make models` and commit models/lm/"
    assert sorted(p.name for p in LM_FOLDER.iterdir()) == sorted(
        f"{name}{suffix}" for name in LM_COMMITTED for suffix in (".json", ".pt"))


@pytest.mark.parametrize("name", LM_COMMITTED)
def test_the_language_models_json_names_its_weights_its_text_and_its_run(name):
    record = json.loads((LM_FOLDER / f"{name}.json").read_text())
    assert record["sha256"] == hashlib.sha256((LM_FOLDER / f"{name}.pt").read_bytes()).hexdigest()
    config, seed = models.LM_RUNS[name]
    assert record["name"] == name and record["seed"] == seed
    assert lm.Config.from_dict(record["config"]) == config
    assert record["chars"] == "".join(lm.Vocabulary(lm.load_text()).chars)
    log = record["log"]
    assert len(log["loss"]) == len(log["lr"]) == config.steps
    assert [r["step"] for r in log["eval"]] == list(range(0, config.steps + 1, config.eval_every))
    assert (LM_FOLDER / f"{name}.pt").stat().st_size < 2_000_000


@pytest.mark.parametrize("name", LM_COMMITTED)
def test_retraining_the_language_models_first_steps_reproduces_its_log(name):
    run = lm.load_run(name, LM_FOLDER)
    _, log = lm.train(run.config, run.seed, until=LM_RETRAINED_STEPS)  # the same schedule
    for key in ("lr", "loss"):
        worst = max(abs(a - b) for a, b in zip(log[key], run.log[key][:LM_RETRAINED_STEPS]))
        assert len(log[key]) == LM_RETRAINED_STEPS and worst <= TOLERANCE, (key, worst)
    assert abs(log["eval"][0]["held_out"] - run.log["eval"][0]["held_out"]) <= TOLERANCE


@pytest.mark.parametrize("name", LM_COMMITTED)
def test_the_language_models_weights_give_its_final_held_out_loss(name):
    run = lm.load_run(name, LM_FOLDER)
    vocab = lm.Vocabulary(lm.load_text())
    _, held_out = lm.split(vocab.encode(lm.load_text()), run.config.fraction)
    assert abs(lm.evaluate(run.model, held_out) - run.log["eval"][-1]["held_out"]) <= TOLERANCE
