"""The machinery of the exercises' checks: what a student runs while working, and what an
nbgrader assignment grades. Each chapter's checks are in a file of their own, checks_<chapter>.py
(checks_masking.py for chapter 5), made of the pieces here.

A check is a list of *cases*, each worth points and each a small function that raises
`AssertionError` with a message naming the mistake. A student calls the check on their function
and sees every case pass or fail:

    check_stable_softmax(stable_softmax)

A graded cell of an assignment runs one case, so that a partly right answer earns part of the
points:

    check_stable_softmax.grade("fully masked rows", stable_softmax)

**What the answer runs is what counts.** While a case runs the student's function, the check
records every ATen operator dispatched, composite operators included, in every thread of the
process (PyTorch's profiler, set to record all threads, its start and stop messages silenced),
and the Python functions the answer enters, the builtins it calls and the lines of its own code
it runs (`sys.setprofile`, `sys.settrace`). An exercise's `Rule`s name what it rules out:
families of operators by name (every softmax and log-softmax kernel, every attention kernel,
...) and Python functions (the module's own `softmax` where the exercise is to write it),
recognised by their code, so that a copy pasted into the notebook is recognised too. However the
work is reached (another alias, `torch.ops.aten`, a default argument captured at definition, a
closure, an object holding it, TorchScript), the operators that run are the same, and every case
gives such an answer no points. An operator run by another thread while the answer runs, a
call of the modules that hand work to another thread or process (threading, a queue, a thread
pool, subprocess, os.system) and an answer that switches the recording off are refused as well.
The check looks for forbidden work in every case before it gives any case a point
(`Check.forbidden_work`; a run of the whole check judges each case by the same runs), so an
answer that takes a shortcut on some inputs only earns nothing either. A dispatch mode
(`TorchDispatchMode`) would not do: it sits below the composite operators, so PyTorch's
attention on its math path (3-D inputs, or `sdpa_kernel(MATH)`) reaches it as the `bmm`, `mul`
and softmax that an attention exercise allows (tests/test_checking.py shows it); the profiler
records the composite call itself. Where a PyTorch cannot record all threads, the legacy
autograd profiler records this one.

**Feedback here, grades elsewhere.** In a student's notebook the check shares the process with
the answer, so the answer could reach it (replace `Check.grade`, empty a rule, switch the
recording off): a check there is feedback, for the student. When an assignment is autograded,
tools/isolated_grading.py runs the answer's cells in a process of their own, which records each
call and sends back plain tensors and numbers with the record (`Recording.plain`), and runs
the cases in another, where the answer's functions are `IsolatedAnswer`s and the rules judge a
`RemoteRecording`; what could edit the record there is found in the answer's source and
flagged. The instructors' page says what that guards against and what it does not.

**A check never crashes.** Whatever the answer raises or returns, the case fails with a message;
an error in comparing a result of an unexpected kind is a failed case too. The answer's floating
results are compared in the dtype of the inputs, whatever dtype it computed in, except in cases
registered with `keeps_dtype=True`, where the exercise requires the input's dtype and the
message says so.

**Arguments are compared after the call**: each check has a case, "arguments left unchanged",
that fails an answer which modifies a tensor it was given (`masked_fill_` on the scores, say).
It fails for that reason only: a wrong value costs the value's own case, not this one, unless
the answer returns nothing but constants or its own arguments (which would leave them
unchanged by doing nothing).

Expected values come from loops, from the module where the exercise is not the module's
function, or from PyTorch: a check shows what is compared, never how to write the answer.
"""

from __future__ import annotations

import contextlib
import dis
import os
import functools
import importlib
import inspect
import math
import pathlib
import secrets
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterable

import torch

__all__ = ["Check", "ForbiddenWork", "NotWritten", "Rule", "Recording", "recording",
           "IsolatedAnswer", "RemoteRecording",
           "all_checks", "find_check", "module_rules"]

NOT_WRITTEN = "is not written yet: replace `raise NotImplementedError()` with your code"
UNCHANGED = "arguments left unchanged"  # the title of the case every check has


def _text(err: BaseException) -> str:
    """str(err), or its type's name where str itself fails."""
    try:
        return str(err)
    except Exception:  # noqa: BLE001
        return f"{type(err).__name__} (its message cannot be shown)"


class ForbiddenWork(AssertionError):
    """An exercise's answer ran what the exercise rules out."""


class NotWritten(Exception):
    """The answer is still the stub. Not a RuntimeError (as NotImplementedError is), so that a
    case that turns an answer's RuntimeError into a hint does not catch it."""


# ---------------------------------------------------------------------------------------------
# What an exercise rules out


def _code_objects(obj) -> list[types.CodeType]:
    """The code of a Python function, of every function defined in a class, or of every function
    and class of a module, written in the file that defines them: not what a class holds from
    elsewhere (an Enum holds the `__new__` of the enum module, which any Enum created while an
    answer runs, by a lazy import say, runs too)."""
    if isinstance(obj, types.ModuleType):
        found = [code for value in vars(obj).values()
                 if getattr(value, "__module__", None) == obj.__name__
                 for code in _code_objects(value)]
        return [code for code in found if code.co_filename == getattr(obj, "__file__", None)]
    if isinstance(obj, type):
        codes = []
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value):
                codes.append(value.__code__)
        module = sys.modules.get(obj.__module__)
        return [code for code in codes if code.co_filename == getattr(module, "__file__", None)]
    obj = inspect.unwrap(obj)
    return [obj.__code__] if inspect.isfunction(obj) else []


_LOCAL = set(dis.haslocal)
_JUMP = set(dis.hasjrel) | set(dis.hasjabs)
_SKIP = {"CACHE", "PRECALL", "NOP", "RESUME", "EXTENDED_ARG"}


