"""Classroom material made from the chapters: student notebooks (`make student`) and an
nbgrader course (`make assignments`).

The chapter notebooks in chapters/*.ipynb are the starting point; they are written by the book
build (see _ext/notebooks.py) and kept in sync with the MyST sources by tests/test_book.py.
Where their setup cell, exercises, checks and solutions are, and how a solution becomes a stub,
comes from tools/chapter_structure.py.
"""

from __future__ import annotations

import copy
import pathlib
import re

import yaml

import chapter_structure as structure
from chapter_structure import CODE_FILES, STUB_BODY, repository  # noqa: F401  (used by the tests)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
SHIPPED_FOLDERS = ("models", "data")  # beside code/: what code/stored.py reads


def numbered_chapters() -> list[pathlib.Path]:
    """The chapter sources, chapters/NN-name.md, in book order."""
    return sorted(CHAPTERS.glob("[0-9][0-9]-*.md"))


# ---------------------------------------------------------------------------------------------
# Student notebooks and the nbgrader course


def chapter_notebooks() -> list[pathlib.Path]:
    """The committed chapter notebooks, in book order (written by `make notebooks`)."""
    return sorted(CHAPTERS.glob("[0-9][0-9]-*.ipynb"))


def stale_notebooks() -> list[str]:
    """Committed notebooks older than what they were made from (their chapter's source or a
    file of code/), or with no chapter source at all; [] when all are fresh."""
    import hashlib
    import json

    stale = [f"{md.stem}.ipynb (missing)" for md in numbered_chapters()
             if not md.with_suffix(".ipynb").is_file()]
    for path in chapter_notebooks():
        made_from = json.loads(path.read_text()).get("metadata", {}).get("made_from", {})
        sources = {name: ROOT / name for name in made_from}
        needed = {f"chapters/{path.stem}.md", *(f"code/{name}" for name in CODE_FILES)}
        if (needed - set(made_from)
                or any(not file.is_file()
                       or hashlib.sha256(file.read_bytes()).hexdigest() != made_from[name]
                       for name, file in sources.items())):
            stale.append(path.name)
    return stale


def fresh_chapter_notebooks() -> list[pathlib.Path]:
    """chapter_notebooks(), after making sure none is stale; SystemExit naming them if so."""
    stale = stale_notebooks()
    if stale:
        raise SystemExit("These chapter notebooks are older than their chapter or "
                         f"the book's code: {', '.join(stale)}. Run `make notebooks` first "
                         "(it rebuilds the book and writes them), then try again.")
    return chapter_notebooks()


STUDENT_NOTE = """\
**Student version.** The solutions are removed. Where an exercise asks for code you will find a
cell with the function's signature and `raise NotImplementedError()`: replace that line with your
code and run the check cell below it. The check runs your function on several cases and tells you
what is wrong, or prints that all cases pass. Run the cells from the top: the first code cell
makes the book's module `attention.py` importable."""


def student_notebook(notebook):
    """Solutions out, stubs (tagged stub) in, each followed by the call of its check (tagged
    check-call); a note on how to use it after the title."""
    import nbformat

    cells = []
    for cell in notebook.cells:
        if not structure.is_solution(cell):
            cells.append(cell)
            if len(cells) == 1:
                cells.append(nbformat.v4.new_markdown_cell(STUDENT_NOTE))
            continue
        stub = structure.stub_code(cell.source) if cell.cell_type == "code" else None
        if stub:
            for source, tag in zip(stub, (structure.STUB, structure.CHECK_CALL)):
                cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": [tag]}))
    return _renumbered(nbformat.v4.new_notebook(cells=cells,
                                                metadata=copy.deepcopy(notebook.metadata)))


def _renumbered(notebook):
    """Cell ids by position, so that a rerun writes the same bytes."""
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index}"
    return notebook


def write_student(out: pathlib.Path) -> list[pathlib.Path]:
    """Student notebooks in out/, with the book's code beside them and the files it reads
    (models/ and data/, as beside code/ in the repository), so that they run offline."""
    import shutil

    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in fresh_chapter_notebooks():
        nbformat.write(student_notebook(nbformat.read(path, as_version=4)), out / path.name)
        written.append(out / path.name)
    for name in CODE_FILES:
        shutil.copy(ROOT / "code" / name, out / name)
    for folder in SHIPPED_FOLDERS:
        shutil.rmtree(out / folder, ignore_errors=True)
        shutil.copytree(ROOT / folder, out / folder)
    return written


