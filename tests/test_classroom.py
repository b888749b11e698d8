"""Classroom material: chapter notebooks for Colab and Binder, student notebooks, nbgrader course.

The fast tests read files. The ones marked `book` execute every chapter notebook: alone in an
empty folder as Colab would (fetching attention.py from ATTENTION_PY_URL, without myst_nb), and
through nbgrader's generate_assignment and autograde.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import nbformat
import pytest

import build_book
import chapter_structure as structure
import classroom
import explorable
from conftest import timed

ROOT = classroom.ROOT
MD = classroom.numbered_chapters()
NOTEBOOKS = classroom.chapter_notebooks()
MYST = re.compile(r"\{[\w:-]+\}`|^[`:]{3,}\{|^:[\w-]+:|^\(\S+\)=\s*$", re.M)


def read(path):
    return nbformat.read(path, as_version=4)


def test_every_chapter_has_a_notebook():
    assert [p.stem for p in NOTEBOOKS] == [p.stem for p in MD], (
        "chapters/*.ipynb and chapters/*.md differ: run `make notebooks`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
class TestChapterNotebook:
    def test_code_cells_are_the_chapters(self, path):
        # The markdown is checked against a fresh build in tests/test_book.py; the code, which
        # is what runs in Colab, can be checked without one.
        source = [c.source for c in structure.chapter_notebook(path.with_suffix(".md")).cells
                  if c.cell_type == "code"]
        notebook = [c.source for c in read(path).cells if c.cell_type == "code"]
        assert notebook == source, f"{path.name} is stale: run `make notebooks`"

    def test_committed_without_outputs(self, path):
        for cell in read(path).cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None

    def test_markdown_has_no_myst(self, path):
        for cell in read(path).cells:
            if cell.cell_type == "markdown":
                assert not MYST.search(cell.source), cell.source[:300]


def test_code_files_are_every_file_of_code():
    # The setup cell fetches CODE_FILES by name in Colab: a file of code/ missing from the list
    # would import in the book and fail alone.
    on_disk = {p.name for p in (classroom.ROOT / "code").glob("*.py")}
    assert set(classroom.CODE_FILES) == on_disk
    assert classroom.CODE_FILES[0] == "attention.py"
    # the checks' machinery, then every chapter's checks, which import it
    index = classroom.CODE_FILES.index(structure.CHECKING_FILE)
    assert all(name.startswith("checks_") for name in classroom.CODE_FILES[index + 1:])
    assert len(classroom.CODE_FILES[index + 1:]) == len(classroom.numbered_chapters())


def test_each_notebook_fetches_the_checks_it_imports_and_no_other():
    for path in NOTEBOOKS:
        text = path.with_suffix(".md").read_text()
        files = structure.code_files(text)
        imported = set(re.findall(r"^from (checks_\w+) import", text, re.M))
        assert {f.removesuffix(".py") for f in files if f.startswith("checks_")} == imported
        assert imported, path.name


def test_every_notebook_starts_with_the_setup_cell_from_the_configured_repository():
    """Colab needs the whole setup cell in the notebook: after the title, tagged setup, folded."""
    repo = classroom.repository()
    assert repo["raw"].startswith(f"https://raw.githubusercontent.com/{repo['org']}/{repo['repo']}/")
    assert f'"{repo["raw"]}"' in structure.setup_source()  # with _config.yml's address
    for path in NOTEBOOKS:
        expected = structure.setup_source(structure.code_files(path.with_suffix(".md").read_text()))
        cells = read(path).cells
        assert [structure.is_setup(c) for c in cells].index(True) == 1, path.name
        assert cells[1].source == expected, path.name
        assert cells[1].metadata["jupyter"] == {"source_hidden": True}


def test_readme_badges_follow_config():
    repo = classroom.repository()
    readme = (ROOT / "README.md").read_text()
    colab = re.findall(r"https://colab\.research\.google\.com/github/([^)\s]+)", readme)
    binder = re.findall(r"https://mybinder\.org/v2/gh/([^)\s?]+)", readme)
    assert colab and binder, "README has no Colab or Binder badge"
    for link in colab:
        assert link.startswith(f"{repo['org']}/{repo['repo']}/blob/{repo['ref']}/chapters/")
        assert (ROOT / link.split(f"/blob/{repo['ref']}/", 1)[1]).is_file(), link
    for link in binder:
        assert link == f"{repo['org']}/{repo['repo']}/{repo['ref']}", link


def test_binder_pins_cpu_torch_at_the_books_versions():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    binder = (ROOT / "binder" / "requirements.txt").read_text()
    assert re.search(r"^--extra-index-url https://download\.pytorch\.org/whl/cpu$", binder, re.M)
    assert re.search(rf"^torch=={re.escape(pins['torch'])}\+cpu$", binder, re.M)
    for name in ("numpy", "matplotlib", "altair"):
        assert re.search(rf"^{name}=={re.escape(pins[name])}$", binder, re.M), name
    # Nothing else: everything the chapters import must be torch, numpy, matplotlib, altair,
    # IPython (which Binder's Jupyter brings), the standard library, myst_nb (stood in for by
    # the setup cell), and the book's code (classroom.CODE_FILES). vl-convert-python, which
    # explorable.py uses only in the book's build, is not needed there.
    allowed = {"torch", "numpy", "matplotlib", "altair", "IPython", "myst_nb",
               *(name.removesuffix(".py") for name in classroom.CODE_FILES)}
    stdlib = set(sys.stdlib_module_names)
    for path in MD:
        code = "\n".join(c.source for c in structure.chapter_notebook(path).cells
                         if c.cell_type == "code")
        for module in re.findall(r"^\s*(?:from|import) (\w+)", code, re.M):
            assert module in allowed | stdlib, f"{path.name} imports {module}"


# ---------------------------------------------------------------------------------------------
# Student notebooks


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    return {p.stem: read(p) for p in classroom.write_student(out)}


def solution_functions(path):
    """{name: body} of every function that the notebook's solution cells define."""
    found = {}
    for cell in read(path).cells:
        if cell.cell_type == "code" and structure.is_solution(cell):
            for kind, chunk in structure.split_solution(cell.source):
                if kind == "def":
                    found[chunk[3]] = "\n".join(chunk[1])
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_notebook_has_no_solution(student, path):
    notebook = student[path.stem]
    text = "\n".join(c.source for c in notebook.cells)
    for cell in notebook.cells:
        assert not structure.is_solution(cell)
    assert "Solution to Exercise" not in text
    stubbed = {}
    for cell in notebook.cells:
        if cell.cell_type == "code" and "# YOUR CODE HERE" in cell.source:
            for kind, chunk in structure.split_solution(cell.source):
                if kind == "def":
                    stubbed[chunk[3]] = chunk[1]
    for name, body in solution_functions(path).items():
        assert body not in text, f"the body of {name} is in the student notebook"
        if name in stubbed:
            assert [line.strip() for line in stubbed[name]
                    if not line.strip().startswith("#")] == ["raise NotImplementedError()"]
        else:  # a demonstration (such as a wrong answer the check rejects) goes entirely
            assert not re.search(rf"\b{name}\b", text), f"{name} is in the student notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_notebook_keeps_checks_and_stubs(student, path):
    notebook = student[path.stem]
    code = [c for c in notebook.cells if c.cell_type == "code"]
    checks = [c for c in code if structure.CHECK in structure.tags(c)]
    assert checks and all(re.fullmatch(r"from checks_\w+ import check_\w+", c.source)
                          for c in checks), (
        "the chapter's checks are missing")
    stubs = [i for i, c in enumerate(code) if structure.STUB in structure.tags(c)]
    assert len(stubs) >= 1
    assert stubs == [i for i, c in enumerate(code) if "# YOUR CODE HERE" in c.source]
    for index in stubs:  # each stub is followed by the call of its check
        following = code[index + 1]
        assert structure.tags(following) == [structure.CHECK_CALL]
        assert re.fullmatch(r"(check_\w+\([\w, ]+\)\n?)+", following.source), following.source
    assert notebook.cells[0].source.startswith("# "), "the title comes first"
    assert "Student version" in notebook.cells[1].source