@functools.lru_cache(maxsize=8192)
def _fingerprint(code: types.CodeType):
    """What a copy of a function pasted elsewhere keeps: its instructions with the names,
    constants and locals they use (by their index), leaving out jump offsets and the
    instructions that the same source compiles to differently in another module."""
    return tuple((ins.opname.replace("LOAD_METHOD", "LOAD_ATTR"),
                  None if ins.opcode in _JUMP else ins.arg if ins.opcode in _LOCAL
                  else repr(ins.argval))
                 for ins in dis.get_instructions(code) if ins.opname not in _SKIP)


_WATCHED_BUILTINS: set = set()  # the builtins some rule watches for
# In the answer's own process (isolated grading) the rules are elsewhere: every builtin called is
# recorded, and the check's process looks for the ones its rules watch.
EVERY_BUILTIN = False


class Rule:
    """One thing an exercise rules out, named `label` in the messages: the ATen operators whose
    names contain one of the strings in `aten` ("softmax" covers softmax, log_softmax,
    _safe_softmax, special_softmax, _softmax_backward_data, ...), and the Python functions in
    `python` (functions, classes: all their methods, or modules: all their functions), by their
    code. `python` takes objects or a callable returning them, imported when the rule is first
    used (the module's helpers import torch.nn)."""

    def __init__(self, label: str, aten: Iterable[str] = (), python=(),
                 elsewhere: dict[str, tuple[str, ...]] | None = None,
                 tensor_methods: Iterable[str] = ()):
        self.label = label
        self.tensor_methods = set(tensor_methods)
        self.aten = tuple(aten)
        self._python = python
        # {module: names}: functions of modules a right answer never imports (SciPy, PyTorch's
        # Python references), taken in when the answer has imported the module
        self._elsewhere = dict(elsewhere or {})
        self._codes: set | None = None
        self._prints: set | None = None
        self._taken: set = set()  # the modules of `elsewhere` taken in
        self._builtins: set = set()

    def _load(self):
        if self._codes is None:
            objects = self._python() if callable(self._python) else self._python
            codes = [code for obj in objects for code in _code_objects(obj)]
            self._codes = {_code_key(code) for code in codes}
            # A pasted copy is recognised by its instructions; short functions (a one-line
            # forward, an __init__ that stores its arguments) could be anyone's.
            self._prints = {_fingerprint(code) for code in codes if len(code.co_code) >= 40}
        for module, names in self._elsewhere.items():
            if module in sys.modules and module not in self._taken:
                self._taken.add(module)
                if names == ("*",):  # every function and class of the module
                    self._codes.update(_code_key(code)
                                       for code in _code_objects(sys.modules[module]))
                    continue
                for name in names:
                    obj = functools.reduce(getattr, name.split("."), sys.modules[module])
                    if inspect.isfunction(inspect.unwrap(obj)):
                        self._codes.add(_code_key(inspect.unwrap(obj).__code__))
                    else:  # a builtin or a NumPy ufunc: seen when called
                        self._builtins.add(_builtin_name(obj))
                        _WATCHED_BUILTINS.add(obj)

    def seen_in(self, recorded: "Recording | RemoteRecording") -> str | None:
        """What of this rule the recording shows, or None."""
        for op in sorted(recorded.ops):
            if any(part in op for part in self.aten):
                return f"the operator {op} ran"
        for method in sorted(recorded.tensor_methods & self.tensor_methods):
            return f"Tensor.{method} was called"
        self._load()
        if isinstance(recorded, RemoteRecording):  # the answer's process imported it, not this
            for module in recorded.modules & set(self._elsewhere):
                if module not in self._taken:
                    with contextlib.suppress(Exception):
                        importlib.import_module(module)
            self._load()
        for builtin in sorted(recorded.builtin_names() & self._builtins):
            return f"{builtin} was called"
        for info in recorded.code_infos():
            if info.key in self._codes:
                return f"{info.qualname} ran"
            if self._prints and info.fingerprint() in self._prints:
                return f"{info.qualname} is a copy of the module's code"
        return None


class CodeInfo:
    """What a rule needs to know of a code object the answer ran, in a form that crosses from the
    answer's process to the check's: where it is (its key), its name, and, for the answer's own
    code and the book's, its fingerprint (a copy of the module's code is recognised by it)."""

    __slots__ = ("key", "qualname", "file", "_print", "_code")

    def __init__(self, key, qualname, file, fingerprint=None, code=None):
        self.key, self.qualname, self.file = key, qualname, file
        self._print, self._code = fingerprint, code

    @classmethod
    def of(cls, code: types.CodeType) -> "CodeInfo":
        return cls(_code_key(code), code.co_qualname, pathlib.Path(code.co_filename).name,
                   code=code)

    def fingerprint(self):
        """The code's fingerprint where a copy could hide in it (not PyTorch's or Python's own
        code, nor the checks'), else None."""
        if self._print is None and self._code is not None:
            code, self._code = self._code, None
            if (len(code.co_code) >= 40 and code.co_filename != __file__
                    and (not _library(code.co_filename) or _in_here(code.co_filename))):
                self._print = _fingerprint(code)
            else:
                self._print = ()
        return self._print or None

    def plain(self) -> tuple:
        return (self.key, self.qualname, self.file, self.fingerprint())


@functools.lru_cache(maxsize=8192)
def _file_key(filename: str) -> str:
    """A file's name as two processes agree on it: the book's own files by their name (the
    answer's process reads a copy of them elsewhere), every other file by its resolved path."""
    if _in_here(filename):
        return "book:" + pathlib.Path(filename).name
    try:
        return str(pathlib.Path(filename).resolve())
    except (OSError, ValueError):
        return filename


def _code_key(code: types.CodeType) -> tuple[str, str, int]:
    return (_file_key(code.co_filename), code.co_qualname, code.co_firstlineno)