NBGRADER_CONFIG = """\
# nbgrader configuration of the course, written by `make assignments` (tools/classroom.py)
# each time it runs. Put settings of your own in course_config.py beside this file: it is read
# last and never overwritten.
import os
import sys

import nbgrader

c = get_config()  # noqa: F821 (nbgrader provides it)
here = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "attention-computed"
# A student finds exactly the stub that the book's student notebooks have.
c.ClearSolutions.code_stub = {"python": @STUB@}
# Chapters train small models and run simulations: give each cell time.
c.Execute.timeout = 120
# Feedback pages load the course's own MathJax (mathjax/), not a CDN, so math renders offline:
# the template feedback_offline is nbgrader's feedback template with another mathjax() macro.
c.HTMLExporter.template_name = "@TEMPLATE@"
# Grading the answers cannot reach (grading/isolated_grading.py): the test cells are set aside
# while nbgrader runs the notebook, then the answers run in a process of their own and the checks
# in another, and each test cell's output is what they found.
sys.path.insert(0, os.path.join(here, "grading"))
from isolated_grading import GradeIsolated, HideTests  # noqa: E402
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import (  # noqa: E402
    AssignLatePenalties, CheckCellMetadata, Execute, IgnorePattern, LimitOutput, SaveAutoGrades)

c.Autograde.autograde_preprocessors = [
    HideTests, Execute, GradeIsolated, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
    SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
c.HTMLExporter.extra_template_basedirs = [
    os.path.join(here, "templates"),
    os.path.join(os.path.dirname(nbgrader.__file__), "server_extensions", "formgrader",
                 "templates")]
if os.path.exists(os.path.join(here, "course_config.py")):
    load_subconfig(os.path.join(here, "course_config.py"))  # noqa: F821
"""

# nbconvert's templates import the macro `mathjax` from mathjax.html.j2; a template folder that
# holds its own mathjax.html.j2 and names nbgrader's feedback template as its base replaces
# just that macro. Feedback pages sit at feedback/<student>/<assignment>/, three levels below
# the course folder, where mathjax/ is.
FEEDBACK_TEMPLATE = "feedback_offline"
FEEDBACK_MATHJAX = """\
{#- Written by tools/classroom.py: the course's copy of MathJax 3 instead of a CDN. -#}
{%- macro mathjax(url=None) -%}
<script>
window.MathJax = {tex: {inlineMath: [["$", "$"], ["\\\\(", "\\\\)"]],
                        displayMath: [["$$", "$$"], ["\\\\[", "\\\\]"]],
                        processEscapes: true, processEnvironments: true}};
</script>
<script src="../../../mathjax/tex-mml-chtml.js"></script>
{%- endmacro -%}
"""


def write_course_support(out: pathlib.Path) -> None:
    """nbgrader_config.py, the offline feedback template and the MathJax it loads."""
    import json
    import shutil
    import sys

    extensions = pathlib.Path(__file__).resolve().parents[1] / "_ext"  # this book's, not ROOT's
    if str(extensions) not in sys.path:
        sys.path.insert(0, str(extensions))
    import offline_mathjax

    config = (NBGRADER_CONFIG.replace("@STUB@", json.dumps(STUB_BODY))
              .replace("@TEMPLATE@", FEEDBACK_TEMPLATE))
    (out / "nbgrader_config.py").write_text(config)
    template = out / "templates" / FEEDBACK_TEMPLATE
    template.mkdir(parents=True, exist_ok=True)
    (template / "conf.json").write_text(json.dumps(
        {"base_template": "feedback", "mimetypes": {"text/html": True}}, indent=2) + "\n")
    (template / "mathjax.html.j2").write_text(FEEDBACK_MATHJAX)
    (out / "grading").mkdir(exist_ok=True)
    shutil.copyfile(pathlib.Path(__file__).with_name("isolated_grading.py"),
                    out / "grading" / "isolated_grading.py")
    for name in offline_mathjax.files_to_copy():
        target = out / "mathjax" / name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(offline_mathjax.SOURCE / name, target)