# ---------------------------------------------------------------------------------------------
# nbgrader course


# A graded test cell imports its check itself, then grades one case.
GRADED_TEST = re.compile(r"from checks_\w+ import (check_\w+)\n\1\.grade\(")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    out = tmp_path_factory.mktemp("course")
    classroom.write_assignments(out)
    return out


def test_course_layout_and_metadata(course):
    assert (course / "nbgrader_config.py").is_file()
    for path in NOTEBOOKS:
        folder = course / "source" / path.stem
        files = structure.code_files(path.with_suffix(".md").read_text())
        assert sorted(p.name for p in folder.glob("*.py")) == sorted(files)
        for name in files:
            assert (folder / name).read_text() == (ROOT / "code" / name).read_text()
        notebook = read(folder / path.name)
        grade_ids, points = [], 0
        for cell in notebook.cells:
            meta = cell.metadata.get("nbgrader")
            if not meta:
                continue
            grade_ids.append(meta["grade_id"])
            if meta["grade"]:
                assert meta["points"] > 0
                points += meta["points"]
                if meta["solution"]:  # an answer graded by hand, its solution in the source
                    assert meta["grade_id"].startswith("answer-") and cell.source.strip()
                else:
                    assert meta["locked"] and GRADED_TEST.match(cell.source), cell.source
            elif meta["solution"]:
                assert "### BEGIN SOLUTION" in cell.source
        assert len(grade_ids) == len(set(grade_ids)), "grade ids must be unique"
        assert points >= 3, f"{path.name}: {points} points"
        assert "setup" in grade_ids and any(g.startswith("check_") for g in grade_ids)


def test_every_exercise_has_a_graded_cell(course):
    """An autograded test after a coding exercise, an answer graded by hand after any other."""
    for path in NOTEBOOKS:
        chapter = read(path)
        numbers = [ex.number for ex in structure.exercises(chapter)]
        directives = path.with_suffix(".md").read_text().count("```{exercise}")
        assert len(numbers) == directives, (path.name, numbers)
        graded = classroom.graded_by_exercise(read(course / "source" / path.stem / path.name))
        assert sorted(graded) == sorted(numbers), (path.name, graded, numbers)
        key = (course / "answer-key" / f"{path.stem}.md").read_text()
        for ex in structure.exercises(chapter):
            assert f"## Exercise {ex.number}: {ex.title}" in key


