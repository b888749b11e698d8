"""Grading that an answer cannot reach: the cases of an assignment's checks run in one process,
the student's answer cells in another.

nbgrader grades a notebook by running it in a kernel and reading the outputs of its test cells.
Everything in that kernel, the checks included, is within reach of the code in an answer cell: a
line that replaces `Check.grade`, empties a rule or switches PyTorch's recording off would decide
the grade. So the course's nbgrader configuration (tools/classroom.py writes it) adds two steps
to autograding:

* `HideTests`, before nbgrader executes the notebook: each test cell's code is set aside, so the
  kernel runs the notebook (its outputs feed the feedback page) but grades nothing;
* `GradeIsolated`, after it: the notebook's answer cells are graded here, and each test cell gets
  its code back and, as its output, what this grading found: the case passed, or an error with
  the mistake. nbgrader then records the points from those outputs, as always.

How a notebook is graded (`grade`):

1. **The scan.** The answer cells' source is read for the machinery of grading and for
   introspection (`torch._C`, `sys.setprofile`, frames, `__code__`, tensor subclasses with
   `__torch_function__`, `ctypes`, the checking modules, `exec`, ...; `scan`). A cell that uses
   any of it is flagged to the instructor, by cell and reason, and the notebook's cases get no
   points: in the answer's process such code could edit the record of what ran.
2. **The answer's process** (`serve_answers`) holds the book's modules and the recording of
   checking.py, but no check: it imports what the checks name in `answer_imports` (what an
   answer's first optimizer would otherwise import slowly under the recording), runs the
   exercise's imports cell and the answer cells, then
   calls the answer's functions when asked, each call recorded (PyTorch's profiler, the Python
   calls, an audit hook for file descriptors and other processes), and sends back the results
   converted to plain tensors and numbers (deferred work, in a tensor subclass or a `__float__`,
   runs there, recorded) with the record and the arguments as the call left them.
3. **The check's process** (`grade_notebook`) imports the checks from the course's source folder,
   never runs a line of the student's code, and runs every case with `RemoteFunction`s in place
   of the answer's functions. What comes back is read with `torch.load(weights_only=True)`,
   which builds tensors, numbers, strings and containers only.

Both are started by the grading process as `HideTests` runs, so they grade while nbgrader's
kernel runs the notebook (on a machine with a core to spare, a student's grading takes about as
long as that run alone); `GradeIsolated` waits for the check's result, with a time limit.
What this does not guard against: the answer's process runs as the same user, so an answer could
write to files elsewhere on the machine (grade in a container or as another user for that); and
the scan reads the source, so code it does not recognise (an obfuscation it has no pattern for)
is caught only if the record shows it.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import functools
import importlib
import io
import json
import os
import pathlib
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time

# ---------------------------------------------------------------------------------------------
# The channel: frames of torch.save bytes over two pipes


FRAME = struct.Struct("<Q")
LARGEST_FRAME = 1 << 31  # 2 GiB: larger is a broken or hostile answer


class AnswerStopped(Exception):
    """The other process ended, sent something unreadable or did not reply in time."""


class Channel:
    """Objects sent as torch.save bytes, each after its length. `trusting`: whether what comes
    in may be any pickle (the answer's process, reading the check's requests) or only tensors,
    numbers, strings and containers (the check's process, reading the answer's replies)."""

    def __init__(self, read_fd: int, write_fd: int, trusting: bool):
        self.read_fd, self.write_fd, self.trusting = read_fd, write_fd, trusting

    def send(self, obj) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        view = memoryview(FRAME.pack(len(data)) + data)
        try:
            while view:
                view = view[os.write(self.write_fd, view):]
        except OSError as err:
            raise AnswerStopped(f"the other process is gone ({err})") from None

    def _read(self, size: int, deadline: float | None) -> bytes:
        chunks, left = [], size
        while left:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self.read_fd], [], [], wait)[0]:
                    raise AnswerStopped("no reply in time (an endless loop?)")
            chunk = os.read(self.read_fd, min(left, 1 << 20))
            if not chunk:
                raise AnswerStopped("the other process ended")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def receive(self, timeout: float | None = None):
        import torch

        deadline = None if timeout is None else time.monotonic() + timeout
        (size,) = FRAME.unpack(self._read(FRAME.size, deadline))
        if size > LARGEST_FRAME:
            raise AnswerStopped(f"a reply of {size} bytes")
        data = self._read(size, deadline)
        try:
            return torch.load(io.BytesIO(data), weights_only=not self.trusting)
        except Exception as err:  # noqa: BLE001 (anything unreadable is the answer's fault)
            raise AnswerStopped(f"an unreadable reply ({type(err).__name__}: {err})") from None


# ---------------------------------------------------------------------------------------------
# What crosses: arguments out (any picklable object), results back (plain data only)


TENSOR, GENERATOR, FOREIGN = "\x00tensor", "\x00generator", "\x00foreign"
DEEPEST = 32  # nesting of a result beyond which it is not converted


def outbound(obj, grad_inputs: list, generators: list):
    """The arguments of a call as the check's process sends them: each tensor detached, with
    whether it requires grad (those that do, and the parameters of modules that do, are
    appended to `grad_inputs`), each torch.Generator as its state (appended to `generators`)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            grad_inputs.append(obj)
        return (TENSOR, obj.detach().as_subclass(torch.Tensor), obj.requires_grad)
    if isinstance(obj, torch.Generator):
        generators.append(obj)
        return (GENERATOR, obj.get_state())
    if isinstance(obj, torch.nn.Module):
        grad_inputs.extend(p for p in obj.parameters() if p.requires_grad)
        return obj
    if isinstance(obj, (tuple, list)):  # a named tuple as a plain one
        items = [outbound(item, grad_inputs, generators) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {key: outbound(value, grad_inputs, generators) for key, value in obj.items()}
    return obj


def rebuilt(obj, leaves: list, generators: list):
    """outbound's arguments made objects again in the answer's process (the same order of
    grad inputs and generators)."""
    import torch

    if isinstance(obj, tuple) and obj and obj[0] == TENSOR:
        tensor = obj[1].clone()
        if obj[2]:
            tensor.requires_grad_(True)
            leaves.append(tensor)
        return tensor
    if isinstance(obj, tuple) and obj and obj[0] == GENERATOR:
        generator = torch.Generator()
        generator.set_state(obj[1])
        generators.append(generator)
        return generator
    if isinstance(obj, torch.nn.Module):
        leaves.extend(p for p in obj.parameters() if p.requires_grad)
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(rebuilt(item, leaves, generators) for item in obj)
    if isinstance(obj, dict):
        return {key: rebuilt(value, leaves, generators) for key, value in obj.items()}
    return obj


def plain(obj, depth: int = 0):
    """A result as plain data, in the answer's process (under the recording, so that work
    deferred into a tensor subclass or a `__float__` runs where it is recorded): tensors as
    torch.Tensor, numbers and strings as Python's own types, containers as tuple, list and
    dict; anything else as (FOREIGN, its type's name, repr, its float value or None)."""
    import torch

    if depth > DEEPEST:
        return (FOREIGN, type(obj).__name__, "a result nested too deeply", None)
    if isinstance(obj, torch.Tensor):
        tensor = obj if type(obj) is torch.Tensor else obj.as_subclass(torch.Tensor)
        return tensor.detach().clone()
    if isinstance(obj, torch.Size):
        return torch.Size([int(n) for n in obj])
    if isinstance(obj, torch.dtype) or obj is None:
        return obj
    for kind in (bool, int, float, complex, str, bytes):  # bool before int
        if isinstance(obj, kind):
            return kind(obj)
    if isinstance(obj, (tuple, list)):
        items = [plain(item, depth + 1) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {plain(key, depth + 1) if isinstance(key, (str, int)) else repr(key):
                plain(value, depth + 1) for key, value in obj.items()}
    try:
        number = float(obj)
    except Exception:  # noqa: BLE001 (not a number: fine)
        number = None
    try:
        text = repr(obj)[:200]
    except Exception:  # noqa: BLE001
        text = f"a {type(obj).__name__}"
    return (FOREIGN, type(obj).__name__, text, number)


class Foreign:
    """A result of a type the check's process does not take in (a NumPy array, an object of the
    answer's own class): named like it, a number where it converts to one."""

    def __init__(self, text: str, number: float | None):
        self._text, self._number = text, number

    def __repr__(self):
        return self._text

    def __float__(self):
        if self._number is None:
            raise TypeError(f"{type(self).__name__} is not a number")
        return self._number


def inbound(obj):
    """A reply's result in the check's process: FOREIGN entries made Foreign objects."""
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == FOREIGN:
        kind = type(str(obj[1]), (Foreign,), {})
        return kind(str(obj[2]), obj[3] if isinstance(obj[3], float) else None)
    if isinstance(obj, (tuple, list)):
        return type(obj)(inbound(item) for item in obj)
    if isinstance(obj, dict):
        return {key: inbound(value) for key, value in obj.items()}
    return obj


def rebuilt_error(name: str, message: str) -> BaseException:
    """The answer's exception in the check's process: Python's own type where it is one (so a
    case that turns a RuntimeError into a hint still does), else a RuntimeError named like it."""
    kind = getattr(builtins, name, None)
    if (isinstance(kind, type) and issubclass(kind, Exception)
            and not issubclass(kind, (KeyboardInterrupt, SystemExit))):
        with contextlib.suppress(Exception):
            return kind(message)
    return type(name, (RuntimeError,), {})(message)


# ---------------------------------------------------------------------------------------------
# The answer's process


ANSWER_FILE = "/answer-cells/cell-{}.py"  # the answer's code, outside every library folder


class _NoShell:
    """get_ipython() in the answer's process: magics (%config, %timeit) do nothing there."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _source(cell_source: str) -> str:
    """A cell's source as Python: IPython's magics (%timeit, !pip) turned into calls."""
    try:
        ast.parse(cell_source)
        return cell_source
    except SyntaxError:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(cell_source)


def _audit(events: list):
    """An audit hook (it cannot be removed) that notes the answer reaching another process or a
    file descriptor: where the grading's channel is."""
    watched = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
               "os.fork", "os.forkpty", "os.kill", "pty.spawn")

    def hook(event, args):
        if event.startswith(watched):
            events.append(f"{event} was called")
        elif event == "open" and args and (isinstance(args[0], int) or str(args[0]).startswith(
                ("/proc/", "/dev/fd"))):
            events.append(f"a file descriptor or /proc was opened ({args[0]!r})")
    return hook


def serve_answers(workdir: str, read_fd: int, write_fd: int) -> None:
    """The answer's process: the cells the check's process sends, then its calls, until told
    to stop. Its own output goes nowhere (the notebook's run in nbgrader's kernel shows it)."""
    sys.path.insert(0, workdir)
    os.chdir(workdir)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    import torch

    import checking

    checking.EVERY_BUILTIN = True
    # this file's code (the results made plain) is not the answer's own
    checking._LIBRARY_DIRS += (str(pathlib.Path(__file__).resolve().parent),)
    channel = Channel(read_fd, write_fd, trusting=True)
    events: list[str] = []
    cells, imports = channel.receive()
    for module in imports:  # what the checks' answers would otherwise import recorded (slowly)
        importlib.import_module(module)
    # A module that the answer's cells import first would have its bytecode written beside it,
    # to a file that importlib opens by number: the hook would take that for the answer reaching
    # a file descriptor. The answer's process writes no bytecode.
    sys.dont_write_bytecode = True
    sys.addaudithook(_audit(events))
    namespace = {"__name__": "__main__", "__builtins__": builtins, "get_ipython": _NoShell}
    errors = []
    for index, source, *_ in cells:
        try:
            exec(compile(_source(source), ANSWER_FILE.format(index), "exec"), namespace)
        except BaseException as err:  # noqa: BLE001 (a failing cell fails its cases later)
            errors.append((index, type(err).__name__, checking._text(err)))
    channel.send({"errors": errors, "events": list(events)})
    slots: dict[int, tuple] = {}
    while True:
        request = channel.receive()
        kind = request[0]
        if kind == "stop":
            return
        if kind == "function":
            fn = namespace.get(request[1])
            if not callable(fn):
                channel.send(None)
                continue
            import inspect
            try:
                parameters = [(p.name, int(p.kind), p.default is not p.empty)
                              for p in inspect.signature(fn).parameters.values()]
            except (TypeError, ValueError):
                parameters = None
            channel.send({"parameters": parameters})
        elif kind == "call":
            channel.send(_answer_call(namespace, request, slots, events))
        elif kind == "backward":
            _, slot, grads = request
            outputs, leaves = slots.pop(slot)
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            try:
                found = torch.autograd.grad([o for o, _ in pairs], leaves,
                                            [g for _, g in pairs], allow_unused=True) \
                    if pairs and leaves else [None] * len(leaves)
                channel.send({"grads": [None if g is None else plain(g) for g in found]})
            except Exception as err:  # noqa: BLE001 (the case fails with this message)
                channel.send({"error": (type(err).__name__, checking._text(err))})
        elif kind == "release":
            slots.pop(request[1], None)


def _answer_call(namespace: dict, request: tuple, slots: dict, events: list) -> dict:
    """One call of the answer's function, recorded: the reply the check's process reads."""
    import torch

    import checking

    _, name, args, kwargs, rng, want_grad = request
    torch.set_rng_state(rng)
    leaves, generators = [], []
    args = rebuilt(args, leaves, generators)
    kwargs = rebuilt(kwargs, leaves, generators)
    fn = namespace.get(name)
    caught, result, kept = None, None, None
    seen = len(events)
    with checking.recording() as recorded:
        try:
            out = fn(*args, **kwargs)
            result = plain(out)
        except BaseException as err:  # noqa: BLE001 (sent back, as the answer's error)
            caught = err
    error = None if caught is None else (type(caught).__name__, checking._text(caught))
    if error is None:
        kept = [t for _, t in checking._tensors(out) if t.is_floating_point()]
    record = recorded.plain()
    if recorded.elsewhere and recorded.elsewhere[0] == checking._THE_CHECK:
        record["elsewhere"] = None  # no check in this process to read: inspect.stack() is fine
    if record["elsewhere"] and "of a file or pipe" in record["elsewhere"][1] \
            or record["elsewhere"] and "io.open" in record["elsewhere"][1]:
        record["elsewhere"] = None  # a file the answer writes: the audit hook watches descriptors
    if len(events) > seen:
        record["elsewhere"] = ("another process or the grading's channel", events[seen])
    slot = None
    if want_grad and error is None and kept:
        slot = id(kept)
        slots[slot] = (kept, leaves)
    after = [t.detach() for _, t in checking._tensors((args, kwargs))]
    return {"result": result, "error": error, "record": record, "rng": torch.get_rng_state(),
            "generators": [g.get_state() for g in generators], "after": after, "slot": slot}


# ---------------------------------------------------------------------------------------------
# The check's process


class AnswerProcess:
    """The answer's process, started from the check's: its cells sent, then its functions."""

    def __init__(self, workdir: pathlib.Path, cells: list, timeout: float,
                 imports: list[str] = ()):
        check_read, answer_write = os.pipe()
        answer_read, check_write = os.pipe()
        self.log = open(workdir / "answer-process.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, __file__, "answer", str(workdir), str(answer_read),
             str(answer_write)], pass_fds=(answer_read, answer_write), cwd=workdir,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log)
        os.close(answer_read)
        os.close(answer_write)
        self.channel = Channel(check_read, check_write, trusting=False)
        self.timeout, self.broken = timeout, None
        self.functions: dict[str, RemoteFunction | None] = {}
        started = self.ask((cells, list(imports)), timeout=max(timeout, STARTUP_TIMEOUT))
        names = {cell[0]: cell[3] for cell in cells}
        self.errors = {names.get(index, f"cell {index}"): f"{kind}: {message}"
                       for index, kind, message in started["errors"]}
        self.events = list(started["events"])

    def ask(self, request, timeout: float | None = None):
        """Send a request and return the reply; AnswerStopped (kept: every later request fails
        the same way) if the process died, answered nonsense or took longer than the timeout."""
        if self.broken:
            raise AnswerStopped(self.broken)
        try:
            self.channel.send(request)
            reply = self.channel.receive(timeout or self.timeout)
            if isinstance(request, tuple) and request[0] in ("call", "backward") \
                    and not isinstance(reply, dict):
                raise AnswerStopped("a reply of the wrong form")
            return reply
        except AnswerStopped as err:
            self.broken = str(err)
            self.stop()
            raise

    def function(self, name: str):
        if name not in self.functions:
            reply = self.ask(("function", name))
            self.functions[name] = None if reply is None else RemoteFunction(
                self, name, reply["parameters"])
        return self.functions[name]

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.channel.send(("stop",))
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for fd in (self.channel.read_fd, self.channel.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.log.close()


def _remote_grad_function():
    import torch

    class RemoteGrad(torch.autograd.Function):
        """The answer's floating results, with a backward pass that the answer's process
        computes (its graph is there)."""

        @staticmethod
        def forward(ctx, process, slot, results, *inputs):
            ctx.process, ctx.slot, ctx.inputs = process, slot, len(inputs)
            return tuple(r.clone() for r in results)

        @staticmethod
        def backward(ctx, *grads):
            reply = ctx.process.ask(("backward", ctx.slot, [g.detach() for g in grads]))
            if "error" in reply:
                raise rebuilt_error(*reply["error"])
            found = reply["grads"]
            if len(found) != ctx.inputs:
                raise AnswerStopped("gradients of the wrong number")
            return (None, None, None, *found)

    return RemoteGrad


def _checking():
    import checking
    return checking


@functools.lru_cache(maxsize=None)
def _isolated(base: type) -> type:
    """RemoteFunction as a subclass of checking.IsolatedAnswer (checking is imported from the
    course's folder only in the check's process), made once."""
    return type("RemoteFunction", (RemoteFunction, base), {})


class RemoteFunction:
    """An answer's function in the check's process: calls go to the answer's process."""

    def __new__(cls, *args, **kwargs):
        base = _checking().IsolatedAnswer
        return object.__new__(cls if issubclass(cls, base) else _isolated(base))

    def __init__(self, process: AnswerProcess, name: str, parameters):
        import inspect

        self.process, self.__name__ = process, name
        if parameters is not None:
            self.__signature__ = inspect.Signature([
                inspect.Parameter(p_name, inspect._ParameterKind(kind),
                                  default=None if has_default else inspect.Parameter.empty)
                for p_name, kind, has_default in parameters])

    def __call__(self, *args, **kwargs):
        out, recorded, error = self.invoke(args, kwargs)
        if error is not None:
            raise error
        return out

    def invoke(self, args: tuple, kwargs: dict):
        import torch

        checking = _checking()
        grad_inputs, generators = [], []
        sent = (outbound(args, grad_inputs, generators),
                outbound(kwargs, grad_inputs, generators))
        reply = self.process.ask(("call", self.__name__, sent[0], sent[1],
                                  torch.get_rng_state(), bool(grad_inputs)))
        torch.set_rng_state(reply["rng"])
        for generator, state in zip(generators, reply["generators"]):
            generator.set_state(state)
        local = [t for _, t in checking._tensors((args, kwargs))]
        for tensor, after in zip(local, reply["after"]):
            if not checking._same(tensor, after):
                with torch.no_grad():
                    if tensor.shape == after.shape:
                        tensor.copy_(after)
                    else:
                        tensor.data = after.to(tensor.dtype)
        recorded = checking.RemoteRecording(reply["record"])
        if reply["error"] is not None:
            return None, recorded, rebuilt_error(*reply["error"])
        out = inbound(reply["result"])
        if reply["slot"] is not None:
            out = self._differentiable(out, reply["slot"], grad_inputs)
        return out, recorded, None

    def _differentiable(self, out, slot, grad_inputs):
        """out with its floating tensors made the results of RemoteGrad, whose backward pass
        asks the answer's process."""
        checking = _checking()
        floating = [t for _, t in checking._tensors(out) if t.is_floating_point()]
        made = iter(_remote_grad_function().apply(self.process, slot, floating, *grad_inputs))

        def swap(obj):
            if isinstance(obj, __import__("torch").Tensor):
                return next(made) if obj.is_floating_point() else obj
            if isinstance(obj, (tuple, list)):
                return type(obj)(swap(item) for item in obj)
            if isinstance(obj, dict):
                return {key: swap(value) for key, value in obj.items()}
            return obj
        return swap(out)


# ---------------------------------------------------------------------------------------------
# The scan of the answer's source


FLAGGED_MODULES = {
    "ctypes": "ctypes", "gc": "the garbage collector's objects", "importlib": "importlib",
    "builtins": "Python's builtins", "checking": "the checking machinery",
    "threading": "another thread", "_thread": "another thread",
    "multiprocessing": "another process", "subprocess": "another process",
    "concurrent": "another thread or process", "signal": "signals", "socket": "a socket",
    "marshal": "code objects", "dis": "code objects", "sysconfig": None}
FLAGGED_ATTRIBUTES = {
    "_C": "PyTorch's C internals (torch._C)", "__code__": "a function's code (__code__)",
    "__defaults__": "a function's defaults", "__kwdefaults__": "a function's defaults",
    "__globals__": "a function's globals", "__closure__": "a function's closure",
    "__builtins__": "Python's builtins", "__torch_function__": "__torch_function__",
    "__torch_dispatch__": "__torch_dispatch__", "__subclasses__": "the class tree",
    "__class__": "an object's class", "__dict__": "an object's namespace",
    "f_globals": "frames", "f_locals": "frames", "f_back": "frames", "f_trace": "frames",
    "f_builtins": "frames", "f_code": "frames", "tb_frame": "frames", "gi_frame": "frames",
    "cr_frame": "frames", "setprofile": "sys.setprofile", "settrace": "sys.settrace",
    "_getframe": "frames", "_current_frames": "frames", "modules": "sys.modules",
    "addaudithook": "audit hooks", "_enable_record_function": "the recording",
    "_disable_profiler": "the recording", "_enable_profiler": "the recording",
    "_disable_profiler_legacy": "the recording", "profiler": "the profiler",
    "dup": "file descriptors", "dup2": "file descriptors", "fdopen": "file descriptors",
    "_exit": "os._exit", "kill": "signals", "fork": "another process",
    "CodeType": "code objects", "FunctionType": "function objects", "_dynamo": "TorchDynamo",
    "compile": "compiled code"}
OS_DESCRIPTORS = {"write", "read", "open", "close", "pipe", "fdopen", "dup", "dup2", "lseek",
                  "sendfile", "splice", "system", "popen", "execv", "execve", "spawnv"}
FLAGGED_CALLS = {"exec": "exec", "eval": "eval", "compile": "compile",
                 "__import__": "__import__", "globals": "globals()", "vars": "vars()",
                 "breakpoint": "the debugger"}
FLAGGED_METHODS = {"__torch_function__", "__torch_dispatch__", "__float__", "__int__",
                   "__index__", "__bool__", "__array__", "__array_function__", "__del__",
                   "__getattribute__"}


def scan(source: str) -> list[str]:
    """What of the grading's machinery or of introspection a cell's source uses, described;
    [] for none. A source that does not parse has nothing to flag (its cell fails anyway)."""
    try:
        tree = ast.parse(_source(source))
    except SyntaxError:
        return []
    found = []

    def note(line, what):
        text = f"line {line}: {what}"
        if text not in found:
            found.append(text)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names]
            modules = names if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                top = module.split(".")[0]
                if top in FLAGGED_MODULES or top.startswith("checks_") or any(
                        part in FLAGGED_ATTRIBUTES for part in module.split(".")[1:]):
                    note(node.lineno, f"imports {module}")
            if isinstance(node, ast.ImportFrom):
                for name in names:
                    if name in FLAGGED_ATTRIBUTES or name in FLAGGED_CALLS or name == "*" \
                            and (node.module or "") in ("sys", "os", "torch"):
                        note(node.lineno, f"imports {name} from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in FLAGGED_ATTRIBUTES:
            if node.attr == "compile" and not (isinstance(node.value, ast.Name)
                                              and node.value.id == "torch"):
                continue  # re.compile, say
            if node.attr == "modules" and not (isinstance(node.value, ast.Name)
                                              and node.value.id == "sys"):
                continue  # an nn.Module's modules()
            if node.attr == "profiler" and not isinstance(node.ctx, ast.Load):
                continue
            if node.attr in ("dup", "dup2", "kill", "fork") and not (
                    isinstance(node.value, ast.Name) and node.value.id == "os"):
                continue  # a method of the answer's own objects
            note(node.lineno, f"uses {FLAGGED_ATTRIBUTES[node.attr]} (.{node.attr})")
        elif isinstance(node, ast.Attribute) and node.attr in OS_DESCRIPTORS and isinstance(
                node.value, ast.Name) and node.value.id == "os":
            note(node.lineno, f"uses file descriptors (os.{node.attr})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in FLAGGED_CALLS:
                note(node.lineno, f"calls {FLAGGED_CALLS[node.func.id]}")
            elif node.func.id in ("getattr", "setattr", "delattr", "hasattr") \
                    and len(node.args) >= 2:
                name = node.args[1]
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                        and not name.value.startswith("_")):
                    note(node.lineno, f"calls {node.func.id} with a name that is not a plain "
                         "literal")
        elif isinstance(node, ast.FunctionDef) and node.name in FLAGGED_METHODS:
            note(node.lineno, f"defines {node.name}")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                text = ast.unparse(base)
                if text.endswith("Tensor") or text.endswith("TorchDispatchMode") \
                        or text.endswith("TorchFunctionMode"):
                    note(node.lineno, f"defines a subclass of {text}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value.startswith("checks_") or node.value in ("checking", "_C")):
            note(node.lineno, f"names {node.value!r}")
    return found


# ---------------------------------------------------------------------------------------------
# One notebook, graded


def _answer_cells(notebook) -> list[tuple[int, str, bool, str]]:
    """(index, source, written by the student, name) of the code the answer's process runs, in
    the notebook's order (the name: the cell's nbgrader id, as the formgrader shows it): the setup cell (without the checks) and the exercises' imports cells,
    both locked (nbgrader restores them), and the answer cells."""
    cells = []
    for index, cell in enumerate(notebook.cells):
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code":
            continue
        if meta.get("grade_id") == "setup":  # the book's modules, without the checks
            cells.append((index, re.sub(r"'checks_\w+',? ?", "", cell.source), False,
                          "setup"))
        elif str(meta.get("grade_id", "")).startswith("imports-"):
            cells.append((index, cell.source, False, meta["grade_id"]))
        elif meta.get("solution") and not meta.get("grade"):
            cells.append((index, cell.source, True, f"answer cell {meta.get('grade_id')}"))
    return cells


TEST = re.compile(r"from (checks_\w+) import (check_\w+)\n\2\.grade\((.+?), ([\w, ]+)\)\s*$",
                  re.S)


def graded_cells(notebook) -> list[dict]:
    """The test cells: index, grade id, checks module, check, case title, answer's names."""
    found = []
    for index, cell in enumerate(notebook.cells):
        meta = cell.metadata.get("nbgrader", {})
        if not (meta.get("grade") and not meta.get("solution") and cell.cell_type == "code"):
            continue
        source = cell.metadata.get(HIDDEN_KEY, cell.source)
        match = TEST.match(source)
        if match:
            found.append({"index": index, "grade_id": meta["grade_id"],
                          "module": match.group(1), "check": match.group(2),
                          "title": ast.literal_eval(match.group(3)),
                          "names": [n.strip() for n in match.group(4).split(",") if n.strip()]})
    return found


def grade_notebook(job: dict) -> dict:
    """The check's process: every test cell of the job graded, as {grade_id: None when the case
    passes, else the message}, with the scan's flags and the answer cells' errors. (`scan`:
    False in tests only, to show what the separation of the processes holds by itself.)"""
    flags = [f"{name}: {what}" for _, source, written, name in job["cells"] if written
             and job.get("scan", True) for what in scan(source)]
    results = {}
    if flags:
        message = ("not graded: the answer cells use what only the grading should "
                   f"({'; '.join(flags)}); your instructor will look at it")
        return {"results": {test["grade_id"]: message for test in job["tests"]},
                "flags": flags, "errors": {}}
    folder = pathlib.Path(tempfile.mkdtemp(prefix="isolated-grading-"))
    checks, workdir = folder / "checks", folder / "answer"
    for place in (checks, workdir):
        place.mkdir()
    for name, text in job["files"].items():
        for place in (checks, workdir) if not name.startswith("checks_") else (checks,):
            (place / name).parent.mkdir(exist_ok=True)  # data/ too
            (place / name).write_text(text, encoding="utf-8")  # the answer's process: no check
    sys.path.insert(0, str(checks))
    checking = importlib.import_module("checking")
    process = None
    try:
        imports = answer_imports(job["tests"])
        try:
            process = AnswerProcess(workdir, job["cells"], job["timeout"], imports)
        except AnswerStopped as err:
            message = f"your answer cells could not be run ({err})"
            return {"results": {t["grade_id"]: message for t in job["tests"]},
                    "flags": [], "errors": {}}
        errors = process.errors
        if process.events:
            flags = [f"answer cells: {event}" for event in process.events]
            message = ("not graded: the answer cells reach another process or the grading's "
                       f"channel ({'; '.join(process.events)}); your instructor will look at it")
            return {"results": {t["grade_id"]: message for t in job["tests"]},
                    "flags": flags, "errors": errors}
        stuck: dict[str, str] = {}  # the functions whose process stopped answering: why
        for test in job["tests"]:
            name = next((n for n in test["names"] if n in stuck), None)
            if name:
                results[test["grade_id"]] = (f"{test['title']}: {name} stopped answering "
                                             f"({stuck[name]})")
                continue
            if process.broken:  # a fresh process for the other functions
                process.stop()
                process = AnswerProcess(workdir, job["cells"], job["timeout"], imports)
            results[test["grade_id"]] = _grade_case(checking, process, test, errors)
            if process.broken:
                stuck.update(dict.fromkeys(test["names"], process.broken))
        return {"results": results, "flags": [], "errors": errors}
    finally:
        if process is not None:
            process.stop()
        sys.path.remove(str(checks))
        shutil.rmtree(folder, ignore_errors=True)


def answer_imports(tests: list[dict]) -> list[str]:
    """The modules the checks of these test cells have the answer's process import before
    the answer cells run (Check's answer_imports), so that no answer's call imports them under
    the recording."""
    return sorted({module for test in tests for module in _check_of(test).answer_imports})


def _check_of(test: dict):
    """The Check a test cell grades with (its module imported from the checks' folder)."""
    return getattr(importlib.import_module(test["module"]), test["check"])


def _grade_case(checking, process: AnswerProcess, test: dict, errors: dict) -> str | None:
    """None if the case passes, else the message (what Check.grade would raise)."""
    check = _check_of(test)
    title = test["title"]
    if title not in check.cases:
        return f"{check.__name__} has no case {title!r}"
    functions = []
    try:
        for name in test["names"]:
            function = process.function(name)
            if function is None:
                failed = "; ".join(f"{cell}: {e}" for cell, e in sorted(errors.items()))
                return (f"{title}: {name} is not defined"
                        + (f" (an answer cell raised {failed})" if failed else ""))
            functions.append(function)
        message = check._run(title, tuple(functions))
    except AnswerStopped as err:
        message = f"your answer stopped answering ({err})"
    return None if message is None else f"{title}: {message}"


# ---------------------------------------------------------------------------------------------
# nbgrader's steps


REPORT_SUFFIX = ".grading.json"  # the report written beside each autograded notebook
HIDDEN_KEY = "isolated_grading_source"  # where HideTests keeps a test cell's code meanwhile
HIDDEN_SOURCE = "# graded in a separate process after this notebook runs (isolated_grading.py)"
GRADING_TIMEOUT = 600  # seconds for the whole notebook's check
CALL_TIMEOUT = 120  # seconds for one call of the answer (nbgrader's cell timeout)
STARTUP_TIMEOUT = 300  # seconds for the answer's process to start and run its cells


_SNAPSHOTS: dict[str, dict[str, str]] = {}


def course_code(folder: pathlib.Path) -> dict[str, str]:
    """{file name: text} of the Python files of an assignment's source folder and of the text
    files in its data/ (as "data/<name>": the chapter's text, which a check measures a trained
    model on), read once per grading process, before the first student's notebook runs: a
    kernel that rewrites the checks on disk changes nothing for the notebooks graded after it
    in this process."""
    key = str(folder.resolve())
    if key not in _SNAPSHOTS:
        files = {path.name: path.read_text() for path in sorted(folder.glob("*.py"))}
        files.update({f"data/{path.name}": path.read_text(encoding="utf-8")
                      for path in sorted(folder.glob("data/*.txt"))})
        _SNAPSHOTS[key] = files
    return _SNAPSHOTS[key]


def _source_folder(preprocessor, resources) -> pathlib.Path:
    from nbgrader.coursedir import CourseDirectory

    course = CourseDirectory(parent=preprocessor.parent)
    assignment = resources["nbgrader"]["assignment"]
    return pathlib.Path(course.format_path(course.source_directory, ".", assignment))


def _preprocessors():
    from nbconvert.preprocessors import Preprocessor
    from traitlets import Bool, Float

    class HideTests(Preprocessor):
        """Before nbgrader runs the notebook: the test cells' code set aside."""

        enabled = Bool(True).tag(config=True)  # nbconvert's preprocessors are off by default

        def preprocess(self, nb, resources):
            folder = _source_folder(self, resources)
            course_code(folder)  # read before the kernel runs
            for cell in nb.cells:
                meta = cell.metadata.get("nbgrader", {})
                if meta.get("grade") and not meta.get("solution") and cell.cell_type == "code":
                    cell.metadata[HIDDEN_KEY] = cell.source
                    cell.source = HIDDEN_SOURCE
            # The grading needs nothing the kernel's run makes: it starts now and runs beside
            # the kernel (GradeIsolated collects it, or grades afresh if the job changed).
            settings = self.config.get("GradeIsolated", {})
            job = _job(nb, folder, settings.get("call_timeout", CALL_TIMEOUT))
            resources[STARTED_KEY] = CheckProcess(job, settings.get("timeout", GRADING_TIMEOUT))
            return nb, resources

    class GradeIsolated(Preprocessor):
        """After nbgrader ran the notebook: the answers graded in processes of their own, each
        test cell's code put back with this grading's verdict as its output."""

        enabled = Bool(True).tag(config=True)

        timeout = Float(GRADING_TIMEOUT, help="seconds for one notebook's grading").tag(
            config=True)
        call_timeout = Float(CALL_TIMEOUT, help="seconds for one call of an answer").tag(
            config=True)

        def preprocess(self, nb, resources):
            import nbformat

            tests = graded_cells(nb)
            job = _job(nb, _source_folder(self, resources), self.call_timeout)
            started = resources.pop(STARTED_KEY, None)
            if started is not None and started.job == job:
                verdict = started.verdict()
            else:
                if started is not None:
                    started.stop()
                verdict = CheckProcess(job, self.timeout).verdict()
            student = resources["nbgrader"].get("student")
            for flag in verdict["flags"]:
                self.log.warning("%s: %s", student, flag)
            folder = pathlib.Path(resources.get("metadata", {}).get("path") or ".")
            if folder.is_dir():  # beside the autograded notebook, for `make autograde`'s report
                name = resources["nbgrader"].get("notebook", "notebook")
                (folder / f"{name}{REPORT_SUFFIX}").write_text(json.dumps(
                    {"student": student, "flags": verdict["flags"],
                     "cell errors": verdict["errors"],
                     "failed": {k: v for k, v in verdict["results"].items() if v}}, indent=1))
            for test in tests:
                cell = nb.cells[test["index"]]
                cell.source = cell.metadata.pop(HIDDEN_KEY, cell.source)
                message = verdict["results"].get(test["grade_id"], "not graded")
                if message is None:
                    cell.outputs = [nbformat.v4.new_output(
                        "stream", name="stdout", text=f"{test['title']}: passed\n")]
                else:
                    cell.outputs = [nbformat.v4.new_output(
                        "error", ename="AssertionError", evalue=message,
                        traceback=[f"AssertionError: {message}"])]
            for cell in nb.cells:  # any test cell this grading did not recognise
                if HIDDEN_KEY in cell.metadata:
                    cell.source = cell.metadata.pop(HIDDEN_KEY)
                    cell.outputs = [nbformat.v4.new_output(
                        "error", ename="AssertionError", evalue="not graded",
                        traceback=["this test cell is not one of the book's checks"])]
            return nb, resources

    return HideTests, GradeIsolated


def _job(nb, folder: pathlib.Path, call_timeout: float) -> dict:
    """What the check's process needs for one notebook: the course's code, the answer's cells
    and the test cells (all known before the kernel runs the notebook)."""
    return {"files": course_code(folder), "cells": _answer_cells(nb),
            "tests": [{k: v for k, v in t.items() if k != "index"} for t in graded_cells(nb)],
            "timeout": call_timeout}


STARTED_KEY = "isolated_grading"  # in nbconvert's resources, from HideTests to GradeIsolated
_RUNNING: set = set()  # check processes not yet collected, stopped at exit


class CheckProcess:
    """The check's process for one notebook, started at once: the job in on stdin, the verdict
    out on stdout, read by a thread so that the process never waits on a full pipe. It and the
    answer's process it starts form a process group of their own, killed whole when the time
    (`timeout` seconds from the start) is up or the verdict is in."""

    def __init__(self, job: dict, timeout: float):
        import threading

        self.job, self.timeout, self.result = job, timeout, None
        self.process = subprocess.Popen([sys.executable, __file__, "check"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        _RUNNING.add(self)
        self.thread = threading.Thread(target=self._communicate, daemon=True)
        self.thread.start()

    def _communicate(self) -> None:
        try:
            out, err = self.process.communicate(json.dumps(self.job), timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            self.process.communicate()
            self.result = f"grading took longer than {self.timeout:g} s"
            return
        except Exception as err:  # noqa: BLE001 (a pipe closed by stop(): no verdict)
            self.result = f"the grading failed: {err}"
            return
        self.stop()  # an answer's process left behind
        try:
            self.result = json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            self.result = f"the grading failed: {err.strip()[-2000:]}"

    def stop(self) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        _RUNNING.discard(self)

    def verdict(self) -> dict:
        self.thread.join()
        if isinstance(self.result, dict):
            return self.result
        return {"results": {t["grade_id"]: self.result for t in self.job["tests"]},
                "flags": [], "errors": {}}


def _stop_running() -> None:
    for started in list(_RUNNING):
        started.stop()


atexit.register(_stop_running)


def __getattr__(name):  # HideTests and GradeIsolated, made on first use (nbconvert imported)
    if name in ("HideTests", "GradeIsolated"):
        hide, grade = _preprocessors()
        globals().update(HideTests=hide, GradeIsolated=grade)
        return globals()[name]
    raise AttributeError(name)


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["answer", workdir, read_fd, write_fd]:
            serve_answers(workdir, int(read_fd), int(write_fd))
        case ["check"]:
            verdict = grade_notebook(json.loads(sys.stdin.read()))
            sys.stdout.write("\n" + json.dumps(verdict) + "\n")
        case _:
            sys.exit(f"usage: {sys.argv[0]} check < job.json | answer WORKDIR READ_FD WRITE_FD")