def _builtin_name(obj) -> str:
    """A builtin function or a NumPy ufunc by its module and name, the same in every process."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(obj, '__qualname__', None) or getattr(obj, '__name__', '?')}"


# ---------------------------------------------------------------------------------------------
# Recording what runs


class Recording:
    """The ATen operators (names, with counts) and Python code objects of one call."""

    def __init__(self):
        self.ops: Counter = Counter()
        self.codes: set[types.CodeType] = set()
        self.tampered = False  # the answer switched the recording off
        self.lines = 0  # lines run in the answer's own code
        self.line_hits: Counter = Counter()  # (code, line) -> times run, in the answer's code
        self.traced_calls = 0  # Python calls the trace function saw (`calls` counts builtins too)
        self.python_calls = 0  # Python calls the profile function saw
        self.calls = 0  # Python and builtin functions called
        self.builtins: set = set()  # the builtins of _WATCHED_BUILTINS called
        self.tensor_methods: set[str] = set()  # the builtin Tensor methods called, by name
        self.elsewhere: tuple[str, str] | None = None  # (what, seen): see seen_elsewhere

    def code_infos(self) -> list[CodeInfo]:
        """The codes run, for the rules (made once, when the recording is complete)."""
        if getattr(self, "_infos", None) is None:
            self._infos = [CodeInfo.of(code) for code in self.codes]
        return self._infos

    def builtin_names(self) -> set[str]:
        return {_builtin_name(b) for b in self.builtins}

    def plain(self) -> dict:
        """The recording as plain data (names, numbers, tuples), for the check's process:
        RemoteRecording(plain) makes it a recording again there."""
        return {"ops": dict(self.ops), "codes": [info.plain() for info in self.code_infos()],
                "tampered": self.tampered, "lines": self.lines,
                "line_hits": sorted(self.line_hits.values()), "calls": self.calls,
                "builtins": sorted(self.builtin_names()),
                "tensor_methods": sorted(self.tensor_methods),
                "elsewhere": self.elsewhere,
                "modules": sorted(sys.modules)}

    def seen_elsewhere(self) -> tuple[str, str] | None:
        """(what it is, what was seen) where the answer did work the recording cannot judge:
        in another thread or process (a call of the modules that hand work there, or of the
        builtins that start one or talk to one), in compiled code, or by reading the check's
        own code, frames or objects."""
        if self.elsewhere:
            return self.elsewhere
        own = _code_key(recording.__wrapped__.__code__)
        for info in self.code_infos():
            if ((info.file.startswith("checks_") or info.file == "checking.py")
                    and info.key != own):
                return (_THE_CHECK, f"{info.qualname} of {info.file} ran")
        return None


class RemoteRecording(Recording):
    """A recording made in the answer's own process (isolated grading), from Recording.plain."""

    def __init__(self, plain: dict):
        super().__init__()
        self.ops = Counter(plain["ops"])
        self._infos = [CodeInfo(tuple(key), qualname, file, fingerprint)
                       for key, qualname, file, fingerprint in plain["codes"]]
        self.tampered, self.lines, self.calls = plain["tampered"], plain["lines"], plain["calls"]
        self.line_hits = Counter(dict(enumerate(plain["line_hits"])))
        self._builtin_names = set(plain["builtins"])
        self.tensor_methods = set(plain["tensor_methods"])
        self.elsewhere = tuple(plain["elsewhere"]) if plain["elsewhere"] else None
        self.modules = set(plain["modules"])

    def code_infos(self) -> list[CodeInfo]:
        return self._infos

    def builtin_names(self) -> set[str]:
        return self._builtin_names


_ELSEWHERE = "another thread or process, where the check cannot see what runs"
_COMPILED = "compiled code (torch.compile), which the check cannot see into"
_THE_CHECK = "the check's own code, frames or objects"
_COMPILED_FILES = tuple(f"{sep}torch{sep}{name}{sep}" for sep in ("/", "\\")
                        for name in ("_dynamo", "_inductor"))
# Where work can go that a recording of this thread does not see.
_ELSEWHERE_FILES = tuple(f"{sep}{name}" for sep in ("/", "\\") for name in (
    "threading.py", "queue.py", "subprocess.py", "concurrent", "multiprocessing", "asyncio",
    "socket.py", "selectors.py"))
_ELSEWHERE_CALLS = {  # builtins that start another thread or process or talk to one, switch
    # the recording off, or read the check's own frames and objects
    sys.setprofile, sys.settrace, sys._getframe, sys._current_frames, __import__("_thread")
    .start_new_thread, __import__("gc").get_objects, __import__("gc").get_referrers,
    __import__("gc").get_referents, __import__("io").open, __import__("select").select,
    *(getattr(os, name) for name in (
        "system", "fork", "execv", "execve", "popen", "posix_spawn", "pipe", "read", "write",
        "open", "spawnv", "forkpty") if hasattr(os, name))}
_FRAME_READERS = {"currentframe", "stack", "trace", "getouterframes", "getinnerframes"}
_FRAME_CALLS = {sys._getframe, sys._current_frames, __import__("gc").get_objects,
                __import__("gc").get_referrers, __import__("gc").get_referents}
_FILE_TYPES = tuple(getattr(__import__("io"), name) for name in (
    "FileIO", "BufferedReader", "BufferedWriter", "BufferedRandom", "TextIOWrapper"))


# Resolved, as the file names they are compared with are: the book's folder may be reached
# through a symbolic link (a student who links it into a course folder).
_LIBRARY_DIRS = tuple({str(pathlib.Path(p).resolve()) for p in (
    sys.prefix, sys.base_prefix, sys.exec_prefix, pathlib.Path(__file__).parent)})


@functools.lru_cache(maxsize=4096)
def _in_here(filename: str) -> bool:
    """A file of the book's code (where a copy made from the module's code object says it is)."""
    return pathlib.Path(filename).resolve().parent == HERE