def _meta(kind: str, grade_id: str, points: int = 0) -> dict:
    meta = {"schema_version": 3, "grade_id": grade_id, "locked": False,
            "grade": False, "solution": False, "task": False}
    if kind == "answer":
        meta["solution"] = True
    elif kind == "manual":
        meta.update(solution=True, grade=True, points=points)
    elif kind == "test":
        meta.update(grade=True, locked=True, points=points)
    elif kind == "locked":
        meta["locked"] = True
    return {"nbgrader": meta}


WRITTEN_POINTS = 2  # a derivation, proof or experiment graded by hand


def written_solution(exercise: structure.NotebookExercise) -> str:
    """The solution of an exercise as one piece of Markdown, code cells fenced."""
    parts = []
    for cell in exercise.solution:
        if cell.cell_type == "markdown":
            parts.append(structure.without_solution_heading(cell.source).strip())
        else:
            parts.append(f"```python\n{cell.source.strip()}\n```")
    return "\n\n".join(part for part in parts if part)


IMPORTS = "exercise-imports"  # the tag of a sheet's imports cell (locked in the course)


def exercise_sheet(notebook):
    """The chapter cut down to what its exercises and their grading need: the title, the setup
    cell, the chapter's imports (its first code cell after the setup), a pointer to the chapter,
    and the Exercises section. Autograding then runs no demonstration or training run."""
    import nbformat

    cells = notebook.cells
    start, offset, end = structure.exercise_section(notebook)
    first = copy.deepcopy(cells[start])
    first.source = first.source[offset:]
    setup = next(c for c in cells if structure.is_setup(c))
    imports = next(c for c in cells if c.cell_type == "code" and not structure.is_setup(c))
    title = cells[0].source.splitlines()[0].lstrip("# ").strip()
    pointer = nbformat.v4.new_markdown_cell(
        f"These are the exercises of the chapter *{title}*; read the chapter first, in the book "
        "or in its full notebook. The cell below imports what the exercises use.")
    imports = copy.deepcopy(imports)
    imports.metadata.setdefault("tags", []).append(IMPORTS)
    sheet = [copy.deepcopy(cells[0]), copy.deepcopy(setup), pointer, imports,
             first, *copy.deepcopy(cells[start + 1:end])]
    return nbformat.v4.new_notebook(cells=sheet, metadata=copy.deepcopy(notebook.metadata))


def nbgrader_source(notebook):
    """The chapter as an nbgrader source notebook.

    Each coding exercise becomes an autograded answer cell (the reference code inside
    ### BEGIN/END SOLUTION) and one locked test cell per case of its check, worth that case's
    points (graded_tests). Every other exercise gets a manually graded Markdown answer cell worth WRITTEN_POINTS
    right after its statement, whose source is the book's solution (the release replaces it with
    nbgrader's text stub), followed by an ungraded code cell where the solution computes. The setup
    cell and the cells that import the checks are locked: autograding puts them back if a
    student edits them.
    """
    import nbformat

    manual = {ex.index: ex for ex in structure.exercises(notebook) if not ex.coding}
    cells = []
    for index, cell in enumerate(notebook.cells):
        if not structure.is_solution(cell):
            new = copy.deepcopy(cell)
            if structure.CHECK in structure.tags(cell):
                new.metadata.update(_meta("locked", structure.imported_checks(cell.source)[0]))
            elif IMPORTS in structure.tags(cell):  # what the answers' process runs first
                new.metadata.update(_meta("locked", f"imports-{index}"))
            elif structure.is_setup(cell):
                new.metadata.update(_meta("locked", "setup"))
            cells.append(new)
            if index in manual:
                exercise = manual[index]
                answer = nbformat.v4.new_markdown_cell(written_solution(exercise))
                answer.metadata.update(
                    _meta("manual", "answer-" + exercise.number.replace(".", "-"),
                          WRITTEN_POINTS))
                cells.append(answer)
                if exercise.code:  # the book's solution computes: room for the student's
                    cells.append(nbformat.v4.new_code_cell(
                        f"# Your code for Exercise {exercise.number}, graded with your "
                        "answer above"))
            continue
        stub = structure.stub_code(cell.source) if cell.cell_type == "code" else None
        if not stub:
            continue
        names = "-".join(structure.function_names(cell.source))
        answer = nbformat.v4.new_code_cell(structure.solution_region_code(cell.source))
        answer.metadata.update(_meta("answer", names))
        cells.append(answer)
        for grade_id, source, worth in graded_tests(stub[1], names):
            test = nbformat.v4.new_code_cell(source)
            test.metadata.update(_meta("test", grade_id, worth))
            cells.append(test)
    return _renumbered(nbformat.v4.new_notebook(cells=cells,
                                                metadata=copy.deepcopy(notebook.metadata)))


