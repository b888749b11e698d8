"""Shared fixtures: one strict build of the whole book per test session."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

# Before anything imports nbformat: jsonschema's rfc3987_syntax would build 38 parsers, 2 s of
# each test process (tools/build_book.py, skip_iri_parsers, says why).
sys.modules.setdefault("rfc3987_syntax", None)

import pytest  # noqa: E402

from site_browser import toc_docs  # noqa: E402, F401  (the tests import it from here)

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Where the book tests `make test` runs live. Its second run, `pytest -m "book and not release"`,
# collects these files only: collecting every file (importing each and listing its 3,000 cases)
# cost 7 s of one core to select some 40 tests. A run that collects every file fails if a test
# marked book, and not release, is anywhere else, so none can be left out unseen.
BOOK_SUITE = "book and not release"
BOOK_TEST_FILES = ("test_book.py", "test_classroom.py", "test_core_path_site.py", "test_site.py")


def pytest_ignore_collect(collection_path: pathlib.Path, config):
    if (config.option.markexpr == BOOK_SUITE and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and collection_path.name not in BOOK_TEST_FILES):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects them
def pytest_collection_modifyitems(config, items):
    elsewhere = [item.nodeid for item in items
                 if item.get_closest_marker("book") and not item.get_closest_marker("release")
                 and item.path.name not in BOOK_TEST_FILES]
    if elsewhere:
        raise pytest.UsageError(f"tests marked book outside {BOOK_TEST_FILES}, which "
                                f'`pytest -m "{BOOK_SUITE}"` alone collects: {elsewhere}; '
                                "add their file to BOOK_TEST_FILES in tests/conftest.py")
    visits_last(items)


# `make bench` sets BOOK_SUITE_TIMES to a file where the book tests' costly steps write how long
# they took (the build, the browser visits, the notebooks alone, nbgrader, per chapter where
# there are chapters): tools/bench.py prints them beside each test file's time.
SUITE_TIMES = "BOOK_SUITE_TIMES"
_TIMES_LOCK = threading.Lock()


def record_time(group: str, seconds: float, chapter: str | None = None) -> None:
    """Add `seconds` to `group` (or to `chapter` within it) in BOOK_SUITE_TIMES's file, if set."""
    target = os.environ.get(SUITE_TIMES)
    if not target:
        return
    with _TIMES_LOCK:
        path = pathlib.Path(target)
        times = json.loads(path.read_text()) if path.is_file() else {}
        key = group if chapter is None else f"{group} / {chapter}"
        times[key] = times.get(key, 0.0) + seconds
        path.write_text(json.dumps(times, indent=1))


