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


def build_book(out: pathlib.Path):
    """Build the book as `make book` does, into ``out``.

    Returns (returncode, log, build_dir) where build_dir holds html/, jupyter_execute/ and
    .doctrees/.
    """
    cmd = [sys.executable, str(ROOT / "tools" / "build_book.py"), str(ROOT),
           "--path-output", str(out), "--all", "-W", "-n", "--keep-going"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    log = proc.stdout + proc.stderr
    (out / "build.log").write_text(log)
    return proc.returncode, log, out / "_build"


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """One strict build of the whole book, shared by every test that needs it. While working on
    the book tests alone, BOOK_REUSE_BUILD=_build reuses the build `make book` made there (its
    log is not kept, so test_build_succeeds_without_warnings fails: `make test` never sets it)."""
    if reuse := os.environ.get("BOOK_REUSE_BUILD"):
        return 0, "", pathlib.Path(reuse).resolve()
    with timed("the book's strict build"):
        built = build_book(tmp_path_factory.mktemp("book"))
    for name, seconds in execution_times(built[2]).items():
        record_time("chapter executed in the build", seconds, name)
    return built


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


@pytest.fixture(scope="session")
def site(build):
    """Every page of the build opened once in Chromium for every audit of tests/test_site.py
    and tests/test_core_path_site.py: (html_dir, {page: report})."""
    import test_site

    with timed("every page in Chromium, one visit each"):
        return test_site.visit_site(build)