def graded_tests(calls: str, names: str) -> list[tuple[str, str, int]]:
    """(grade id, source, points) of the test cells that grade an answer: one per case of a
    check of code/checks_<chapter>.py, worth that case's points: `from checks_x import check_x`
    then `check_x.grade("case", f)`. In the student's notebook the cell gives feedback; when
    nbgrader autogrades, isolated_grading.py sets it aside and grades the case in processes of
    its own."""
    import sys

    if str(ROOT / "code") not in sys.path:
        sys.path.insert(0, str(ROOT / "code"))
    import checking

    tests = []
    for line in calls.splitlines():
        match = re.fullmatch(r"(check_\w+)\((.*)\)", line.strip())
        try:
            check = checking.find_check(match.group(1)) if match else None
        except KeyError:
            check = None
        if not isinstance(check, checking.Check):
            raise ValueError(f"{line.strip()!r}: a solution calls a check that no "
                             "code/checks_*.py defines")
        module = check.module
        for number, (title, (_, worth, _)) in enumerate(check.cases.items(), 1):
            slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
            tests.append((f"test-{names}-{number}-{slug}",
                          f"from {module} import {match.group(1)}\n"
                          f"{match.group(1)}.grade({title!r}, {match.group(2)})", worth))
    return tests


def answer_key(notebook) -> str:
    """Every exercise of a chapter with the book's solution, as Markdown for the instructor."""
    title = notebook.cells[0].source.splitlines()[0].lstrip("# ")
    parts = [f"# Answer key: {title}"]
    for exercise in structure.exercises(notebook):
        parts += [exercise.statement.replace("#### ", "## ", 1),
                  "**Solution.**\n\n" + written_solution(exercise)]
    return "\n\n".join(parts) + "\n"


def assignment_note(notebook) -> str:
    """The note at the top of a released notebook: what is graded, for how much, and how."""
    graded = [c.metadata["nbgrader"] for c in notebook.cells
              if c.metadata.get("nbgrader", {}).get("grade")]
    auto = [g for g in graded if not g["solution"]]
    manual = [g for g in graded if g["solution"]]
    points = lambda cells: sum(g["points"] for g in cells)
    plural = lambda n, word: f"{n} {word}{'s' * (n != 1)}"
    # graded_tests writes each test cell as `from checks_y import check_x` + `check_x.grade(...)`
    checks = [c.source.partition(".grade(")[0].rpartition("\n")[2] for c in notebook.cells
              if c.metadata.get("nbgrader", {}).get("grade")
              and not c.metadata["nbgrader"]["solution"]]
    functions = ", ".join(f"`{name}`" for name in dict.fromkeys(checks))
    return (
        f"**Assignment: {plural(points(graded), 'point')}.** "
        f"{plural(points(auto), 'point')} graded automatically, one test per case of the "
        f"checks ({functions}), and "
        f"{plural(points(manual), 'point')} by your instructor, "
        f"{plural(len(manual), 'written or computed answer')} worth {WRITTEN_POINTS} each. "
        "Where an exercise asks for a function you will find its signature and "
        "`raise NotImplementedError()`: replace that line with your code, keep the function's "
        "name and arguments, and run the check cell below it, which tells you what is wrong or "
        "that every case passes (feedback only: your grade comes from grading your answer "
        "cells again, apart from this notebook). Every other exercise has an answer cell right "
        "below its statement (`YOUR ANSWER HERE`): write your derivation, proof or "
        "conclusion there, with your code in the cell below it where the exercise computes. "
        "Do not edit the locked cells (the first one, which makes the book's code importable, "
        "the one that imports what the exercises use, and the cells that import the checks): "
        "grading restores them. When you are done, restart the kernel, run every cell from "
        "the top, save, and hand in this folder the way your course says (nbgrader's "
        "Assignments tab, or an upload).")