@contextlib.contextmanager
def timed(group: str, chapter: str | None = None):
    """Record how long the block took as `group` (record_time)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        record_time(group, time.perf_counter() - started, chapter)


# Sphinx logs this once every page is read, so every chapter has executed: what follows (its
# writing) keeps about one core busy.
READ_DONE = "pickling environment"


def build_book(out: pathlib.Path, when_read=None):
    """Build the book as `make book` does, into ``out``; call `when_read()`, if given, once its
    log says every page has been read (READ_DONE).

    Returns (returncode, log, build_dir) where build_dir holds html/, jupyter_execute/ and
    .doctrees/.
    """
    cmd = [sys.executable, str(ROOT / "tools" / "build_book.py"), str(ROOT),
           "--path-output", str(out), "--all", "-W", "-n", "--keep-going"]
    # Sphinx's log handler flushes after every record, so each line arrives as it is logged.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"})
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr))
    reader.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if when_read is not None and READ_DONE in line:
            when_read()
            when_read = None
    reader.join()
    proc.wait()
    log = "".join(lines) + "".join(errors)
    (out / "build.log").write_text(log)
    return proc.returncode, log, out / "_build"


ALONE_TEST = "test_every_notebook_runs_alone_as_in_colab_and_prints_what_the_book_shows"


@pytest.fixture(scope="session")
def build(request, tmp_path_factory):
    """One strict build of the whole book, shared by every test that needs it. While working on
    the book tests alone, BOOK_REUSE_BUILD=_build reuses the build `make book` made there (its
    log is not kept, so test_build_succeeds_without_warnings fails: `make test` never sets it).

    When the session runs the notebooks alone too (tests/test_classroom.py, ALONE_TEST), they
    start as soon as the build has executed every chapter: its writing, and the tests up to
    theirs, keep only part of the cores busy."""
    if reuse := os.environ.get("BOOK_REUSE_BUILD"):
        return 0, "", pathlib.Path(reuse).resolve()
    alone = None
    if any(getattr(item, "originalname", None) == ALONE_TEST for item in request.session.items):
        alone = request.getfixturevalue("notebooks_alone").start
    with timed("the book's strict build"):
        built = build_book(tmp_path_factory.mktemp("book"), when_read=alone)
    for name, seconds in execution_times(built[2]).items():
        record_time("chapter executed in the build", seconds, name)
    return built


class Background:
    """Work started once, in threads of its own: `start()` submits it (the first call only),
    `results()` waits for every piece, starting the work if nothing has yet."""

    def __init__(self, submit) -> None:
        self._submit, self._lock = submit, threading.Lock()
        self._pool = self._futures = None

    def start(self) -> None:
        import concurrent.futures

        with self._lock:
            if self._futures is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
                self._futures = self._submit(self._pool)

    def results(self) -> dict:
        self.start()
        return {name: future.result() for name, future in self._futures.items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def notebooks_alone(tmp_path_factory):
    """Every committed chapter notebook executed alone, as in Colab (tests/test_classroom.py,
    submit_alone_runs), as a Background: started by the build once it has read every page, or
    else by the test that compares them with the build."""
    import test_classroom

    folder = tmp_path_factory.mktemp("alone")
    runs = Background(lambda pool: test_classroom.submit_alone_runs(pool, folder))
    yield runs
    runs.close()


def execution_times(build_dir: pathlib.Path) -> dict[str, float]:
    """{page name: seconds} of each page's execution in the build at `build_dir`, as myst-nb
    measured it ({} if the build kept no record)."""
    import pickle

    environment = build_dir / ".doctrees" / "environment.pickle"
    if not environment.is_file():
        return {}
    with open(environment, "rb") as handle:
        metadata = pickle.load(handle).nb_metadata
    return {doc.split("/")[-1]: data["exec_data"]["runtime"]
            for doc, data in metadata.items() if data.get("exec_data")}


# The files whose tests look at the built site. The visits of every page (the `site` fixture)
# start before the first of their tests (site_visits_started), and those that need no visit
# run first, beside them.
SITE_TEST_FILES = ("test_core_path_site.py", "test_site.py")


def visits_last(items: list) -> None:
    """Put the site files' tests that do not use `site` (HTML crawls, the word counts, the PDF,
    the pages without JavaScript: mostly one core's work) before those that do, so that they
    run while the browser visits (site_visits_started) keep both cores busy; the other files'
    tests keep their order."""
    places = [i for i, item in enumerate(items) if item.path.name in SITE_TEST_FILES]
    ordered = sorted((items[i] for i in places), key=lambda item: "site" in item.fixturenames)
    for i, item in zip(places, ordered):
        items[i] = item


@pytest.fixture(scope="session")
def site_visits(build):
    """The visits of every page (test_site.visit_site) as a Background, in a thread of their
    own: started by ALONE_TEST or the first test of SITE_TEST_FILES when the session has a test
    that needs them (site_visits_started), awaited by `site`."""
    import test_site

    def visit():
        with timed("every page in Chromium, one visit each"):
            return test_site.visit_site(build)

    runs = Background(lambda pool: {"site": pool.submit(visit)})
    yield runs
    runs.close()


@pytest.fixture
def site_visits_started(request):
    """Used by every test of SITE_TEST_FILES (their pytestmark), and by the test that waits for
    the notebooks alone (ALONE_TEST), whose last runs keep only one core busy: start the visits
    if a test of the session needs them, and only then (a test that needs no build must not
    start one)."""
    if any("site" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("site_visits").start()


@pytest.fixture(scope="session")
def site(site_visits):
    """Every page of the build opened once in Chromium for every audit of tests/test_site.py
    and tests/test_core_path_site.py: (html_dir, {page: report})."""
    return site_visits.results()["site"]