def make(target: str, course: pathlib.Path, assignment: str = "") -> str:
    """`make <target> COURSE=course A=assignment` with a PATH that has no trace of .venv: the
    course's commands must work without the environment activated."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if ".venv" not in p and p != str(pathlib.Path(sys.executable).parent))
    proc = subprocess.run(["make", "-s", target, f"COURSE={course}", f"A={assignment}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# A check records what an answer runs in its own thread only (checking.recording), but chapter
# 3's check sets PyTorch's global generator for a moment to see whether an answer reseeds it
# (checks_scaling._reseeds), so two cases must not run at once in one process: the `graded`
# fixture builds its submissions in two threads.
IN_PROCESS_GRADING = threading.Lock()


def catalogue_answer(check: str, function: str, earns: str):
    """A wrong answer of tests/test_exercises.py's catalogue for `function`, as the source of a
    definition named `function` with the catalogue's helpers it calls, and the points the
    in-process grading gives that very source; None if the catalogue has none such."""
    import inspect

    import test_exercises as catalogue

    names = catalogue.REFERENCES[check].functions
    known = set(catalogue.SOLUTION_GLOBALS) | set(dir(__builtins__))

    def helpers(fn, seen):
        """Sources of the catalogue's functions that fn calls, deepest first."""
        found = []
        for name in fn.__code__.co_names:
            helper = getattr(catalogue, name, None)
            if name in known or name in seen or not inspect.isfunction(helper):
                continue
            seen.add(name)
            found += helpers(helper, seen) + [inspect.getsource(helper)]
        return found

    for fn_name, fragment, replaces, fn in catalogue.WRONG.get(check, []):
        if (replaces or names[0]) != function or catalogue.EARNS[check, fn_name] != earns:
            continue
        source = inspect.getsource(fn)
        source = source[source.index(f"def {fn_name}("):]  # without its registration
        source = source.replace(f"def {fn_name}(", f"def {function}(", 1)
        source = "\n\n".join(helpers(fn, {fn_name}) + [source])
        namespace = dict(catalogue.SOLUTION_GLOBALS)
        try:
            exec(compile(source, f"<{fn_name}>", "exec"), namespace)
        except NameError:
            continue
        try:
            with IN_PROCESS_GRADING:
                earned, _ = catalogue.graded_points(check, {function: namespace[function]})
        except NameError:
            continue  # it needs a name the catalogue's module has and a notebook has not
        return source, earned
    return None


def mistaken_submission(course: pathlib.Path, name: str, earns: str) -> dict[str, float]:
    """A copy of the reference submission whose answers are catalogue answers that earn
    `earns` ("part": common mistakes; "nothing": forbidden calls), as student `earns`; returns
    the points each graded cell should give, from the in-process grading."""
    folder = course / "submitted" / earns / name
    shutil.copytree(course / "source" / name, folder, dirs_exist_ok=True)
    notebook = read(folder / f"{name}.ipynb")
    expected = {}
    cells = notebook.cells
    for index, cell in enumerate(cells):
        meta = cell.metadata.get("nbgrader", {})
        if not (meta.get("solution") and not meta.get("grade")):
            continue
        tests = [c for c in cells[index + 1:] if c.metadata.get("nbgrader", {}).get("grade")
                 and GRADED_TEST.match(c.source)][:1]
        check = GRADED_TEST.match(tests[0].source).group(1)
        for function in meta["grade_id"].split("-"):
            found = catalogue_answer(check, function, earns)
            if found:
                cell.source += "\n\n\n" + found[0]
                expected[check] = found[1]
                break
    nbformat.write(notebook, folder / f"{name}.ipynb")
    return expected


REDEFINED_CHECK = """

class _AlwaysPasses:  # what a student might try: a check that passes everything
    def grade(self, *args, **kwargs):
        print("passed")

    def __call__(self, *args, **kwargs):
        print("all cases pass")


{names} = {instances}
"""


def redefining_submission(course: pathlib.Path, name: str) -> None:
    """The release with its answers left as stubs, and every check redefined in each answer cell
    to pass everything, as student "redefines": the graded cells import the checks themselves,
    so it earns what a blank notebook earns from them, nothing."""
    folder = course / "submitted" / "redefines" / name
    shutil.copytree(course / "release" / name, folder, dirs_exist_ok=True)
    notebook = read(folder / f"{name}.ipynb")
    checks = sorted({GRADED_TEST.match(c.source).group(1) for c in notebook.cells
                     if GRADED_TEST.match(c.source)})
    for cell in notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and not meta.get("grade"):
            cell.source += REDEFINED_CHECK.format(
                names=", ".join(checks), instances=", ".join("_AlwaysPasses()" for _ in checks))
    nbformat.write(notebook, folder / f"{name}.ipynb")


def grade_chapter(course: pathlib.Path, name: str) -> dict:
    """release, then autograde the source (as 'reference'), the blank release and two
    submissions made of catalogue answers ('part', 'nothing'), and write feedback, each with its
    make target."""
    make("release", course, name)
    for student, folder in (("reference", "source"), ("blank", "release")):
        target = course / "submitted" / student / name
        shutil.copytree(course / folder / name, target, dirs_exist_ok=True)
    expected = {earns: mistaken_submission(course, name, earns) for earns in ("part", "nothing")}
    redefining_submission(course, name)
    summary = make("autograde", course, name)
    make("feedback", course, name)
    result = {student: (row["auto"], row["max_auto"], row["max_manual"])
              for student, row in classroom.scores(course, name).items()}
    release = read(course / "release" / name / f"{name}.ipynb")
    return {"scores": result, "release": release, "summary": summary, "course": course,
            "expected": expected, "by_check": scores_by_check(course, name)}


def scores_by_check(course: pathlib.Path, name: str) -> dict[str, dict[str, float]]:
    """{student: {check name: points of its test cells}} from gradebook.db."""
    from nbgrader.api import Gradebook

    notebook = read(course / "source" / name / f"{name}.ipynb")
    check_of = {c.metadata["nbgrader"]["grade_id"]: GRADED_TEST.match(c.source).group(1)
                for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade")
                and GRADED_TEST.match(c.source)}
    result = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for submission in gradebook.assignment_submissions(name):
            row = result.setdefault(submission.student.id, {})
            for nb in submission.notebooks:
                for grade in nb.grades:
                    if grade.name in check_of:
                        check = check_of[grade.name]
                        row[check] = row.get(check, 0.0) + (grade.score or 0.0)
    return result


# `make test` takes one chapter through every nbgrader step (one with exercises graded by hand); the
# in-process tests (tests/test_exercises.py, tests/test_checking.py) grade every check of every
# chapter against its catalogue. `make check-release` runs nbgrader on every other chapter.
GRADED_IN_TEST = ("08-position",)