COURSE_PLAN = "course.yml"
COURSE_PLAN_EXAMPLE = """\
# The plan of a course, read by `make assignments` from course.yml beside this file (copy this
# one to start). Without course.yml every chapter is an assignment of its own, with every
# exercise at the book's points. An assignment names its chapters, merged into one notebook in
# this order; it may leave exercises out and set an exercise's points. For an autograded
# exercise the points are shared out over the cases of its check.
assignments:
  week-1:
    chapters: [01-intuition, 02-queries-keys-values]
    leave_out: ["1.2", "2.2"]
    points: {"1.1": 3, "2.3": 10}
  week-2:
    chapters: [03-scaling]
"""


def course_plan(course: pathlib.Path, chapters: list[str]) -> dict[str, dict]:
    """{assignment: {"chapters": [...], "leave_out": [...], "points": {...}}} from the course's
    course.yml, or one assignment per chapter without one. SystemExit naming what is wrong."""
    path = course / COURSE_PLAN
    if not path.is_file():
        return {name: {"chapters": [name], "leave_out": [], "points": {}} for name in chapters}
    plan = yaml.safe_load(path.read_text()) or {}
    assignments = plan.get("assignments")
    if not isinstance(assignments, dict) or not assignments:
        raise SystemExit(f"{path}: expected `assignments:` with at least one assignment")
    result = {}
    for name, spec in assignments.items():
        spec = spec or {}
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)):
            raise SystemExit(f"{path}: {name!r}: an assignment's name may hold letters, digits, "
                             "- and _ only")
        unknown = set(spec) - {"chapters", "leave_out", "points"}
        if unknown:
            raise SystemExit(f"{path}: {name}: unknown keys {sorted(unknown)}; use chapters, "
                             "leave_out, points")
        names = [str(c) for c in spec.get("chapters") or []]
        missing = [c for c in names if c not in chapters]
        if not names or missing:
            raise SystemExit(f"{path}: {name}: chapters must name some of {', '.join(chapters)}"
                             + (f"; unknown: {', '.join(missing)}" if missing else ""))
        result[str(name)] = {"chapters": names,
                             "leave_out": [str(n) for n in spec.get("leave_out") or []],
                             "points": {str(k): int(v) for k, v in (spec.get("points") or {}).items()}}
    return result


def notebook_text(notebook) -> str:
    """The sources of a notebook's cells, joined: what code_files reads."""
    return "\n".join(cell.source for cell in notebook.cells)


def merged_sheet(title: str, sheets: list):
    """Several exercise sheets as one notebook: one title and setup cell, then each chapter's
    pointer, imports and exercises."""
    import nbformat

    if len(sheets) == 1:
        return sheets[0]
    cells = [nbformat.v4.new_markdown_cell(f"# {title}"), sheets[0].cells[1]]
    for sheet in sheets:
        cells += sheet.cells[2:]
    merged = nbformat.v4.new_notebook(metadata=copy.deepcopy(sheets[0].metadata))
    merged.cells = copy.deepcopy(cells)
    # the setup cell makes every merged chapter's checks importable
    merged.cells[1].source = structure.setup_source(structure.code_files(notebook_text(merged)))
    return _renumbered(merged)  # the chapters' cell ids repeat


def leave_out(sheet, numbers: set[str]):
    """The sheet without the exercises numbered in `numbers`: their statements and solutions."""
    kept, dropping = [], False
    for cell in sheet.cells:
        number = structure.exercise_number(cell)
        if number:
            dropping = number in numbers
        elif not structure.is_solution(cell):
            dropping = False
        if not dropping:
            kept.append(cell)
    sheet.cells = kept
    return sheet


