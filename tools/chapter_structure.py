"""The one reader of a chapter's structure: its setup cell, exercises, checks and solutions.

A chapter is a MyST notebook, chapters/NN-name.md. The book build executes it, _ext/notebooks.py
turns it into a Jupyter notebook, tools/classroom.py turns that notebook into a student notebook
and an nbgrader assignment, and the tests check every one of them. What they all need to agree
on is read (and, for the notebooks, marked) here and nowhere else. The setup cell that makes the
book's code importable is not in any source: its one template is SETUP_TEMPLATE, inserted when
the build reads a chapter (`with_setup_cell`) and when a notebook is made (`chapter_notebook`).
In a source the MyST markup says where exercises and solutions are (`{exercise}`, `{solution}`,
`{solution-start}` ... `{solution-end}`, code cells tagged `solution`); `read_source` reads it,
and `parts` tells the notebook writer which text and cells belong to a solution. In a notebook,
cell tags say it (SETUP, EXERCISE, CHECK, SOLUTION; STUB and CHECK_CALL in student notebooks),
and `exercises`, `exercise_section`, `is_setup`, `imported_checks` read them. A solution cell
that defines a function and calls a check is an answer: `split_solution` cuts it into the
statements a student's stub and the nbgrader solution region are made of.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
from dataclasses import dataclass, field

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTER_DOC = re.compile(r"chapters/\d\d-[\w-]+$")  # a numbered chapter's docname

# The book's code, every file of code/, in the order a notebook imports it: the module, the
# stored runs' loader, chapter 6's two-lookup task, chapter 8's position code and its
# train-short, test-long task, the module's siblings of Part III (which may import it), the
# diagrams (drawn from all of them), Part IV's induction heads (which fetches trained models
# from beside the code), the explorable figures' helper, the checks' machinery, and each
# chapter's checks (checks_<chapter>.py, which import all of those).
# In the order of their imports: a module comes after those it imports (the setup cell imports
# them one by one, fetching each that is missing).
TEACHING_FILES = ("attention.py", "stored.py", "lookups.py", "position.py", "extrapolation.py",
                  "flash.py", "io_model.py", "decode_cost.py", "transformer.py", "diagrams.py",
                  "induction.py", "lm.py", "explorable.py")
CHECKING_FILE = "checking.py"
CHECK_FILES = tuple(sorted(path.name for path in (ROOT / "code").glob("checks_*.py")))
CODE_FILES = (*TEACHING_FILES, CHECKING_FILE, *CHECK_FILES)
IMPORTED_CHECKS = re.compile(r"^from (checks_\w+) import", re.M)


def code_files(text: str) -> tuple[str, ...]:
    """The files of code/ that a chapter or notebook needs, from its text (a chapter's source,
    or its cells' sources joined): the teaching modules, the checks' machinery and the checks
    files its cells import."""
    imported = {f"{module}.py" for module in IMPORTED_CHECKS.findall(text)}
    unknown = imported - set(CHECK_FILES)
    if unknown:
        raise ValueError(f"no file code/{sorted(unknown)[0]} for an imported check")
    return (*TEACHING_FILES, CHECKING_FILE, *(name for name in CHECK_FILES if name in imported))

# Cell tags of the notebooks made from the chapters.
SETUP = "setup"          # the setup cell (also remove-cell, as in the book)
EXERCISE = "exercise"    # an exercise's statement, a markdown cell of its own
CHECK = "check"          # a cell that imports a check of code/checks_<chapter>.py
SOLUTION = "solution"    # a cell of a solution (in the sources too, on code cells)
STUB = "stub"            # student notebooks: the functions of an answer, bodies to write
CHECK_CALL = "check-call"  # student notebooks: the call of the check on them

# What a student finds in place of a solution's function body, in student notebooks and (as
# nbgrader's ClearSolutions.code_stub) in the released assignments.
STUB_BODY = "# YOUR CODE HERE\nraise NotImplementedError()"


# ---------------------------------------------------------------------------------------------
# The setup cell


def repository() -> dict[str, str]:
    """The published repository, from _config.yml: the one place it is written down."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)/?", config["url"])
    assert match, f"_config.yml: repository.url must be a GitHub URL, got {config['url']!r}"
    org, repo = match.groups()
    ref = str(config.get("branch", "main"))
    return {"url": config["url"], "org": org, "repo": repo, "ref": ref,
            "raw": f"https://raw.githubusercontent.com/{org}/{repo}/{ref}/"}