def nbgrader_chapters():
    """The chapter notebooks as parameters: those of GRADED_IN_TEST for `make test`, the others
    marked `release`."""
    return [pytest.param(p, id=p.stem, marks=() if p.stem in GRADED_IN_TEST else pytest.mark.release)
            for p in NOTEBOOKS]


@pytest.fixture(scope="module")
def graded(request, tmp_path_factory):
    """The chapters this run's tests ask for (GRADED_IN_TEST when none names one) through
    nbgrader, two at a time, each in a course of its own: {chapter: grade_chapter's result}."""
    wanted = {item.callspec.params["path"].stem for item in request.session.items
              if "graded" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")
              and "path" in item.callspec.params} or set(GRADED_IN_TEST)

    def run(path):
        with timed("nbgrader: release, autograde five submissions, feedback", path.stem):
            course = tmp_path_factory.mktemp(f"nbgrader-{path.stem}")
            classroom.write_assignments(course)
            return path.stem, grade_chapter(course, path.stem)

    chosen = [p for p in NOTEBOOKS if p.stem in wanted]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(pool.map(run, chosen))


@pytest.mark.book
@pytest.mark.parametrize("path", nbgrader_chapters())
def test_nbgrader_grades_reference_full_and_blank_below(graded, student, path):
    scores = graded[path.stem]["scores"]
    got, full, by_hand = scores["reference"]
    assert full >= 1 and got == full, f"reference solution: {got} of {full}"
    got, full, _ = scores["blank"]
    assert got < full, f"blank notebook: {got} of {full}"
    # nbgrader's release and `make student` give students the same code cells to fill in, and
    # every answer graded by hand is a stub in the release.
    release = graded[path.stem]["release"]
    answers = [c for c in release.cells if c.metadata.get("nbgrader", {}).get("solution")]
    manual = [c for c in answers if c.metadata["nbgrader"]["grade"]]
    assert by_hand == sum(c.metadata["nbgrader"]["points"] for c in manual)
    if path.stem in GRADED_IN_TEST:  # `make test`'s chapter shows the cells graded by hand
        assert by_hand > 0, f"{path.stem} has no exercise graded by hand"
    for cell in manual:
        assert cell.source in (classroom.STUB_BODY, "YOUR ANSWER HERE"), cell.source
    released = [c.source for c in answers if not c.metadata["nbgrader"]["grade"]]
    stubs = [c.source for c in student[path.stem].cells if structure.STUB in structure.tags(c)]
    assert released == stubs


# ---------------------------------------------------------------------------------------------
# Colab: a notebook alone in an empty folder


BLOCK_MYST_NB = 'raise ImportError("myst_nb is not installed here, as in Colab")\n'


# The notebooks run alone on another numerical path than the build's: MKL's vendor-neutral
# compatible code path (which MKL takes on Intel and AMD CPUs alike; README, "Numbers on every
# CPU") and PyTorch's vector kernels without AVX. A printed or glued number that depends on
# the CPU differs between the two runs, so the comparison below catches it on any machine.
OTHER_NUMERICAL_PATH = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}

# Appended to a notebook run alone: what its cells glued without showing (the setup cell's
# stand-in for myst_nb keeps it), as IPython's plain text, the form myst-nb's glue records.
GLUED_MARK = "glued values: "
REPORT_GLUED = f"""import json, sys
from IPython import get_ipython
print({GLUED_MARK!r} + json.dumps({{name: get_ipython().display_formatter.format(value)[0]["text/plain"]
                                 for name, value in sys.modules["myst_nb"].glued.items()}}))"""


def run_alone(path: pathlib.Path, folder: pathlib.Path):
    """Execute the notebook at `path` alone in `folder`, as Colab would, on
    OTHER_NUMERICAL_PATH; returns (the executed notebook, {name: glued value's plain text}).

    The kernel talks to this process over Unix sockets in a folder of its own, not over TCP:
    these runs overlap the build and nbgrader's grading (tests/conftest.py,
    `notebooks_alone`), whose kernels take TCP ports found free a moment before they bind them,
    and a kernel of ours started at that moment could take one first."""
    import tempfile

    from nbclient import NotebookClient
    from traitlets.config import Config

    shutil.copy(path, folder / path.name)
    blocker = folder.parent / f"{path.stem}-no-myst-nb"
    blocker.mkdir()
    (blocker / "myst_nb.py").write_text(BLOCK_MYST_NB)
    env = {**os.environ, "PYTHONPATH": str(blocker), **OTHER_NUMERICAL_PATH,
           "ATTENTION_PY_URL": (ROOT / "code" / "attention.py").as_uri()}
    env.pop(explorable.BOOK_HTML, None)  # as in Colab: explorable() shows the Altair chart
    notebook = read(folder / path.name)
    notebook.cells.append(nbformat.v4.new_code_cell(REPORT_GLUED))
    # A short folder: a Unix socket's path may not pass 107 bytes.
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        ipc = Config({"KernelManager": {"transport": "ipc",
                                        "connection_file": os.path.join(sockets, "kernel.json")}})
        client = NotebookClient(notebook, timeout=300, kernel_name="python3", config=ipc,
                                resources={"metadata": {"path": str(folder)}})
        transports = []  # the started kernel's, as its manager knows it
        client.on_notebook_start = lambda notebook: transports.append(client.km.transport)
        client.execute(env=env)  # raises CellExecutionError, with its traceback, on failure
    assert transports == ["ipc"], transports
    report = notebook.cells.pop()
    printed = "".join(o.get("text", "") for o in report.outputs)
    return notebook, json.loads(printed.split(GLUED_MARK, 1)[1])