@functools.lru_cache(maxsize=4096)
def _library(filename: str) -> bool:
    """Code of Python, of installed packages or of the book's own files, not an answer's."""
    if filename.startswith("<frozen"):
        return True
    try:
        return str(pathlib.Path(filename).resolve()).startswith(_LIBRARY_DIRS)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _silent_stderr():
    """File descriptor 2 sent to /dev/null: Kineto writes a line there each time it starts and
    stops ("profiler_start"), which a notebook would show."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 to quiet
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


MARK = "checking: the answer's thread"  # a record the recording's own thread makes, with a
# token drawn anew each time, so that a profiler started again inside the answer lacks it


class _AllThreads:
    """PyTorch's profiler (Kineto) set to record every thread of the process: an operator that
    another thread runs while the answer runs is the answer's work handed elsewhere."""

    def __init__(self):
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState
        self.activities = {ProfilerActivity.CPU}
        self.config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False,
                                     _ExperimentalConfig(profile_all_threads=True))

    def start(self):
        from torch.autograd import _enable_profiler, _prepare_profiler
        with _silent_stderr():
            _prepare_profiler(self.config, self.activities)
            _enable_profiler(self.config, self.activities)
        self.mark = f"{MARK} {secrets.token_hex(8)}"
        with torch.autograd.profiler.record_function(self.mark):
            pass

    def stop(self, recorded: "Recording"):
        from torch.autograd import _disable_profiler
        with _silent_stderr():
            events = _disable_profiler().events()
        mine = {event.start_thread_id() for event in events if event.name() == self.mark}
        if not mine:  # the profiler was stopped and started again inside the answer
            raise RuntimeError("the recording's start is missing")
        for event in events:
            if event.name().startswith(MARK):
                continue
            recorded.ops[event.name()] += 1
            if event.start_thread_id() not in mine:
                recorded.elsewhere = (_ELSEWHERE, f"{event.name()} ran in another thread")


class _ThisThread:
    """The legacy autograd profiler, this thread only: where a PyTorch has no all-threads
    recording, or it does not work."""

    def __init__(self):
        from torch.autograd import profiler_legacy
        self.config = profiler_legacy.profile().config()

    def start(self):
        torch._C._autograd._enable_profiler_legacy(self.config)

    def stop(self, recorded: "Recording"):
        for thread in torch._C._autograd._disable_profiler_legacy():
            recorded.ops.update(event.name() for event in thread if event.kind() == "push")


@functools.lru_cache(maxsize=1)
def _profiler():
    """The all-threads profiler where this PyTorch has it and it records an operator of this
    thread as this thread's, else the legacy one."""
    try:
        profiler = _AllThreads()
        profiler.start()
        torch.zeros(1).exp()
        probe = Recording()
        profiler.stop(probe)
        if probe.ops["aten::exp"] == 1 and probe.elsewhere is None:
            return profiler
    except Exception:  # noqa: BLE001 (an older or newer PyTorch: the legacy profiler then)
        pass
    return _ThisThread()


@contextlib.contextmanager
def recording():
    """Record the operators dispatched in every thread (and which thread ran each), and the
    Python functions entered, the builtins called and the lines of the answer's own code run
    in this one."""
    recorded = Recording()
    previous, previous_trace = sys.getprofile(), sys.gettrace()

    def enter(frame, event, arg):
        if event == "call":
            code = frame.f_code
            recorded.codes.add(code)
            recorded.calls += 1
            recorded.python_calls += 1
            caller = frame.f_back
            if caller is not None and not _library(caller.f_code.co_filename):
                # what the answer's own code calls: a door to another thread or process, to
                # compiled code, or to the check's frames
                if any(part in code.co_filename for part in _COMPILED_FILES):
                    recorded.elsewhere = (_COMPILED, f"{code.co_qualname} ran")
                elif any(part in code.co_filename for part in _ELSEWHERE_FILES):
                    recorded.elsewhere = (_ELSEWHERE, f"{code.co_qualname} of "
                                          f"{pathlib.Path(code.co_filename).name} ran")
                elif code.co_name in _FRAME_READERS and code.co_filename == inspect.__file__:
                    recorded.elsewhere = (_THE_CHECK, f"inspect.{code.co_name} ran")
        elif event == "c_call":
            recorded.calls += 1
            try:
                if EVERY_BUILTIN or arg in _WATCHED_BUILTINS:
                    recorded.builtins.add(arg)
            except TypeError:  # a method of an object that cannot be hashed
                pass
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, torch.Tensor):
                recorded.tensor_methods.add(arg.__name__)
            elif owner is torch.default_generator:
                recorded.tensor_methods.add(f"default_generator.{arg.__name__}")
            if _library(frame.f_code.co_filename):  # Python's, PyTorch's, the book's own calls
                return
            try:
                if arg in _FRAME_CALLS:
                    recorded.elsewhere = (_THE_CHECK, f"{arg.__name__} was called")
                elif arg in _ELSEWHERE_CALLS:
                    recorded.elsewhere = (_ELSEWHERE, f"{arg.__module__}.{arg.__name__} was "
                                          "called")
            except TypeError:
                pass
            if (isinstance(owner, _FILE_TYPES)
                    and owner not in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
                recorded.elsewhere = (_ELSEWHERE, f"{arg.__name__} of a file or pipe was called")

    def count_lines(frame, event, arg):
        if event == "line":
            recorded.lines += 1
            recorded.line_hits[frame.f_code, frame.f_lineno] += 1
        return count_lines

    def trace(frame, event, arg):
        """Lines are counted in the answer's own code only (not in Python's, PyTorch's or the
        book's files), where a loop written by hand runs. Calls are counted everywhere: as
        many as the profile function sees, unless the answer switched one of them off."""
        recorded.traced_calls += 1
        return None if _library(frame.f_code.co_filename) else count_lines

    profiler = _profiler()
    profiler.start()
    sys.setprofile(enter)
    sys.settrace(trace)
    try:
        yield recorded
    finally:
        recorded.tampered = (sys.getprofile() is not enter or sys.gettrace() is not trace
                             or abs(recorded.python_calls - recorded.traced_calls) > 2)
        try:
            sys.settrace(previous_trace)
            sys.setprofile(previous)
        except TypeError:  # a profiler written in C (cProfile) cannot be set back from Python
            sys.settrace(None)
            sys.setprofile(None)
        try:
            profiler.stop(recorded)
        except RuntimeError:  # the profiler was switched off inside
            recorded.tampered = True


# ---------------------------------------------------------------------------------------------
# Running the answer


def _tensors(obj) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [("", obj)]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]{where}", t) for i, item in enumerate(obj) for where, t in _tensors(item)]
    if isinstance(obj, dict):
        return [(f"[{k!r}]{where}", t) for k, item in obj.items() for where, t in _tensors(item)]
    return []