def torch_pin() -> str:
    """The torch version requirements.txt pins, which the book's text was checked with."""
    pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert pin, "requirements.txt must pin torch exactly"
    return pin.group(1)


# The code of every chapter's first code cell; @RAW@ is the raw-file address of the repository
# at the book's ref. In the book the module is importable and the fetch never runs. The address
# of the code/ folder goes to the environment as ATTENTION_CODE_URL, where code/stored.py finds
# the trained models and the text (models/ and data/ beside code/) when the notebook is not in
# the repository.
SETUP_TEMPLATE = '''\
# Setup, hidden in the book. Makes the book's code importable (the module code/attention.py,
# its siblings and this chapter's checks, code/checks_*.py): from the repository when the notebook
# sits in it, else (Colab, a download) fetched once into this folder. Without myst_nb, glue()
# shows its value, or keeps it in myst_nb.glued when told not to show it. Then: reproducible
# SVG figures, short tensor printing, and the torch version, compared with the one the book's
# text was checked with.
import importlib, os, pathlib, sys, urllib.request
# jsonschema, which nbformat and Altair import, would build 38 parsers at import for an IRI
# format check no chapter uses: 2 s of every kernel's start. It goes without them.
sys.modules.setdefault("rfc3987_syntax", None)
sys.path.insert(0, str(pathlib.Path.cwd().parent / "code"))
# The book's code/ folder: the published one at the book's ref, or where ATTENTION_PY_URL says
# attention.py is. code/stored.py fetches trained models and the text from beside it.
os.environ["ATTENTION_CODE_URL"] = (os.environ.get("ATTENTION_PY_URL") or (
    "@RAW@"
    "code/attention.py")).rsplit("/", 1)[0]
for module in @MODULES@:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        url = f"{os.environ['ATTENTION_CODE_URL']}/{module}.py"
        try:
            urllib.request.urlretrieve(url, f"{module}.py")
        except OSError as err:
            raise RuntimeError(f"could not fetch {url}: {err}. Upload code/{module}.py next to "
                               "this notebook, or set ATTENTION_PY_URL to the address of "
                               "attention.py (the others are fetched from beside it).") from None
        sys.path.insert(0, os.getcwd())
        importlib.import_module(module)
try:
    import myst_nb
except ImportError:
    import types, IPython.display
    sys.modules["myst_nb"] = myst_nb = types.ModuleType("myst_nb")
    myst_nb.glued = {}
    myst_nb.glue = lambda name, value, display=True: (
        IPython.display.display(value) if display else myst_nb.glued.__setitem__(name, value))
%config InlineBackend.figure_formats = ["svg"]
%config InlineBackend.print_figure_kwargs = {"bbox_inches": "tight", "metadata": {"Date": None}}
import matplotlib
matplotlib.rcParams.update({"svg.hashsalt": "attention-computed", "image.cmap": "viridis"})
import torch
torch.set_printoptions(precision=3, sci_mode=False)
torch.set_num_threads(1)  # small tensors: one thread is as fast, and chapters can run side by side
BOOK_TORCH = "@TORCH@"  # requirements.txt's pin
print(f"torch {torch.__version__}", "" if torch.__version__.split("+")[0] == BOOK_TORCH else
      f"(the book was checked with {BOOK_TORCH}: where its text names that version, an "
      "output here may differ)")'''

SETUP_TAGS = ["remove-cell", SETUP]


def setup_source(files: tuple[str, ...] = CODE_FILES) -> str:
    """The setup cell's code, with _config.yml's address and requirements.txt's torch, for a
    notebook that needs `files` of code/ (code_files says which)."""
    modules = tuple(name.removesuffix(".py") for name in files)
    return (SETUP_TEMPLATE.replace("@RAW@", repository()["raw"])
            .replace("@TORCH@", torch_pin()).replace("@MODULES@", repr(modules)))


def is_setup(cell) -> bool:
    return SETUP in tags(cell)