def submit_alone_runs(pool: concurrent.futures.Executor, folder: pathlib.Path) -> dict:
    """Every chapter notebook run alone (run_alone) in `pool`, the most code first so that the
    last left are quick ones: {chapter: future of (notebook, glued, files left in its folder)}."""

    def run(path):
        work = folder / path.stem / "work"
        work.mkdir(parents=True)
        with timed("chapter executed alone, as in Colab", path.stem):
            notebook, glued = run_alone(path, work)
        return notebook, glued, sorted(p.name for p in work.iterdir())

    return {path.stem: pool.submit(run, path)
            for path in sorted(NOTEBOOKS, key=lambda path: build_book.code_size(path.with_suffix(".md")),
                               reverse=True)}


def wall_clock_glue(cells) -> re.Pattern:
    """The names glued by cells tagged wall-clock (timings, different on every run), as one
    pattern; an f-string's fields match anything."""
    names = [re.sub(r"\\\{[^}]*\\\}", ".*", re.escape(m.group(1)))
             for cell in cells if "wall-clock" in cell.metadata.get("tags", [])
             for m in re.finditer(r'glue\(\s*f?"([^"]+)"', cell.source)]
    return re.compile("|".join(f"(?:{n})" for n in names) or "(?!)")


def comparable(outputs) -> list:
    """A cell's outputs as a reader sees them: consecutive prints joined, glue records (which
    only myst_nb writes) and execution counts left out, an error by its name and message.

    nbconvert's CoalesceStreamsPreprocessor (which _ext/notebooks.py uses) joins the prints
    too, but it would keep the repeated tails described below, so the joining is done here."""
    seen = []
    run: list[str] = []  # the texts of the stream messages since the last other output

    def close_run():
        # When a cell's prints reach the build in several messages, myst-nb's coalesce_streams
        # (myst_nb/core/utils.py) appends every later message to the first *in place*, each
        # rstripped and ended with "\n", and leaves the later ones in the list it writes to
        # jupyter_execute: the first already holds the rest, which follow it again, and a
        # print that began a line gets a blank line before it. How many messages a cell's
        # prints take depends on timing, so blank lines are left out, and messages that only
        # repeat what the first one ends with are skipped, on both sides.
        if not run:
            return
        joined = run[0]
        if not joined.endswith("".join(run[1:])):  # not the first holding all the others
            for text in run[1:]:
                if not joined.endswith(text):  # a message that repeats the tail is skipped
                    joined += text
        seen[-1] = seen[-1][:2] + (joined,)
        run.clear()

    for output in outputs:
        kind = output["output_type"]
        if kind == "stream":
            text = re.sub(r"\n{2,}", "\n", output["text"])
            if run and seen[-1][1] == output["name"]:
                run.append(text)
            else:
                close_run()
                seen.append(("stream", output["name"], text))
                run.append(text)
            continue
        close_run()
        if kind == "error":
            seen.append(("error", output["ename"], output["evalue"]))
        elif (spec := explorable_spec(output.get("data", {}).get("text/html", ""))) is not None:
            seen.append(("explorable figure", spec))
        else:
            data = {mime: value for mime, value in output.get("data", {}).items()
                    if not mime.startswith("application/papermill.record/")}
            if data:
                seen.append((kind, sorted(data.items())))
    close_run()
    return seen



def test_prints_compare_however_many_messages_they_took():
    """The same prints, as the kernel sent them in one, two or three messages, and as myst-nb
    writes two or three messages to jupyter_execute (the first holding all, the others left
    as they were or holding their own tails too)."""
    a, b, c = "first line\n", "second\n", "third\n"

    def out(*texts):
        return [{"output_type": "stream", "name": "stdout", "text": t} for t in texts]

    want = comparable(out(a + b + c))
    for shape in (out(a, b + c), out(a, b, c), out(a + b, c), out(a + b + c, b + c),
                  out(a + b + c, b, c), out(a + b + c, b + c, c), out(a + "\n" + b + c)):
        assert comparable(shape) == want, shape
    assert comparable(out(a, a)) == comparable(out(a))  # myst-nb's repeat of a tail
    assert comparable(out(a) + [{"output_type": "error", "ename": "E", "evalue": "v"}]
                      + out(b)) == [("stream", "stdout", a), ("error", "E", "v"),
                                    ("stream", "stdout", b)]

# A number in an SVG (a coordinate, a length) and what a figure may move between two numerical
# paths: a hundredth of a point, 1/7200 inch, which no reader sees. The data behind a figure
# differ in their last bits between paths; the SVG's text, every label and the count of its
# numbers must not differ at all.
SVG_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
SVG_POINTS = 0.01
# Matplotlib names clip paths and markers by a hash of what they hold ("p6fdc3a...", "m0b2e..."),
# so a coordinate a hundredth of a point away renames them: compared as names, not numbers.
SVG_HASH_ID = re.compile(r"\b[pm][0-9a-f]{8,}\b")


def same_outputs(mine: list, theirs: list) -> bool:
    """Whether two cells' comparable() outputs show a reader the same thing: equal, except
    that SVG figures may differ in their numbers by up to SVG_POINTS."""
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs):
        if a == b:
            continue
        svgs = [dict(x[1]).get("image/svg+xml") if x[0] in ("display_data", "execute_result")
                else None for x in (a, b)]
        if None in svgs or a[0] != b[0]:
            return False
        texts = [SVG_HASH_ID.sub("ID", "".join(svg) if isinstance(svg, list) else svg)
                 for svg in svgs]
        if SVG_NUMBER.split(texts[0]) != SVG_NUMBER.split(texts[1]):
            return False  # another label, element or attribute
        numbers = [[float(n) for n in SVG_NUMBER.findall(t)] for t in texts]
        if len(numbers[0]) != len(numbers[1]) or any(
                abs(x - y) > SVG_POINTS for x, y in zip(*numbers)):
            return False
        rest = [{k: v for k, v in x[1] if k != "image/svg+xml"} for x in (a, b)]
        if rest[0] != rest[1]:
            return False
    return True


GLUE_TEXT = re.compile(r"\{glue:text\}`([^`]+)`")