def _trivial(out, given: list[torch.Tensor]) -> bool:
    """Is ``out`` nothing computed: no tensor in it but constants (every element equal, or a
    lone 0 or 1) and copies of the arguments ``given``, and no float but 0 and 1?"""
    leaves = [t for _, t in _tensors(out)]
    floats = [x for x in (out if isinstance(out, (tuple, list)) else [out])
              if isinstance(x, float)]

    def constant(t: torch.Tensor) -> bool:
        t = t.detach()
        if t.numel() <= 1:
            return t.numel() == 0 or t.item() in (0, 1)
        return bool((t == t.flatten()[0]).all())

    return (all(constant(t) or any(_same(t, g) for g in given) for t in leaves)
            and all(x in (0.0, 1.0) for x in floats))


def _cloned(obj):
    """obj with every tensor in nested tuples, lists and dicts cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_cloned(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _cloned(value) for key, value in obj.items()}
    return obj


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values (NaN equal to NaN), shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach(), b.detach()
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _to_dtype(obj, dtype):
    """obj with every floating tensor in it converted to dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_dtype(item, dtype) for item in obj)
    if isinstance(obj, list):
        return [_to_dtype(item, dtype) for item in obj]
    return obj


class _Namespaces:
    """What an answer could replace to fool a check: the functions of the checks' files and of
    PyTorch's namespaces the checks compare with. Taken when made; `restore` puts back what
    changed and names it."""

    def __init__(self):
        self.owners = _check_modules()
        self.owners += [value for module in list(self.owners) for value in vars(module).values()
                        if isinstance(value, type) and value.__module__ == module.__name__]
        self.saved = [(owner, dict(vars(owner))) for owner in self.owners]
        self.saved += [(owner, {name: vars(owner)[name] for name in names if name in vars(owner)})
                       for owner, names in _COMPARED.items()]

    def restore(self) -> str | None:
        changed = None
        for owner, saved in self.saved:
            now = vars(owner)
            for name, value in saved.items():
                if now.get(name, _MISSING) is not value:
                    changed = changed or f"{getattr(owner, '__name__', owner)}.{name}"
                    setattr(owner, name, value)
        return changed


_MISSING = object()
# (what sys.modules was when scanned, the names found): tuples, so that an answer can change
# them only by rebinding `_scanned`, which `restore` puts back and names
_scanned: tuple = (None, ())


def _check_modules() -> list:
    """The modules of the checks' code (`checking` and `checks_*`), as sys.modules holds them
    now. sys.modules is scanned again only when a module was added or removed since the last
    scan: its length or its last name changed (a dict keeps its names in the order they were
    added, so a name added after a removal comes last). A module object put in place of
    another under the same name is found by its name. (Scanning every time cost a third of a
    millisecond per call of an answer.)"""
    global _scanned
    modules = sys.modules
    now = (len(modules), next(reversed(modules), None))
    if _scanned[0] != now:
        _scanned = (now, tuple(name for name in list(modules)
                               if name == "checking" or name.startswith("checks_")))
    return [modules[name] for name in _scanned[1] if name in modules]


# What the cases compare with (not all of PyTorch's namespace: a lazy import rebinds some names)
_COMPARED = {
    torch: ("allclose", "equal", "isclose", "isfinite", "isnan", "isinf", "where", "zeros_like",
            "ones_like", "softmax", "tensor", "stack", "cat", "exp", "maximum"),
    torch.testing: ("assert_close",),
    torch.Tensor: ("allclose", "equal", "isclose", "isfinite", "isnan", "__eq__", "__ne__",
                   "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "all", "any", "item",
                   "tolist", "double", "float", "to", "abs", "max", "min", "sum", "shape",
                   "dtype", "__float__", "__sub__", "__len__", "nan_to_num"),
    math: ("isfinite", "isclose"),
}


