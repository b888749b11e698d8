"""Grading that the answer cannot reach (tools/isolated_grading.py).

The catalogue below attacks the grading the ways a determined student did: one test per
mechanism, each graded as nbgrader grades it (the answer cells in a process of their own, the
check's cases in this one), and each able to fail: the same answer earns points where the
mechanism works (in-process, in a student's own notebook, or with the scan left out). Right
answers in unusual styles keep their points.
"""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest
import torch

import checking
import isolated_grading as grading

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = {path.name: path.read_text() for path in sorted((ROOT / "code").glob("*.py"))}
# what an exercise sheet's imports cell gives the answers (the course's notebooks lock it)
PRELUDE = "import math\nimport torch\nimport torch.nn.functional as F\n"

CHECK = "check_stable_softmax"  # chapter 4's: a softmax written by hand, 8 cases
RIGHT = """
def stable_softmax(scores, dim=-1):
    top = scores.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exp = torch.exp(scores - top)
    return exp / exp.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
"""
STUB = """
def stable_softmax(scores, dim=-1):
    raise NotImplementedError()
"""
SHORTCUT = """
def stable_softmax(scores, dim=-1):
    return torch.softmax(scores.double(), dim).nan_to_num(0.0).to(scores.dtype)
"""


def _d(text: str) -> str:
    return textwrap.dedent(text)


def grade_many(answers: dict[str, str], *, scan: bool = True,
               timeout: float = 60) -> dict[str, tuple[int, dict]]:
    """{key: (points, {case: message or None})} for answer cells that each define
    `stable_softmax`, graded as nbgrader's GradeIsolated grades a notebook (scan=False: the
    separation of the processes alone). They share one notebook, so one answer's process:
    each answer's function is renamed after its key's position."""
    found = checking.find_check(CHECK)
    cells, tests = [(0, PRELUDE, False, "imports-0")], []
    for number, (key, source) in enumerate(answers.items(), 1):
        name = f"answer_{number}"
        cells.append((number, re.sub(r"\bstable_softmax\b", name, source), True,
                      f"answer cell {name}"))
        tests += [{"grade_id": f"{number}|{title}", "module": found.module, "check": CHECK,
                   "title": title, "names": [name]} for title in found.cases]
    verdict = grading.grade_notebook({"files": CODE, "cells": cells, "tests": tests,
                                      "timeout": timeout, "scan": scan})
    result = {}
    for number, key in enumerate(answers, 1):
        messages = {title: verdict["results"][f"{number}|{title}"] for title in found.cases}
        points = sum(worth for title, (_, worth, _) in found.cases.items()
                     if messages[title] is None)
        result[key] = (points, messages)
    result["flags"] = verdict["flags"]
    return result


def grade(source: str, *, scan: bool = True, check: str = CHECK,
          name: str = "stable_softmax") -> tuple[int, dict]:
    """(points, verdict) of one answer cell, graded alone."""
    found = checking.find_check(check)
    tests = [{"grade_id": title, "module": found.module, "check": check, "title": title,
              "names": [name]} for title in found.cases]
    job = {"files": CODE, "cells": [(0, PRELUDE, False, "imports-0"),
                                    (1, source, True, "answer cell stable_softmax")],
           "tests": tests, "timeout": 60, "scan": scan}
    verdict = grading.grade_notebook(job)
    points = sum(worth for title, (_, worth, _) in found.cases.items()
                 if verdict["results"][title] is None)
    return points, verdict


IN_PROCESS = """
import json, math, sys
import torch
import torch.nn.functional as F
import checking
namespace = {"torch": torch, "math": math, "F": F, "__name__": "answer"}
exec(compile(sys.stdin.read(), "/answer-cells/cell-1.py", "exec"), namespace)
found = checking.find_check(%r)
earned = 0
for title, (_, worth, _) in list(found.cases.items()):
    try:
        found.grade(title, namespace[%r])
        earned += worth
    except AssertionError:
        pass
print(json.dumps(earned))
"""


