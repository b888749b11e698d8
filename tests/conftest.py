"""Shared fixtures: one strict build of the whole book per test session."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from site_browser import toc_docs  # noqa: F401  (the tests import it from here)

ROOT = pathlib.Path(__file__).resolve().parents[1]




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
    """One strict build of the whole book, shared by every test that needs it."""
    return build_book(tmp_path_factory.mktemp("book"))