class Answer:
    """A student's function as a case sees it: each call is recorded and judged against the
    check's rules (ForbiddenWork), its arguments are compared after the call, and its floating
    results come back in the dtype of its floating arguments unless `keep_dtype`."""

    def __init__(self, fn: Callable, rules: tuple[Rule, ...], keep_dtype: bool = False):
        self.fn, self.rules, self.keep_dtype = fn, rules, keep_dtype
        self.__name__ = getattr(fn, "__name__", "your function")
        self.raised: BaseException | None = None  # what the answer itself raised, if anything
        self.mutated: list[str] = []  # the arguments it modified, described
        self.forbidden: str | None = None
        self.not_written = False
        self.work: list[int] = []  # operators, calls and own lines run by each call
        self.line_hits: list[int] = []  # the most times one line of its own ran, by call
        self.trivial: list[bool] = []  # by call: did it return only constants or its arguments

    def _named(self, args, kwargs) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor argument: `scores`, or `caches[0]` in a list."""
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
        except (TypeError, ValueError):  # a signature that does not fit: positions, then names
            bound = {**{f"argument {i + 1}": a for i, a in enumerate(args)}, **kwargs}
        return [(f"{name}{where}", t) for name, value in bound.items()
                for where, t in _tensors(value)]

    def __call__(self, *args, **kwargs):
        # The answer gets copies, so that what it does to them never reaches the case's own
        # tensors (from which the case may still compute what it expects); the copies keep the
        # autograd graph, so a gradient still reaches the case's leaves.
        args, kwargs = _cloned(args), _cloned(kwargs)
        isolated = isinstance(self.fn, IsolatedAnswer)
        intact = None if isolated else _Namespaces()
        given = self._named(args, kwargs)
        before = [t.detach().clone() for _, t in given]
        recorded = None
        try:
            if isolated:  # run and recorded in the answer's own process
                out, recorded, error = self.fn.invoke(args, kwargs)
                if error is not None:
                    raise error
            else:
                with recording() as recorded:
                    out = self.fn(*args, **kwargs)
        except NotImplementedError:
            self.not_written = True
            raise NotWritten(f"{self.__name__} {NOT_WRITTEN}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            self.raised = err
            raise
        finally:
            if recorded is not None:
                self._judge(recorded, intact)
        for (name, tensor), old in zip(given, before):
            if not _same(tensor, old):
                self.mutated.append(f"argument `{name}` (shape {tuple(old.shape)})")
        self.trivial.append(_trivial(out, before))
        if not self.keep_dtype:
            dtypes = [t.dtype for _, t in given if t.is_floating_point()]
            if dtypes:
                out = _to_dtype(out, dtypes[0])
        return out

    def _judge(self, recorded: Recording, intact: "_Namespaces | None") -> None:
        """Note the call's work; ForbiddenWork if it ran what the rules name, switched the
        recording off, worked where the recording cannot see or changed the check's code."""
        self.work.append(sum(recorded.ops.values()) + recorded.calls + recorded.lines)
        self.line_hits.append(max(recorded.line_hits.values(), default=0))
        seen = [(rule.label, what) for rule in self.rules
                for what in [rule.seen_in(recorded)] if what]
        if recorded.tampered:
            seen.append(("a way to switch off the check's recording",
                         "the profiler or sys.setprofile was changed"))
        elsewhere = recorded.seen_elsewhere()
        if elsewhere:
            seen.append(elsewhere)
        changed = intact.restore() if intact is not None else None
        if changed:
            seen.append(("a change to the check's code or PyTorch's functions",
                         f"{changed} was replaced, and is put back"))
        if seen:
            self.forbidden = (
                f"{self.__name__} uses {' and '.join(label for label, _ in seen)}, "
                "which this exercise asks you to write yourself or rules out ("
                + "; ".join(what for _, what in seen) + ")")
            raise ForbiddenWork(self.forbidden) from None


class IsolatedAnswer:
    """An answer that runs in a process of its own (tools/isolated_grading.py, when an
    assignment is graded): `invoke(args, kwargs)` returns (result, RemoteRecording, the error
    the answer raised or None), the result made of plain tensors and numbers."""

    __name__ = "answer"

    def invoke(self, args: tuple, kwargs: dict):
        raise NotImplementedError