def with_setup_cell(text: str, setup_file: str) -> str:
    """A chapter's MyST text as the build reads it: the setup cell first, every other line at
    the number it has in the source, so that warnings point at the right line.

    The front matter (ten lines of YAML) is written as one line of JSON, which YAML reads the
    same; the lines that frees hold blank lines and a code cell that loads the setup code from
    `setup_file` (myst-nb's `:load:` option), ending on the front matter's last line. The cell
    comes before the chapter's label and title, where a removed cell shows nothing, and so
    executes first.
    """
    lines = text.split("\n")
    if lines[0] != "---" or "---" not in lines[1:]:
        raise ValueError("a chapter starts with its front matter between --- lines")
    end = lines.index("---", 1)
    meta = yaml.safe_load("\n".join(lines[1:end]))
    front = ["---", json.dumps(meta), "---"]
    cell = ["```{code-cell} ipython3", f":tags: [{', '.join(SETUP_TAGS)}]",
            f":load: {setup_file}", "```"]
    room = end + 1 - len(front) - len(cell)
    if room < 0:
        raise ValueError(f"the front matter has {end + 1} lines; the setup cell needs "
                         f"{len(front) + len(cell)}")
    # The cell ends where the front matter did: myst-nb counts the next cell's lines from there.
    return "\n".join(front + [""] * room + cell + lines[end + 1:])


def setup_cell(files: tuple[str, ...] = CODE_FILES):
    """The setup cell of a chapter notebook, folded as in the book."""
    import nbformat

    cell = nbformat.v4.new_code_cell(setup_source(files))
    cell.metadata["tags"] = list(SETUP_TAGS)
    return cell


def chapter_notebook(path: pathlib.Path):
    """The chapter source read by jupytext, with the setup cell after the title: the cells the
    build executes, in the order of the notebooks made from it."""
    import jupytext
    import nbformat

    notebook = jupytext.read(path)
    first = notebook.cells[0]
    lines = first.source.split("\n")
    title = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
    if first.cell_type != "markdown" or title is None:
        raise ValueError(f"{path.name}: the first cell must hold the chapter's title")
    first.source = "\n".join(lines[:title + 1])
    cells = [first, setup_cell(code_files(path.read_text()))]
    rest = "\n".join(lines[title + 1:]).strip("\n")
    if rest:
        cells.append(nbformat.v4.new_markdown_cell(rest))
    notebook.cells[:1] = cells
    return notebook


# ---------------------------------------------------------------------------------------------
# MyST sources: directives, exercises, solutions

FENCE = re.compile(r"^(`{3,}|:{3,})\{([\w:-]+)\}\s*(.*)$")
PLAIN_FENCE = re.compile(r"^(`{3,}|~{3,})")


@dataclass
class Block:
    """A line of markdown text, a fenced block without a directive (verbatim), or a directive
    with its argument and body (its fences left out)."""
    lines: list[str]  # as in the source, fences included
    name: str | None = None
    argument: str = ""
    body: list[str] = field(default_factory=list)
    verbatim: bool = False