def graded_by_exercise(notebook) -> dict[str, list[dict]]:
    """{exercise number: the nbgrader metadata of its graded cells}, for an nbgrader source
    notebook: a graded cell belongs to the last exercise statement above it."""
    graded, current = {}, None
    for cell in notebook.cells:
        current = structure.exercise_number(cell) or current
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and current:
            graded.setdefault(current, []).append(meta)
    return graded


def set_points(notebook, points: dict[str, int]) -> None:
    """Give exercise N.M the points `points[N.M]`: a hand-graded answer all of them, an
    autograded one shared over its test cells (the first cells get the remainder)."""
    graded = graded_by_exercise(notebook)
    for number, total in points.items():
        cells = graded.get(number)
        if not cells:
            raise SystemExit(f"course.yml: exercise {number} is not in this assignment")
        if total < len(cells):
            raise SystemExit(f"course.yml: exercise {number} has {len(cells)} graded cells; "
                             f"give it at least {len(cells)} points")
        share, extra = divmod(total, len(cells))
        for index, meta in enumerate(cells):
            meta["points"] = share + (index < extra)


def write_assignments(out: pathlib.Path) -> list[pathlib.Path]:
    """An nbgrader course: nbgrader_config.py and source/<assignment>/<assignment>.ipynb, one
    assignment per chapter or as the course's course.yml plans them (see COURSE_PLAN_EXAMPLE,
    written beside it as course.example.yml).

    Run again after a change to the book, it rewrites the source notebooks and the files the
    book provides, and nothing else: gradebook.db, release/, submitted/, autograded/,
    feedback/, course.yml and course_config.py stay as they are. Each assignment folder also
    holds the book's code it needs (code_files), which nbgrader releases with the notebook,
    so the notebook's first cell finds it beside it, offline.
    """
    import shutil

    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    write_course_support(out)
    (out / "course.example.yml").write_text(COURSE_PLAN_EXAMPLE)
    chapters = {path.stem: path for path in fresh_chapter_notebooks()}
    for stem, path in chapters.items():
        key = out / "answer-key" / f"{stem}.md"
        key.parent.mkdir(exist_ok=True)
        key.write_text(answer_key(nbformat.read(path, as_version=4)))
    written = []
    for name, spec in course_plan(out, list(chapters)).items():
        notebooks = [nbformat.read(chapters[c], as_version=4) for c in spec["chapters"]]
        titles = [nb.cells[0].source.splitlines()[0].lstrip("# ").strip() for nb in notebooks]
        sheet = merged_sheet(f"{name}: {'; '.join(titles)}", [exercise_sheet(nb) for nb in notebooks])
        numbers = {ex.number for ex in structure.exercises(sheet)}
        unknown = set(spec["leave_out"]) - numbers
        if unknown:
            raise SystemExit(f"course.yml: {name}: no exercise {', '.join(sorted(unknown))} in "
                             f"its chapters")
        notebook = nbgrader_source(leave_out(sheet, set(spec["leave_out"])))
        set_points(notebook, spec["points"])
        note = nbformat.v4.new_markdown_cell(assignment_note(notebook))
        note.metadata.update(_meta("locked", "assignment-note"))
        notebook.cells.insert(1, note)
        folder = out / "source" / name
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(_renumbered(notebook), folder / f"{name}.ipynb")
        for old in folder.glob("*.py"):  # files of the book's code from an earlier plan
            if old.name in CODE_FILES or old.name == "checks.py":
                old.unlink()
        needed = structure.code_files(notebook_text(notebook))
        for code in needed:
            shutil.copy(ROOT / "code" / code, folder / code)
        if "lm.py" in needed:  # the chapter's text, read offline (and by check_lm_capstone)
            (folder / "data").mkdir(exist_ok=True)
            shutil.copy(ROOT / "data" / "shakespeare.txt", folder / "data" / "shakespeare.txt")
        written.append(folder / f"{name}.ipynb")
    return written


# jupyter_client finds ports for a kernel by binding to free ones and releasing them; a kernel
# started at the same moment elsewhere (two courses graded side by side, as the tests do) can
# take one first, and the kernel dies at start with "Address already in use". That failure, and
# only it, is retried.
PORT_RACE_TRIES = 3


