"""The make targets get the system programs they need themselves (tools/chromium.py)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

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