class Check:
    """A named list of cases for one exercise. Call it to check all cases; `.grade(case, ...)`
    runs one, as a graded test cell does.

    `rules`: what the exercise rules out (Rule). `unchanged`: the title of the case whose inputs
    the case "arguments left unchanged" reruns, requiring every tensor argument unchanged and a
    result computed (right, or at least more than constants and the arguments themselves). `inspect(*answers)`: forbidden work that no rule names (a loop, say),
    found by running the Answer objects; returns the message, or None. `prepare()`: run once
    before the first answer. `begin()`: run at the start of every whole run of the check (a
    check that keeps what one call of the answer returned, for all its cases, forgets it
    there: a student's second run sees the answer as it is now). `answer_imports`: modules
    that the answer's own process (isolated grading, tools/isolated_grading.py) imports before
    the answer cells run, what `prepare` warms on the check's side: an optimizer's first
    construction imports torch._dynamo, which the recording of the answer's call would slow
    to several times its 3 s."""

    def __init__(self, name: str, rules: Iterable[Rule] = (), unchanged: str | tuple = (),
                 inspect: Callable | None = None, prepare: Callable | None = None,
                 begin: Callable | None = None, answer_imports: tuple[str, ...] = ()):
        self.__name__ = name
        self._begin = begin  # run at the start of every whole run (`__call__`)
        # run once, before the first answer: the first call of some PyTorch functions imports
        # modules, which under the recording (every Python call seen) takes three times as long
        self._prepare = prepare
        self.answer_imports = tuple(answer_imports)
        self.module = sys._getframe(1).f_globals.get("__name__")  # where it is defined
        self.rules = tuple(rules)
        self._inspect = inspect
        self.cases: dict[str, tuple[Callable, int, bool]] = {}
        self._unchanged = (unchanged,) if isinstance(unchanged, str) else tuple(unchanged)
        self._looked: dict = {}  # answer -> forbidden work found, or None (see forbidden_work)

    def case(self, title: str, points: int = 1, *, keeps_dtype: bool = False):
        """Register `function(*answer)` as the case `title`, worth `points`; `keeps_dtype`: the
        case sees the answer's results in the dtype the answer returned."""
        def register(function):
            self.cases[title] = (function, points, keeps_dtype)
            if title in self._unchanged and UNCHANGED not in self.cases:
                self.cases[UNCHANGED] = (self._unchanged_case, 1, False)
            if UNCHANGED in self.cases:  # always the last case
                self.cases[UNCHANGED] = self.cases.pop(UNCHANGED)
            return function
        return register

    def _unchanged_case(self, *answer):
        """The cases named `unchanged` run again, and no tensor argument of any call modified.
        A wrong value there is the other case's mistake, not this one's, as long as the answer
        computes something and is right somewhere: an answer that returns only constants or its
        own arguments (which leaves them unchanged by doing nothing), or that passes no other
        case, earns nothing here."""
        wrong, right = None, False
        for title in self._unchanged:
            try:
                self.cases[title][0](*answer)
                right = True
            except AssertionError as err:
                wrong = wrong or _text(err)
        if wrong is not None:
            name = answer[0].__name__
            calls = [trivial for fn in answer for trivial in fn.trivial]  # those that returned
            for title in self.cases:
                if title != UNCHANGED and title not in self._unchanged and not right:
                    right = self._passes(title, answer, calls)
            if not right:
                raise AssertionError(
                    f"{name} passes no other case, so this one cannot tell a result computed "
                    f"without touching the arguments from a broken one ({wrong})")
            if calls and all(calls):
                raise AssertionError(
                    f"{name} returns only constants or its own arguments, so nothing shows "
                    f"that it computes a result and leaves its arguments alone ({wrong})")
        for fn in answer:
            if fn.mutated:
                raise AssertionError(
                    f"{fn.__name__} modified its {fn.mutated[0]} in place; leave the caller's "
                    "tensors unchanged (masked_fill, not masked_fill_; x = x - m, not x -= m)")

    def _passes(self, title: str, answer: tuple, calls: list) -> bool:
        """Does the case ``title`` pass on the answer's functions? (For the unchanged case:
        the arguments it modifies there count as modified, and whether each call returned
        anything computed is added to ``calls``.)"""
        function, _, keeps = self.cases[title]
        answers = tuple(Answer(fn.fn, self.rules, keeps) for fn in answer)
        try:
            function(*answers)
            passed = True
        except (NotWritten, ForbiddenWork):
            raise
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 (a failed case, whatever it raised)
            passed = False
        for fn, again in zip(answer, answers):
            fn.mutated += again.mutated
            calls += again.trivial
        return passed

    @property
    def points(self) -> int:
        return sum(points for _, points, _ in self.cases.values())

    def _answers(self, answer, keep_dtype=False):
        if self._prepare is not None:
            prepare, self._prepare = self._prepare, None
            prepare()
        return tuple(Answer(fn, self.rules, keep_dtype) for fn in answer)

    def _attempt(self, title: str, answers) -> str | None:
        """Run the case on the Answer objects: None if it passes, else the message."""
        function, _, _ = self.cases[title]
        message = None
        try:
            function(*answers)
        except (NotWritten, ForbiddenWork) as err:
            message = _text(err)
        except AssertionError as err:
            message = _text(err) or f"an assertion in {answers[0].__name__} failed"
        except KeyboardInterrupt:  # the reader stopped the kernel
            raise
        except BaseException as err:  # noqa: BLE001 (a check never crashes, SystemExit too)
            raised = next((fn for fn in answers if fn.raised is err), None)
            message = (f"{raised.__name__} raised {type(err).__name__}: {_text(err)}" if raised
                       else f"the check could not compare the result ({type(err).__name__}: "
                       f"{_text(err)}); look at the type, shape and dtype of what your "
                       "function returns")
        written = next((fn for fn in answers if fn.not_written), None)
        return f"{written.__name__} {NOT_WRITTEN}" if written else message

    def forbidden_work(self, answer: tuple[Callable, ...]) -> str | None:
        """The forbidden work the answer does on any case's inputs, or None. Every case runs
        once, its results ignored; remembered for the same functions."""
        key = tuple(answer)
        try:
            return self._looked[key]
        except Exception:  # noqa: BLE001 (not seen yet, or an answer that cannot be hashed)
            pass
        found = None
        for title, (function, _, keeps) in self.cases.items():
            answers = self._answers(answer, keeps)
            with contextlib.redirect_stdout(None):
                self._attempt(title, answers)
            found = next((fn.forbidden for fn in answers if fn.forbidden), None)
            if found:
                break
        return self._remember(answer, found)

    def _remember(self, answer: tuple[Callable, ...], found: str | None) -> str | None:
        """`found` (the forbidden work the cases saw, or None), completed by `inspect` when no
        case saw any, and remembered for these functions."""
        key = tuple(answer)
        if found is None and self._inspect is not None:
            answers = self._answers(answer)
            with contextlib.redirect_stdout(None):
                try:
                    found = self._inspect(*answers)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # noqa: BLE001 (a broken answer is for the cases to name)
                    found = next((fn.forbidden for fn in answers if fn.forbidden), None)
        with contextlib.suppress(Exception):
            self._looked[key] = found
        return found

    def _run(self, title: str, answer: tuple[Callable, ...]) -> str | None:
        """None if the case passes, else the message naming the mistake."""
        _, _, keeps = self.cases[title]
        answers = self._answers(answer, keeps)
        message = self._attempt(title, answers)
        if message is not None and NOT_WRITTEN in message:
            return message
        forbidden = next((fn.forbidden for fn in answers if fn.forbidden), None)
        return forbidden or self.forbidden_work(answer) or message

    def _run_all(self, answer: tuple[Callable, ...]) -> dict[str, str | None]:
        """{case: None or the message} for every case, what `_run` gives each, with every case
        run once: the runs that judge the cases are the ones that look for forbidden work."""
        runs, found = {}, None
        for title, (_, _, keeps) in self.cases.items():
            answers = self._answers(answer, keeps)
            message = self._attempt(title, answers)
            own = next((fn.forbidden for fn in answers if fn.forbidden), None)
            runs[title] = (message, own)
            found = found or own
        try:
            looked = self._looked[tuple(answer)]
        except Exception:  # noqa: BLE001 (not seen yet, or an answer that cannot be hashed)
            looked = self._remember(answer, found)
        return {title: message if message is not None and NOT_WRITTEN in message
                else own or looked or message for title, (message, own) in runs.items()}

    def __call__(self, *answer: Callable) -> None:
        """Run every case on the answer and print each result; AssertionError listing the
        failed cases if any fails (or just saying so if the answer is not written yet)."""
        if self._begin is not None:
            self._begin()
        results = self._run_all(answer)
        failed = {title: message for title, message in results.items() if message is not None}
        if failed and all(NOT_WRITTEN in message for message in failed.values()):
            raise AssertionError(next(iter(failed.values())))
        lines = []
        for title, message in results.items():
            points = self.cases[title][1]
            worth = f"{points} point{'s' * (points != 1)}"
            lines.append(f"pass  {title} ({worth})" if message is None else
                         f"FAIL  {title} ({worth}): {message}")
        if not failed:
            lines.append(f"{self.__name__}: all {len(self.cases)} cases pass.")
        # One write for the whole report: a kernel's output stream has been seen to repeat the
        # tail of many quick writes (once in the suite's runs), which the notebook tests catch.
        print("\n".join(lines))
        if failed:
            raise AssertionError(f"{len(failed)} of {len(self.cases)} cases fail:\n" + "\n".join(
                f"{title}: {message}" for title, message in failed.items()))

    def grade(self, title: str, *answer: Callable) -> None:
        """Run one case; AssertionError with the mistake if it fails (nbgrader then gives the
        cell no points)."""
        if title not in self.cases:
            raise KeyError(f"{self.__name__} has no case {title!r}; its cases: "
                           + ", ".join(self.cases))
        message = self._run(title, answer)
        if message is not None:
            raise AssertionError(f"{title}: {message}")
        print(f"{title}: passed")