def in_process(source: str, check: str = CHECK, name: str = "stable_softmax") -> int:
    """The points the same answer earns from the check run in its own process, as in a
    student's notebook (a fresh Python, since the attack changes what it reaches)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IN_PROCESS % (check, name)], input=source,
                          text=True,
                          capture_output=True, cwd=ROOT / "code", check=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "code")})
    return json.loads(proc.stdout.strip().splitlines()[-1])


FULL = checking.find_check(CHECK).points


@pytest.fixture(scope="module")
def plain_answers():
    return grade_many({"right": RIGHT, "stub": STUB, "shortcut": SHORTCUT, **UNUSUAL_RIGHT})


def test_a_right_answer_earns_every_point_and_a_stub_none(plain_answers):
    assert plain_answers["right"][0] == FULL
    points, messages = plain_answers["stub"]
    assert points == 0
    assert all(checking.NOT_WRITTEN in message for message in messages.values())


def test_a_forbidden_shortcut_earns_nothing(plain_answers):
    points, messages = plain_answers["shortcut"]
    assert points == 0
    assert "softmax" in messages["ordinary scores, dim=-1"]


# ---------------------------------------------------------------------------------------------
# What the separation of the processes holds by itself (the scan left out)


HONEST = RIGHT.replace("stable_softmax", "honest")  # the right answer, under another name
SEPARATION = {
    "Check.grade replaced": _d("""
        import checking
        checking.Check.grade = lambda self, title, *a: print(title + ": passed")
        checking.Check._run = lambda self, title, answer: None
        """) + STUB,
    "the check object replaced in its module": _d("""
        import sys, types
        fake = types.SimpleNamespace(grade=lambda *a: None, __call__=lambda *a: None)
        sys.modules["checks_softmax_saturation"] = types.SimpleNamespace(
            check_stable_softmax=fake)
        """) + STUB,
    "the rules emptied": _d("""
        import checking
        checking.Rule.seen_in = lambda self, recorded: None
        checking.softmax_rules = lambda *a, **k: []
        """) + SHORTCUT,
    "work deferred into a tensor subclass that runs when the result is read": _d("""
        class Lazy(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                args = [torch.softmax(a.scores, a.dim).nan_to_num(0.0)
                        if isinstance(a, Lazy) else a for a in args]
                return func(*args, **(kwargs or {}))

        def stable_softmax(scores, dim=-1):
            out = torch.zeros_like(scores).as_subclass(Lazy)
            out.scores, out.dim = scores.detach().double(), dim
            return out
        """),
    "comparisons forged by a subclass's __torch_function__": _d("""
        class Forged(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in (
                        "allclose", "equal", "isclose", "__eq__", "all", "any", "__bool__",
                        "assert_close", "item", "max", "abs", "sub", "__sub__"):
                    return torch.tensor(True) if func.__name__ != "item" else 0.0
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))

        def stable_softmax(scores, dim=-1):
            return torch.full_like(scores, 0.5).as_subclass(Forged)
        """),
    "the check's references and PyTorch's comparisons replaced": _d("""
        import checking
        torch.allclose = lambda *a, **k: True
        torch.equal = lambda *a, **k: True
        torch.testing.assert_close = lambda *a, **k: None
        torch.Tensor.__eq__ = lambda self, other: torch.ones((), dtype=torch.bool)
        checking._same = lambda a, b: True

        def stable_softmax(scores, dim=-1):
            return torch.full_like(scores, 0.5)
        """),
    "the check's pre-scan recognised (its stdout is None)": HONEST + _d("""
        import sys

        def stable_softmax(scores, dim=-1):
            if sys.stdout is None:  # in-process, the pre-scan silences its output
                return honest(scores, dim)
            return torch.softmax(scores.double(), dim).nan_to_num(0.0).to(scores.dtype)
        """),
    "honest while the check looks, the shortcut afterwards (a call counter)": HONEST + _d("""
        calls = [0]

        def stable_softmax(scores, dim=-1):
            calls[0] += 1
            if calls[0] <= 12:
                return honest(scores, dim)
            return torch.softmax(scores.double(), dim).nan_to_num(0.0).to(scores.dtype)
        """),
    "NumPy through tolist()": _d("""
        import numpy as np

        def stable_softmax(scores, dim=-1):
            z = np.array(scores.double().tolist())
            z = z - np.where(np.isfinite(z.max(axis=dim, keepdims=True)),
                             z.max(axis=dim, keepdims=True), 0)
            e = np.exp(z)
            out = e / np.maximum(e.sum(axis=dim, keepdims=True), 1e-300)
            return torch.tensor(out.tolist(), dtype=scores.dtype)
        """),
    "the book's own FlashAttention as a softmax": _d("""
        import flash

        def stable_softmax(scores, dim=-1):
            z = scores.movedim(dim, -1).double()
            n = z.shape[-1]
            q = torch.ones(*z.shape[:-1], 1, dtype=z.dtype)
            eye = torch.eye(n, dtype=z.dtype)
            rows = flash.flash_attention(q.unsqueeze(-2).expand(*z.shape[:-1], 1, 1),
                                         z.unsqueeze(-1), eye, scale=1.0)
            return rows.squeeze(-2).nan_to_num(0.0).to(scores.dtype).movedim(-1, dim)
        """),
}


@pytest.fixture(scope="module")
def separated():
    return grade_many(SEPARATION, scan=False)


@pytest.mark.parametrize("mechanism", SEPARATION)
def test_the_separation_alone_gives_an_attack_nothing(separated, mechanism):
    points, messages = separated[mechanism]
    assert points == 0, (mechanism, messages)


@pytest.mark.parametrize("mechanism", ["Check.grade replaced", "the rules emptied"])
def test_those_attacks_work_where_the_check_shares_the_answers_process(mechanism):
    """The catalogue can fail: in one process (a student's own notebook), these take points."""
    assert in_process(SEPARATION[mechanism]) > 0, mechanism


# ---------------------------------------------------------------------------------------------
# What the scan holds: the record is made in the answer's process, so what could edit it is
# flagged to the instructor, by cell, and earns nothing


SCANNED = {
    "the recording switched off": (_d("""
        torch._C._autograd._enable_record_function(False)
        """) + SHORTCUT, "torch._C"),
    "sys.setprofile": (_d("""
        import sys

        def stable_softmax(scores, dim=-1):
            sys.setprofile(None)
            sys.settrace(None)
            return torch.softmax(scores.double(), dim).nan_to_num(0.0).to(scores.dtype)
        """), "setprofile"),
    "a helper's __code__ replaced": (_d("""
        import checking
        checking.Rule.seen_in.__code__ = (lambda self, recorded: None).__code__
        """) + SHORTCUT, "__code__"),
    "a copy compiled under a library's file name": (_d("""
        source = "def stable_softmax(scores, dim=-1):\\n    return torch.softmax(scores, dim)"
        exec(compile(source, torch.__file__, "exec"), globals())
        """), "exec"),
    "a write into the grading's channel": (_d("""
        import os
        os.write(4, b"\\0" * 8)
        """) + RIGHT, "os.write"),
    "the garbage collector's objects": (_d("""
        import gc
        rules = [o for o in gc.get_objects() if type(o).__name__ == "Rule"]
        """) + SHORTCUT, "gc"),
    "sys.modules reached by getattr": (_d("""
        modules = getattr(__import__("sys"), "mod" + "ules")
        """) + SHORTCUT, "getattr"),
    "a frame's globals": (_d("""
        import inspect

        def stable_softmax(scores, dim=-1):
            inspect.currentframe().f_back.f_globals["x"] = 1
            return torch.softmax(scores.double(), dim).nan_to_num(0.0).to(scores.dtype)
        """), "frames"),
    "a TorchDispatchMode": (_d("""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Hide(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
        """) + SHORTCUT, "TorchDispatchMode"),
}


@pytest.mark.parametrize("mechanism", SCANNED)
def test_the_scan_flags_what_could_edit_the_record(mechanism):
    source, named = SCANNED[mechanism]
    flags = grading.scan(source)
    assert any(named in flag for flag in flags), (mechanism, flags)


def test_a_flagged_notebook_earns_nothing_and_says_where():
    source, _ = SCANNED["the recording switched off"]
    points, verdict = grade(source)
    assert points == 0
    assert verdict["flags"] and all(flag.startswith("answer cell stable_softmax: line ")
                                    for flag in verdict["flags"])
    assert all("your instructor will look at it" in m for m in verdict["results"].values())


def test_without_the_scan_the_recording_switched_off_would_pass():
    """Why the scan exists: the record of what ran is made in the answer's own process."""
    source, _ = SCANNED["the recording switched off"]
    assert grade(source, scan=False)[0] > 0


def test_the_audit_hook_catches_a_descriptor_opened_by_number():
    points, verdict = grade(_d("""
        channel = open(4, "wb", closefd=False)
        """) + RIGHT, scan=False)
    assert points == 0
    assert any("file descriptor" in flag for flag in verdict["flags"]), verdict


# ---------------------------------------------------------------------------------------------
# Right answers in unusual styles keep their points


UNUSUAL_RIGHT = {
    "a log file appended to": _d("""
        import tempfile, pathlib
        LOG = pathlib.Path(tempfile.gettempdir()) / "stable-softmax-log.txt"
        """) + RIGHT.replace("    top = scores", "    with open(LOG, 'a') as log:\n"
                            "        log.write(str(tuple(scores.shape)))\n    top = scores"),
    "inspect.stack() for a depth": _d("""
        import inspect
        """) + RIGHT.replace("    top = scores", "    depth = len(inspect.stack())\n    top = scores"),
    "getattr with a plain name, re.compile": _d("""
        import re
        PATTERN = re.compile("x")
        exp_ = getattr(torch, "exp")
        """) + RIGHT.replace("torch.exp(", "exp_("),
}


@pytest.mark.parametrize("style", UNUSUAL_RIGHT)
def test_a_right_answer_in_an_unusual_style_keeps_every_point(plain_answers, style):
    points, messages = plain_answers[style]
    assert points == FULL, messages
    assert plain_answers["flags"] == []  # none of these answers is flagged


DEFERRED_FLOAT = _d("""
    class Later:
        \"\"\"A variance measured only when the check converts it to a float.\"\"\"

        def __init__(self, d_k, n, sigma, seed, scaled):
            self.args = d_k, n, sigma, seed, scaled

        def __float__(self):
            d_k, n, sigma, seed, scaled = self.args
            torch.manual_seed(seed)  # the global generator, reseeded after the check looked
            scores = (sigma * torch.randn(n, d_k) * sigma * torch.randn(n, d_k)).sum(-1)
            return float((scores / d_k ** 0.5 if scaled else scores).var())

    def score_variance(d_k, n, sigma, generator):
        seed = generator.initial_seed()
        return Later(d_k, n, sigma, seed, False), Later(d_k, n, sigma, seed, True)
    """)


def test_work_deferred_into_a_float_conversion_is_recorded():
    """Chapter 3's exercise rules out reseeding PyTorch's global generator. In one process the
    reseeding deferred into __float__ runs when the check reads the number, after the
    recording, and the answer earns points; graded apart, the answer's process converts its
    results under the recording, so the reseeding is seen."""
    assert in_process(DEFERRED_FLOAT, "check_score_variance", "score_variance") > 0
    points, verdict = grade(DEFERRED_FLOAT, scan=False, check="check_score_variance",
                            name="score_variance")
    assert points == 0, verdict["results"]
    assert any("torch.manual_seed" in (m or "") for m in verdict["results"].values())


def test_an_endless_loop_costs_its_own_points_only():
    """A call that does not return in time stops the answer's process; the answers after it
    are graded in a fresh one."""
    graded = grade_many({"loops": _d("""
        def stable_softmax(scores, dim=-1):
            while True:
                pass
        """), "right": RIGHT}, timeout=3)
    points, messages = graded["loops"]
    assert points == 0 and "no reply in time" in messages["ordinary scores, dim=-1"]
    assert graded["right"][0] == FULL


def test_results_cross_as_plain_data():
    """What comes back from the answer's process is plain: a subclass becomes a Tensor, a
    NumPy array a foreign object that still converts to a float, an error keeps its type."""
    import numpy as np

    class Sub(torch.Tensor):
        pass

    made = grading.plain((torch.ones(2).as_subclass(Sub), np.array(2.5), {"k": [1, True]}))
    assert type(made[0]) is torch.Tensor and made[2] == {"k": [1, True]}
    back = grading.inbound(made)
    assert float(back[1]) == 2.5 and type(back[1]).__name__ == "ndarray"
    assert isinstance(grading.rebuilt_error("ValueError", "x"), ValueError)
    assert isinstance(grading.rebuilt_error("LinAlgError", "x"), RuntimeError)
    assert type(grading.rebuilt_error("LinAlgError", "x")).__name__ == "LinAlgError"


def test_nbgrader_autograde_steps_are_the_ones_the_course_extends():
    """The course's nbgrader_config.py lists nbgrader's autograde steps with HideTests and
    GradeIsolated added: when nbgrader changes its list, this fails and the course's must
    follow."""
    from nbgrader.converters import Autograde

    import classroom

    default = [cls.__name__ for cls in Autograde.class_traits()["autograde_preprocessors"].default()]
    text = classroom.NBGRADER_CONFIG
    listed = text[text.index("autograde_preprocessors = ["):].split("]", 1)[0]
    names = [name.strip() for name in listed.split("[", 1)[1].split(",") if name.strip()]
    assert [n for n in names if n not in ("HideTests", "GradeIsolated")] == default
    assert names.index("HideTests") < names.index("Execute") < names.index("GradeIsolated") \
        < names.index("SaveAutoGrades")


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie, not yet reaped, is gone too
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_grading_started_beside_the_kernel_keeps_its_time_limit():
    """HideTests starts the check's process before nbgrader's kernel runs the notebook and
    GradeIsolated collects its verdict (the nbgrader tests of test_classroom.py grade real
    submissions so). Its time limit counts from the start: answer cells that never finish cost
    every case and the process group (the answer's process with it) is killed; a grading never
    collected is stopped when the grading process exits."""
    found = checking.find_check(CHECK)
    tests = [{"grade_id": title, "module": found.module, "check": CHECK, "title": title,
              "names": ["stable_softmax"]} for title in found.cases]

    def job(source):
        return {"files": CODE, "cells": [(0, PRELUDE, False, "imports-0"),
                                         (1, source, True, "answer cell stable_softmax")],
                "tests": tests, "timeout": 60}

    stuck = grading.CheckProcess(job("while True:\n    pass\n"), timeout=8)
    verdict = stuck.verdict()
    assert set(verdict["results"].values()) == {"grading took longer than 8 s"}
    assert _gone(stuck.process.pid) and stuck not in grading._RUNNING

    forgotten = grading.CheckProcess(job(RIGHT), timeout=300)
    assert forgotten in grading._RUNNING
    grading._stop_running()
    forgotten.thread.join(30)
    assert not forgotten.thread.is_alive() and _gone(forgotten.process.pid)
    assert forgotten.verdict()["results"] != dict.fromkeys(found.cases)  # stopped, not graded


def test_the_capstone_is_graded_on_the_chapters_text_shipped_with_the_course(monkeypatch):
    """check_lm_capstone measures the answer's trained model on the held-out text: in the
    check's process the text comes with the course's files (data/, which `make assignments`
    copies), the training text goes to the answer's process and the weights come back. That
    process has imported what a first optimizer imports (the check's answer_imports) before the
    answer cells run, so that no answer's call imports it under the recording. Its answer cell
    imports a module of the book's code that nothing imported before, with Python writing
    bytecode, as it does unless PYTHONDONTWRITEBYTECODE is set: that import is not taken for a
    reach into the grading's channel."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    source = _d("""
        from torch import nn
        from transformer import TransformerBlock

        IMPORTED_BEFORE = "_dynamo" in dir(torch)  # (sys.modules: the scan would flag it)

        def train_lm(train_tokens, n_vocab, seconds):
            assert IMPORTED_BEFORE, "torch._dynamo was not imported before the answer cells"
            T, D = 16, 32
            model = nn.ModuleDict({
                "embed": nn.Embedding(n_vocab, D), "position": nn.Embedding(T, D),
                "blocks": nn.ModuleList([TransformerBlock(D, 2, 4 * D)]),
                "final_norm": nn.LayerNorm(D), "unembed": nn.Linear(D, n_vocab, bias=False)})
            opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
            for step in range(10):  # below the unigram counts, not yet the bigram counts
                rows = train_tokens[torch.arange(64)[:, None] * 997 + step + torch.arange(T + 1)]
                x = model["embed"](rows[:, :-1]) + model["position"].weight
                x = model["blocks"][0](x, is_causal=True)
                logits = model["unembed"](model["final_norm"](x))
                loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
            return model.state_dict(), 2
        """)
    found = checking.find_check("check_lm_capstone")
    tests = [{"grade_id": title, "module": found.module, "check": found.__name__,
              "title": title, "names": ["train_lm"]} for title in found.cases]
    assert grading.answer_imports(tests) == ["torch._dynamo"]
    softmax = checking.find_check(CHECK)  # a check whose answers need no optimizer
    assert grading.answer_imports([{"module": softmax.module, "check": CHECK}]) == []
    text = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    job = {"files": {**CODE, "data/shakespeare.txt": text},
           "cells": [(0, PRELUDE, False, "imports-0"), (1, source, True, "answer cell train_lm")],
           "tests": tests, "timeout": 60}
    started = [grading.CheckProcess(job, 120),  # fresh processes, as nbgrader's grading
               grading.CheckProcess(dict(job, files=CODE), 120)]  # the same, without data/
    results, without = (process.verdict()["results"] for process in started)
    assert [title for title, message in results.items() if message is not None] == [
        "below the bigram counts on the held-out text"], results
    assert "not below the bigram counts" in results["below the bigram counts on the held-out text"]
    assert all("data/shakespeare.txt is not here" in message for message in without.values())