def quoted_glue(md: str) -> tuple[dict[str, set[str]], str]:
    """{key: the formats its {glue:text} roles give it} in a chapter's MyST source, and the
    source without them (where any other use of a glued key is looked for)."""
    formats: dict[str, set[str]] = {}
    for spec in GLUE_TEXT.findall(md):
        key, _, fmt = spec.rpartition(":") if ":" in spec else (spec, "", "")
        formats.setdefault(key, set()).add(fmt or "s")
    return formats, GLUE_TEXT.sub("", md)


BOOK_FIGURE = re.compile(r'<script type="application/json" class="explorable-spec">(.*?)</script>',
                         re.S)
# Altair's own HTML output (its "default" renderer, pinned altair): the spec is the first
# argument of the function that embeds the chart.
ALTAIR_FIGURE = re.compile(r'^  \}\)\((\{.*\}), \{"mode": "vega-lite"\}\);$', re.M)


def explorable_spec(html: str) -> dict | None:
    """The Vega-Lite spec of an explorable figure's output: in the book's build, the block that
    code/explorable.py writes; run alone, the Altair chart Jupyter shows. The two routes show
    one figure when their specs are equal."""
    if match := BOOK_FIGURE.search(html) or ALTAIR_FIGURE.search(html):
        return json.loads(match.group(1))
    return None


@pytest.mark.book
# the browser visits start here: the last notebooks alone keep only one core busy
@pytest.mark.usefixtures("site_visits_started")
def test_every_notebook_runs_alone_as_in_colab_and_prints_what_the_book_shows(build, notebooks_alone):
    """Each committed notebook, alone in an empty folder without myst_nb, fetches attention.py
    and prints, cell for cell, what the book's build printed (cells tagged wall-clock time
    themselves and are left out). This is also the determinism check: two executions of every
    chapter, by two routes, agree."""
    from myst_nb.core.variables import format_plain_text

    _, _, out = build
    results = notebooks_alone.results()
    differ = []
    for name, (notebook, glued, files) in results.items():
        assert "attention.py" in files, f"{name}: attention.py was not fetched"
        book = read(out / "jupyter_execute" / "chapters" / f"{name}.ipynb")
        alone = [c for c in notebook.cells if c.cell_type == "code"]
        built = [c for c in book.cells if c.cell_type == "code"]
        assert [c.source for c in alone] == [c.source for c in built], name
        for index, (mine, theirs) in enumerate(zip(alone, built)):
            if "wall-clock" in theirs.metadata.get("tags", []):
                continue
            if not same_outputs(comparable(mine.outputs), comparable(theirs.outputs)):
                differ.append(f"{name}, code cell {index}: {theirs.source[:60]!r}")
        # Every number the text quotes: the values the build glued, which the notebook run
        # alone must glue with the same digits as the text prints them, in each format the text
        # gives them; a value glued for another use (a formula) must be the same.
        book_glue = json.loads((out / "jupyter_execute" / "chapters" / f"{name}.glue.json")
                               .read_text())
        formats, rest = quoted_glue((ROOT / "chapters" / f"{name}.md").read_text())
        timing = wall_clock_glue(built)
        for key, record in book_glue.items():
            built_text = record["data"].get("text/plain")
            if timing.fullmatch(key) or built_text is None:
                continue
            if key not in glued:
                differ.append(f"{name}, glued {key!r}: the notebook alone glued no such value")
            for fmt in formats.get(key, ()):
                shown = [format_plain_text(text, fmt) for text in (built_text, glued[key])]
                if shown[0] != shown[1]:
                    differ.append(f"{name}, glued {key!r} as {fmt!r}: the build prints "
                                  f"{shown[0]!r}, alone {shown[1]!r}")
            if key not in formats and key in rest and glued[key] != built_text:
                differ.append(f"{name}, glued {key!r}: the build {built_text!r}, alone "
                              f"{glued[key]!r}")
    assert not differ, ("outputs differ between the build and the notebook run alone on "
                        f"another numerical path ({OTHER_NUMERICAL_PATH}):\n" + "\n".join(differ))