def blocks(lines: list[str]):
    """The lines as Blocks, in order; a directive's body ends at the fence that opened it."""
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        plain = PLAIN_FENCE.match(line)
        if fence or plain:
            marker = (fence or plain).group(1)
            close = re.compile(rf"^{re.escape(marker[0])}{{{len(marker)}}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            if j == len(lines):
                raise ValueError(f"unclosed fence {line!r}")
            if fence:
                yield Block(lines[i:j + 1], fence.group(2), fence.group(3).strip(),
                            lines[i + 1:j])
            else:
                yield Block(lines[i:j + 1], verbatim=True)
            i = j + 1
        else:
            yield Block([line])
            i += 1


def options(body: list[str]) -> tuple[dict[str, str], list[str]]:
    """A directive's options (a YAML block or `:key: value` lines) and the rest of its body."""
    opts, i = {}, 0
    if body and body[0].strip() == "---":
        end = body.index("---", 1)
        opts = {k: str(v) for k, v in (yaml.safe_load("\n".join(body[1:end])) or {}).items()}
        i = end + 1
    while i < len(body) and re.match(r"^:[\w-]+:", body[i]):
        key, _, value = body[i][1:].partition(":")
        opts[key] = value.strip()
        i += 1
    return opts, body[i:]


@dataclass
class Part:
    """A piece of a chapter in reading order: a code cell, or a run of lines of a markdown
    cell, with the label of the exercise whose solution it belongs to (None outside any)."""
    cell: object  # the jupytext cell it comes from
    lines: list[str]
    solution_of: str | None


def parts(notebook):
    """Parts of the chapter notebook: each code cell, and each markdown cell cut where a
    solution starts or ends. A `{solution}` directive is a solution; so is everything from a
    `{solution-start}` to its `{solution-end}` (the directives themselves included), across
    cells."""
    gated = None
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            yield Part(cell, cell.source.split("\n"), gated)
            continue
        runs: list[Part] = []
        for block in blocks(cell.source.split("\n")):
            label = gated
            if block.name == "solution-start":
                gated = label = block.argument
            elif block.name == "solution-end":
                gated = None
            elif block.name == "solution":
                label = block.argument
            if runs and runs[-1].solution_of == label:
                runs[-1].lines += block.lines
            else:
                runs.append(Part(cell, list(block.lines), label))
        yield from runs


@dataclass
class CodeCell:
    chapter: str
    source: str
    tags: list[str]
    solution_of: str | None  # the label of the exercise whose solution holds it, if any


@dataclass
class Exercise:
    chapter: str
    label: str
    title: str
    text: str
    solution: dict[str, str] | None = None  # the options of its solution directive


@dataclass
class Source:
    name: str
    cells: list[CodeCell] = field(default_factory=list)
    exercises: list[Exercise] = field(default_factory=list)


def read_source(path: pathlib.Path) -> Source:
    """A chapter source's code cells (with the solution each belongs to) and exercises (with
    their solution's options), as the build and the notebook writer read them."""
    import jupytext

    source = Source(path.stem)
    by_label = {}
    for part in parts(jupytext.read(path)):
        if part.cell.cell_type == "code":
            source.cells.append(CodeCell(path.stem, part.cell.source, tags(part.cell),
                                         part.solution_of))
            continue
        for block in blocks(part.lines):
            opts, body = options(block.body)
            if block.name == "exercise":
                exercise = Exercise(path.stem, opts.get("label", ""), block.argument,
                                    "\n".join(body) + "\n")
                source.exercises.append(exercise)
                by_label[exercise.label] = exercise
            elif block.name in ("solution", "solution-start") and block.argument in by_label:
                by_label[block.argument].solution = opts
    return source


# ---------------------------------------------------------------------------------------------
# Notebooks made from the chapters: what the notebook writer marks, read back


def tags(cell) -> list[str]:
    return list(cell.metadata.get("tags", []))


def is_solution(cell) -> bool:
    return SOLUTION in tags(cell)


def exercise_markdown(number: str, title: str, statement: str) -> str:
    return f"#### Exercise {number}: {title}\n\n{statement}"


def solution_heading(number: str) -> str:
    return f"**Solution to Exercise {number}.**"


EXERCISE_HEADING = re.compile(r"\A#### Exercise (\d+\.\d+): (.*)$", re.M)
SOLUTION_HEADING = re.compile(r"\A\*\*Solution to Exercise [\d.]+\.\*\*\n*")


def exercise_number(cell) -> str | None:
    """The number of the exercise a cell states, or None if it states none."""
    if cell.cell_type != "markdown" or EXERCISE not in tags(cell):
        return None
    return EXERCISE_HEADING.match(cell.source).group(1)


def without_solution_heading(source: str) -> str:
    return SOLUTION_HEADING.sub("", source)


def imported_checks(source: str) -> list[str]:
    """The checks that a code cell imports (`from checks_masking import check_x`)."""
    if "checks_" not in source:
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics, as in the setup cell
        return []
    return [alias.name for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("checks_")
            for alias in node.names if alias.name.startswith("check_")]


@dataclass
class NotebookExercise:
    number: str
    title: str
    index: int  # of its statement cell
    statement: str
    solution: list = field(default_factory=list)  # its solution's cells

    @property
    def coding(self) -> bool:
        """Answered by functions that a check grades."""
        return any(c.cell_type == "code" and stub_code(c.source) for c in self.solution)

    @property
    def code(self) -> bool:
        """Its solution runs code."""
        return any(c.cell_type == "code" for c in self.solution)


def exercises(notebook) -> list[NotebookExercise]:
    """Each exercise of a chapter notebook: its statement cell and the solution cells that
    follow it, up to the next exercise."""
    found = []
    for index, cell in enumerate(notebook.cells):
        number = exercise_number(cell)
        if number:
            title = EXERCISE_HEADING.match(cell.source).group(2).strip()
            found.append(NotebookExercise(number, title, index, cell.source))
        elif found and is_solution(cell):
            found[-1].solution.append(cell)
    return found


SECTION_HEADING = re.compile(r"^## ", re.M)


def exercise_section(notebook) -> tuple[int, int, int]:
    """Where the section that holds the exercises is: (the index of the cell with its heading,
    the heading's offset in that cell, the index of the first cell after the section)."""
    cells = notebook.cells
    first = next(i for i, cell in enumerate(cells) if exercise_number(cell))
    start = next(i for i in range(first - 1, -1, -1) if cells[i].cell_type == "markdown"
                 and SECTION_HEADING.search(cells[i].source))
    offset = [m.start() for m in SECTION_HEADING.finditer(cells[start].source)][-1]
    end = next((i for i in range(first + 1, len(cells)) if cells[i].cell_type == "markdown"
                and SECTION_HEADING.search(cells[i].source)), len(cells))
    return start, offset, end


# ---------------------------------------------------------------------------------------------
# Solution cells: answers, stubs and check calls


def check_call(node) -> str | None:
    """The name of the check a top-level statement calls (`check_x(f)`), or None."""
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id.startswith("check_")):
        return node.value.func.id
    return None