# ---------------------------------------------------------------------------------------------
# What several chapters' checks share


def softmax_rules(module_softmax: bool = True) -> list[Rule]:
    """A softmax written by hand in torch operations: no softmax or log-softmax kernel (nor
    SciPy's, nor PyTorch's Python references), no logsumexp (which does the shifting for you),
    no NumPy, no attention kernel (a softmax in disguise, with identity keys and values), and
    not the module's own softmax."""
    rules = [Rule("a ready-made softmax (torch.softmax, F.softmax, Tensor.softmax, "
                  "torch.special.softmax, log_softmax, ...)", aten=("softmax",), elsewhere={
                      "scipy.special": ("softmax", "log_softmax"),
                      "torch._refs": ("softmax", "log_softmax"),
                      "torch._refs.special": ("softmax", "log_softmax"),
                      "torch._decomp.decompositions": ("_softmax", "_log_softmax")}),
             Rule("torch.logsumexp or torch.logaddexp (softplus too: logaddexp(0, x))",
                  aten=("logsumexp", "logaddexp", "logcumsumexp", "softplus"), elsewhere={
                      "scipy.special": ("logsumexp",),
                      "torch._refs": ("logsumexp", "logaddexp"),
                      "torch._refs.nn.functional": ("softplus",)}),
             Rule("NumPy in place of torch operations",
                  tensor_methods=("numpy", "__array__", "__dlpack__"),
                  python=lambda: [torch.Tensor.__array__, torch.Tensor.numpy],
                  elsewhere={"numpy": ("array", "asarray", "asanyarray", "ascontiguousarray",
                                       "fromiter", "frombuffer", "from_dlpack")}),
             attention_rule(),
             Rule("the book's FlashAttention (flash.py), a softmax in disguise",
                  python=lambda: [importlib.import_module("flash")])]
    if module_softmax:
        rules += module_rules("softmax")
    return rules


def attention_rule() -> Rule:
    """PyTorch's attention, in any form: its fused kernels and its math path, the functional
    multi-head attention, nn.MultiheadAttention and the Transformer layers, flex attention."""
    def objects():
        import torch.nn.attention as attention_package
        from torch import nn
        return [nn.functional.multi_head_attention_forward, nn.MultiheadAttention,
                nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, attention_package]
    # torch.nn.attention.bias (causal_lower_right) imports TorchDynamo, a second: taken in
    # only when an answer has imported it
    return Rule("PyTorch's attention (scaled_dot_product_attention, MultiheadAttention, ...)",
                aten=("scaled_dot_product", "multi_head_attention", "_transformer_encoder",
                      "flash_attention", "efficient_attention", "_fused_sdp"),
                python=objects, elsewhere={"torch.nn.attention.bias": ("*",),
                                           "torch.nn.attention.flex_attention": ("*",)})


def module_rules(*names: str, module: str = "attention") -> list[Rule]:
    """The book's own functions (or classes, or methods: "MultiHeadAttention.split_heads")
    `names` of `module`, a rule each."""
    def rule(name):
        return Rule(f"the module's {name}", python=lambda: [
            functools.reduce(getattr, name.split("."), importlib.import_module(module))])
    return [rule(name) for name in names]


def tensor_like(out, expected_shape, where: str) -> None:
    assert isinstance(out, torch.Tensor), f"{where}: expected a tensor, got {type(out).__name__}"
    assert tuple(out.shape) == tuple(expected_shape), (
        f"{where}: expected shape {tuple(expected_shape)}, got {tuple(out.shape)}")


def attention_by_loops(x, w_q, w_k, w_v, scale=None, keys_first=False):
    """(output, weights) of self-attention in float64, one token and one pair at a time;
    `scale` and `keys_first` give the named mistakes."""
    x, w_q, w_k, w_v = (t.double() for t in (x, w_q, w_k, w_v))
    T, d_k, d_v = x.shape[-2], w_k.shape[-1], w_v.shape[-1]
    scale = 1 / d_k ** 0.5 if scale is None else scale
    outputs, all_weights = [], []
    for seq in x.reshape(-1, T, x.shape[-1]):  # each sequence of the batch
        q = [seq[t] @ w_q for t in range(T)]
        k = [seq[t] @ w_k for t in range(T)]
        v = [seq[t] @ w_v for t in range(T)]
        for i in range(T):
            row = [float((k[i] @ q[j]) if keys_first else (q[i] @ k[j])) * scale
                   for j in range(T)]
            top = max(row)
            exps = [torch.tensor(z - top, dtype=torch.float64).exp() for z in row]
            a = [e / sum(exps) for e in exps]
            all_weights.append(torch.stack(a))
            outputs.append(sum((a[j] * v[j] for j in range(T)), torch.zeros(d_v).double()))
    return (torch.stack(outputs).reshape(*x.shape[:-1], d_v),
            torch.stack(all_weights).reshape(*x.shape[:-1], T))



# ---------------------------------------------------------------------------------------------
# Finding the checks


HERE = pathlib.Path(__file__).resolve().parent


def all_checks() -> dict[str, Check]:
    """Every check of every chapter, by name (imports every checks_*.py beside this file)."""
    found = {}
    for path in sorted(HERE.glob("checks_*.py")):
        module = importlib.import_module(path.stem)
        found.update({name: value for name, value in vars(module).items()
                      if isinstance(value, Check)})
    return found


def find_check(name: str) -> Check:
    try:
        return all_checks()[name]
    except KeyError:
        raise KeyError(f"no checks_*.py file defines {name}") from None