@pytest.mark.book
def test_setup_cell_says_what_to_do_when_the_fetch_fails(tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    setup = read(NOTEBOOKS[0]).cells[1]
    assert structure.is_setup(setup)
    folder = tmp_path / "alone"
    folder.mkdir()
    notebook = nbformat.v4.new_notebook(cells=[setup])
    missing = (tmp_path / "nowhere" / "attention.py").as_uri()
    client = NotebookClient(notebook, timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    with pytest.raises(CellExecutionError) as info:
        client.execute(env={**os.environ, "PYTHONPATH": "", "ATTENTION_PY_URL": missing})
    message = str(info.value)
    assert f"could not fetch {missing}" in message
    assert "Upload code/attention.py next to this notebook" in message


# ---------------------------------------------------------------------------------------------
# Derived files come from current sources


def test_committed_notebooks_are_not_older_than_their_sources():
    assert classroom.stale_notebooks() == [], "run `make notebooks` and commit the notebooks"


def test_student_and_assignments_refuse_a_stale_notebook(tmp_path, monkeypatch):
    copy = tmp_path / "book"
    (copy / "code").mkdir(parents=True)
    shutil.copytree(ROOT / "chapters", copy / "chapters")
    for name in classroom.CODE_FILES:
        shutil.copy(ROOT / "code" / name, copy / "code" / name)
    monkeypatch.setattr(classroom, "ROOT", copy)
    monkeypatch.setattr(classroom, "CHAPTERS", copy / "chapters")
    assert classroom.stale_notebooks() == []
    changed = MD[2].name
    with open(copy / "chapters" / changed, "a") as f:
        f.write("\nA sentence added after the last build.\n")
    assert classroom.stale_notebooks() == [MD[2].with_suffix(".ipynb").name]
    for write in (classroom.write_student, classroom.write_assignments):
        with pytest.raises(SystemExit, match=r"older than their chapter.*make notebooks"):
            write(tmp_path / write.__name__)
    for name in classroom.CODE_FILES:  # either file of the book's code makes every one stale
        original = (copy / "code" / name).read_text()
        (copy / "code" / name).write_text("# changed\n")
        assert len(classroom.stale_notebooks()) == len(NOTEBOOKS), name
        (copy / "code" / name).write_text(original)


@pytest.mark.book
@pytest.mark.parametrize("path", nbgrader_chapters())
def test_nbgrader_gives_part_for_a_mistake_and_nothing_for_a_forbidden_call(graded, path):
    """nbgrader's own autograde, on submissions made of the wrong-answer catalogue: each check's
    points are what the in-process grading gives (part for a common mistake, nothing for a
    forbidden call), and the totals fall between the blank and the reference."""
    run = graded[path.stem]
    if path.stem in GRADED_IN_TEST:  # `make test`'s chapter shows both
        assert run["expected"]["part"] and run["expected"]["nothing"], run["expected"]
    by_check, full = run["by_check"], run["scores"]["reference"][1]
    for earns, expected in run["expected"].items():
        for check, points in expected.items():
            assert by_check[earns][check] == points, (earns, check, by_check[earns], points)
    part = run["scores"]["part"][0]
    if run["expected"]["part"]:
        assert run["scores"]["blank"][0] < part < full, (part, full)
    if run["expected"]["nothing"]:
        assert run["scores"]["nothing"][0] < full


@pytest.mark.book
@pytest.mark.parametrize("path", nbgrader_chapters())
def test_nbgrader_a_check_redefined_in_an_answer_grades_nothing(graded, path):
    """Each graded cell imports its check itself: a submission whose answer cells redefine
    every check to pass everything, its answers left unwritten, earns no automatic point."""
    run = graded[path.stem]
    assert run["scores"]["redefines"][0] == 0, run["scores"]["redefines"]
    assert set(run["by_check"]["redefines"].values()) == {0.0}, run["by_check"]["redefines"]


@pytest.mark.book
def test_autograde_summary_and_grades_csv(graded):
    one = graded[min(graded)]
    got, full, _ = one["scores"]["reference"]
    assert f"reference: {got:g} of {full:g} points" in one["summary"]
    course = one["course"]
    make("grades", course)
    rows = (course / "grades.csv").read_text().splitlines()
    assert rows[0].startswith("assignment,") and len(rows) == 6, rows


@pytest.mark.book
def test_feedback_renders_math_offline(graded):
    """Feedback pages load the course's MathJax: typeset, no errors, no request leaves."""
    import site_browser

    def visit(page, url, path, external):
        ran = site_browser.open_page(page, url)
        return (ran, page.locator("mjx-container").count(),
                page.locator("mjx-merror").count(), list(external))

    for name, run in graded.items():
        page = f"feedback/reference/{name}/{name}.html"
        ran, typeset, errors, external = site_browser.visit_pages(
            run["course"], [page], visit, workers=1)[page]
        assert ran and typeset > 0 and errors == 0 and not external, (
            name, ran, typeset, errors, external)


def test_assignments_again_keeps_grading_work(tmp_path):
    """`make assignments` on an existing course rewrites source/ and touches nothing else."""
    classroom.write_assignments(tmp_path)
    name = NOTEBOOKS[0].stem
    work = {"gradebook.db": "grades", f"submitted/s1/{name}/{name}.ipynb": "answer",
            f"autograded/s1/{name}/{name}.ipynb": "graded", f"feedback/s1/{name}/x.html": "fb",
            f"release/{name}/{name}.ipynb": "released", "course_config.py": "# mine"}
    for rel, text in work.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "source" / name / f"{name}.ipynb").write_text("old")
    out = make("assignments", tmp_path)
    for rel, text in work.items():
        assert (tmp_path / rel).read_text() == text, rel
    assert read(tmp_path / "source" / name / f"{name}.ipynb").cells, "source/ was not rewritten"
    assert "kept as they were: gradebook.db" in out
    assert len(out.splitlines()) == len(NOTEBOOKS) + 1, out


def test_course_commands_explain_a_missing_assignment(tmp_path):
    with pytest.raises(SystemExit, match="not a course folder"):
        classroom.course_command(tmp_path, "release", "01-intuition")
    classroom.write_course_support(tmp_path)
    with pytest.raises(SystemExit, match="make autograde A="):
        classroom.course_command(tmp_path, "autograde", None)


def test_instructors_table_lists_every_exercise_with_its_points():
    """The exercise table of chapters/instructors.md: one row per exercise, in book order, with
    its title, how it is graded and the points `make assignments` gives it."""
    rows = re.findall(r"^\| (\d+\.\d+) \| (.+?) \| (\w+), (auto|by hand) \| (\d+) \| (\d+) \| "
                      r"(?:core|deeper) \|",
                      (ROOT / "chapters" / "instructors.md").read_text(), re.M)
    expected = []
    for path in NOTEBOOKS:
        chapter = read(path)
        sheet = classroom.nbgrader_source(classroom.exercise_sheet(chapter))
        points = {number: sum(meta["points"] for meta in cells)
                  for number, cells in classroom.graded_by_exercise(sheet).items()}
        for ex in structure.exercises(chapter):
            expected.append((ex.number, ex.title, "auto" if ex.coding else "by hand",
                             str(points[ex.number])))
    assert [(n, t, g, p) for n, t, _, g, p, _ in rows] == expected
    for number, _, kind, graded, _, minutes in rows:
        assert (kind == "code") == (graded == "auto"), number
        assert 5 <= int(minutes) <= 60, number


def test_course_plan_merges_chapters_leaves_out_and_sets_points(tmp_path):
    """course.yml: one assignment of two chapters, an exercise left out, points set; nbgrader
    accepts the result."""
    (tmp_path / "course.yml").write_text(
        "assignments:\n"
        "  week-1:\n"
        "    chapters: [01-intuition, 02-queries-keys-values]\n"
        "    leave_out: ['1.2']\n"
        "    points: {'1.1': 3, '2.3': 10}\n")
    written = classroom.write_assignments(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "source/week-1/week-1.ipynb"]
    notebook = read(written[0])
    numbers = [ex.number for ex in structure.exercises(notebook)]
    assert numbers == ["1.1", "1.3", "1.4", "2.1", "2.2", "2.3", "2.4"]
    points = {number: sum(meta["points"] for meta in cells)
              for number, cells in classroom.graded_by_exercise(notebook).items()}
    assert points["1.1"] == 3 and points["2.3"] == 10 and "1.2" not in points
    assert points["1.3"] == classroom.WRITTEN_POINTS
    assert sum(map(structure.is_setup, notebook.cells)) == 1
    assert (tmp_path / "course.example.yml").is_file()
    assert (tmp_path / "answer-key" / "01-intuition.md").is_file()
    classroom.nbgrader(tmp_path, "generate_assignment", "week-1", "--force")
    assert (tmp_path / "release" / "week-1" / "week-1.ipynb").is_file()


@pytest.mark.parametrize("plan, message", [
    ("assignments:\n  a:\n    chapters: [99-nothing]\n", "unknown: 99-nothing"),
    ("assignments:\n  a:\n    chapters: [01-intuition]\n    leave_out: ['2.1']\n",
     "no exercise 2.1"),
    ("assignments:\n  a:\n    chapters: [01-intuition]\n    points: {'1.4': 1}\n",
     "at least 6 points"),
    ("assignments:\n  a:\n    chapter: [01-intuition]\n", "unknown keys"),
])
def test_course_plan_says_what_is_wrong(tmp_path, plan, message):
    (tmp_path / "course.yml").write_text(plan)
    with pytest.raises(SystemExit, match=message):
        classroom.write_assignments(tmp_path)


def test_student_folder_runs_offline(student, tmp_path):
    """`make student`'s folder holds the book's code beside the notebooks, and the models and
    text it reads: a notebook's setup cell, its check import and the loading of every kind of
    shipped file run there with every fetch bound to fail."""
    import nbformat
    from nbclient import NotebookClient

    folder = tmp_path / "student"
    classroom.write_student(folder)
    for name in classroom.CODE_FILES:
        assert (folder / name).read_text() == (ROOT / "code" / name).read_text()
    path = folder / NOTEBOOKS[0].name
    notebook = read(path)
    check_import = next(c for c in notebook.cells if structure.CHECK in structure.tags(c))
    setup = next(c for c in notebook.cells if structure.is_setup(c))
    shipped = nbformat.v4.new_code_cell(  # what chapters 9, 12 and 13 read from models/, data/
        "import induction, lm\n"
        "assert lm.load_run('shakespeare').config.context == 64 and len(lm.load_text()) > 10**5\n"
        "induction.load_run('two-layer-seed0')")
    notebook.cells = [notebook.cells[0], setup, check_import, shipped]
    nowhere = (tmp_path / "nowhere" / "attention.py").as_uri()
    NotebookClient(notebook, timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute(
        env={**os.environ, "PYTHONPATH": "", "ATTENTION_PY_URL": nowhere})
    assert sorted(p.name for p in folder.glob("*.py")) == sorted(classroom.CODE_FILES)


def test_the_one_week_plan_leaves_out_the_deeper_exercises_and_nothing_else(tmp_path):
    """The one-week plan of chapters/instructors.md is a course.yml that `make assignments`
    accepts, and it leaves out exactly the deeper exercises of its chapters (the path column of
    the exercise table)."""
    import yaml

    text = (ROOT / "chapters" / "instructors.md").read_text()
    block = re.search(r"\*\*One week.*?```yaml\n(.*?)```", text, re.S).group(1)
    plan = yaml.safe_load(block)
    path = dict(re.findall(r"^\| (\d+\.\d+) \| .+? \| \w+, (?:auto|by hand) \| \d+ \| \d+ \| "
                           r"(core|deeper) \|", text, re.M))
    chapters = [name for a in plan["assignments"].values() for name in a["chapters"]]
    numbers = {str(int(name[:2])) for name in chapters}
    left_out = {n for a in plan["assignments"].values() for n in a.get("leave_out", [])}
    deeper = {n for n, p in path.items() if p == "deeper" and n.split(".")[0] in numbers}
    assert left_out == deeper
    (tmp_path / classroom.COURSE_PLAN).write_text(block)
    accepted = classroom.course_plan(tmp_path, [p.stem for p in classroom.numbered_chapters()])
    assert list(accepted) == list(plan["assignments"])


def test_the_term_plan_names_every_deeper_exercise_graded_by_hand():
    """The one-term plan of chapters/instructors.md lists the deeper exercises graded by hand,
    kind by kind; the list is the table's, neither shorter nor longer."""
    text = (ROOT / "chapters" / "instructors.md").read_text()
    rows = re.findall(r"^\| (\d+\.\d+) \| .+? \| (\w+), by hand \| \d+ \| \d+ \| deeper \|",
                      text, re.M)
    plan = re.search(r"\*\*One term.*?\n\n", text, re.S).group(0)
    named = {}
    for match in re.finditer(r"the\s+(proof|derivation|computation|experiment)s?\s+"
                             r"\(?((?:\d+\.\d+(?:, )?)+)\)?", plan):
        named[match.group(1)] = match.group(2).split(", ")
    expected = {}
    for number, kind in rows:
        expected.setdefault(kind, []).append(number)
    assert named == expected