def check_calls(source: str) -> list[tuple[str, list[str]]]:
    """(check name, argument names) of each top-level call of a check in a code cell."""
    if "check_" not in source:
        return []
    return [(check_call(node), [arg.id for arg in node.value.args if isinstance(arg, ast.Name)])
            for node in ast.parse(source).body if check_call(node)]


def split_solution(source: str):
    """Yield (kind, lines) for the top-level statements of a solution cell.

    kind is "import", "def" (lines: the header and docstring, the body, the body's indent and
    the function's name) or "check" (a call of a check_* function); anything else is "other".
    nbgrader has no reader of Python statements: its solution regions are marked by comment
    lines, which this is what writes (solution_region_code).
    """
    lines = source.splitlines()
    tree = ast.parse(source)
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        chunk = lines[first - 1:node.end_lineno]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield "import", chunk
        elif isinstance(node, ast.FunctionDef):
            body = node.body
            has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                       and isinstance(body[0].value.value, str))
            head_end = (body[0].end_lineno if has_doc else body[0].lineno - 1)
            if len(body) == int(has_doc):
                raise ValueError(f"{node.name} has no body to replace")
            head = lines[first - 1:head_end]
            rest = lines[head_end:node.end_lineno]
            indent = re.match(r"\s*", lines[body[int(has_doc)].lineno - 1]).group()
            yield "def", (head, rest, indent, node.name)
        elif check_call(node):
            yield "check", chunk
        else:
            yield "other", chunk


def function_names(source: str) -> list[str]:
    return [chunk[3] for kind, chunk in split_solution(source) if kind == "def"]


def solution_region_code(source: str) -> str:
    """The imports and definitions of a solution cell, each function's body inside nbgrader's
    solution markers (### BEGIN SOLUTION, ### END SOLUTION); calls and the rest left out."""
    imports, defs = [], []
    for kind, chunk in split_solution(source):
        if kind == "import":
            imports += chunk
        elif kind == "def":
            head, rest, indent, _ = chunk
            defs.append("\n".join(head + [indent + "### BEGIN SOLUTION"] + rest
                                  + [indent + "### END SOLUTION"]))
    return "\n\n\n".join(["\n".join(imports)] * bool(imports) + defs)


def clear_solutions(source: str) -> str:
    """Code with every solution region replaced by STUB_BODY, by nbgrader's ClearSolutions, as
    nbgrader's release does."""
    import nbformat
    from nbgrader.preprocessors import ClearSolutions

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    # enforce_metadata=False: the cell is not an nbgrader solution cell, just its code.
    clear = ClearSolutions(code_stub={"python": STUB_BODY}, enforce_metadata=False)
    notebook, _ = clear.preprocess(notebook, {})
    return notebook.cells[0].source


def stub_code(source: str) -> tuple[str, str] | None:
    """A solution cell as a student gets it: (stub cell, check cell), or None.

    Every function the cell defines keeps its signature and docstring and has its body replaced
    by STUB_BODY; imports stay; calls of check_* functions move to a cell of their own; anything
    else goes. A cell that defines no function, or calls no check at its top level (such as a
    demonstration that a check rejects a wrong answer), is not an answer and gives None.
    """
    statements = list(split_solution(source))
    checks = [line for kind, chunk in statements if kind == "check" for line in chunk]
    if not any(kind == "def" for kind, _ in statements) or not checks:
        return None  # no check call: a demonstration, not an answer
    return clear_solutions(solution_region_code(source)), "\n".join(checks)