# `python -m nbgrader`, without the 2 s of parsers that jsonschema's rfc3987_syntax builds at
# import for a check nbgrader never makes (tools/build_book.py, skip_iri_parsers, says why)
RUN_NBGRADER = """import runpy, sys
sys.modules.setdefault("rfc3987_syntax", None)
sys.argv = ["nbgrader", *sys.argv[1:]]
runpy.run_module("nbgrader", run_name="__main__", alter_sys=True)
"""


def nbgrader(course: pathlib.Path, *args: str) -> str:
    """Run one nbgrader command in ``course`` with this environment, activated or not.

    nbgrader's autograde starts the `alembic` program of its own environment, so the folder of
    this Python goes first on PATH. Raises SystemExit with nbgrader's log if the command fails.
    """
    import os
    import subprocess
    import sys

    bin_dir = pathlib.Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for _ in range(PORT_RACE_TRIES):
        proc = subprocess.run([sys.executable, "-c", RUN_NBGRADER, *args], cwd=course,
                              env=env, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode == 0 or "Address already in use" not in log:
            break
    if proc.returncode != 0:
        raise SystemExit(f"nbgrader {' '.join(args)} failed in {course}:\n{log}")
    return log


def scores(course: pathlib.Path, assignment: str) -> dict[str, dict[str, float]]:
    """{student: {auto, max_auto, manual, max_manual}} from gradebook.db: the points of the
    autograded test cells, and those of the answers graded by hand (0 until someone has)."""
    from nbgrader.api import Gradebook

    result = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for submission in gradebook.assignment_submissions(assignment):
            row = dict.fromkeys(("auto", "max_auto", "manual", "max_manual"), 0.0)
            for notebook in submission.notebooks:
                for grade in notebook.grades:
                    kind = "manual" if grade.name.startswith("answer-") else "auto"
                    row[kind] += grade.score or 0.0
                    row[f"max_{kind}"] += grade.max_score
            result[submission.student.id] = row
    return dict(sorted(result.items()))


def course_command(course: pathlib.Path, command: str, assignment: str | None) -> str:
    """`make release|autograde|feedback|grades`: one nbgrader step, one line of summary."""
    if command != "grades" and not assignment:
        raise SystemExit(f"usage: make {command} A=<assignment>, one of: "
                         + " ".join(p.name for p in sorted((course / "source").glob("*"))))
    if not (course / "nbgrader_config.py").is_file():
        raise SystemExit(f"{course} is not a course folder yet: run `make assignments` first")
    if command == "release":
        nbgrader(course, "generate_assignment", assignment, "--force")
        return f"{assignment}: released to {course / 'release' / assignment}"
    if command == "autograde":  # side by side or on a Dask cluster: tools/autograde.py
        import os

        import autograde

        return autograde.run(course, assignment, autograde.Options.from_environment(os.environ),
                             say=lambda line: print(line, flush=True))
    if command == "feedback":
        nbgrader(course, "generate_feedback", assignment, "--force")
        pages = sorted(course.glob(f"feedback/*/{assignment}/*.html"))
        return f"{assignment}: {len(pages)} feedback page(s) in {course / 'feedback'}"
    if command == "grades":
        nbgrader(course, "export")
        return f"grades: {course / 'grades.csv'}"
    raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    import sys

    match sys.argv[1:]:
        case ["student", out]:
            for path in write_student(pathlib.Path(out)):
                print(path)
        case ["assignments", out]:
            course = pathlib.Path(out)
            kept = [name for name in ("gradebook.db", "release", "submitted", "autograded",
                                      "feedback", "course_config.py", "course.yml")
                    if (course / name).exists()]
            for path in write_assignments(course):
                print(f"{path.parent.name}: {path.relative_to(course)}")
            if kept:
                print(f"kept as they were: {', '.join(kept)}. A released assignment changes "
                      "only when you run `make release A=...` again.")
        case ["release" | "autograde" | "feedback" | "grades" as command, out, *rest]:
            print(course_command(pathlib.Path(out), command, rest[0] if rest else None))
        case _:
            sys.exit(f"usage: {sys.argv[0]} student OUT | assignments OUT | "
                     "release|autograde|feedback OUT ASSIGNMENT | grades OUT")
