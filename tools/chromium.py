"""Find a Chromium that the site tests and screenshots can drive, installing one if need be.

`make test` and `make screenshots` depend on `make browser`, which runs

    python tools/chromium.py ensure

as `make` creates `.venv/` on first use: nothing has to be installed by hand first. It looks
for a Chromium that starts (headless, under Playwright) in this order: the program named by
$BOOK_CHROMIUM; `chromium`, `chromium-browser`, `google-chrome` or `google-chrome-stable`
on PATH; the Chromium that Playwright installed (under $PLAYWRIGHT_BROWSERS_PATH or its
default cache). When none starts it installs one: first with Playwright's own installer
(`python -m playwright install chromium`, what a laptop with internet uses: a download of
about 150-200 MB into ~/.cache/ms-playwright), then, where that download cannot be reached and
this runs as root with apt-get, Debian's `chromium` package (measured: 115 packages, 457 MiB
installed on a fresh Debian 12). Otherwise
it stops with one message naming both ways. The path it settles on is written to
`.venv/chromium-path`; tools/site_browser.py launches exactly that program.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / ".venv" / "chromium-path"
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Headless (Playwright adds --headless), as root, without a GPU; the last four keep Chromium
# from calling Google's servers, which a machine with a closed network refuses.
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-quic"]

HOW_TO = ("The site tests need Chromium, and none could be found or installed. Either let "
          "Playwright download its own (needs internet): `.venv/bin/python -m playwright "
          "install chromium`; or, on Debian or Ubuntu, install the system's: `sudo apt-get "
          "install chromium`. Then run the make command again.")


def candidates() -> list[str]:
    """Every Chromium program this machine offers, most explicit first."""
    found = []
    if os.environ.get("BOOK_CHROMIUM"):
        found.append(os.environ["BOOK_CHROMIUM"])
    found += [path for name in NAMES if (path := shutil.which(name))]
    found.append(playwright_chromium())
    return [path for path in dict.fromkeys(found) if path and os.access(path, os.X_OK)]


def playwright_chromium() -> str:
    """Where Playwright keeps the Chromium its installer downloads (it may not be there)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        return playwright.chromium.executable_path


def starts(path: str) -> str | None:
    """None if Playwright can start the Chromium at path and open a page, else the error."""
    from playwright.sync_api import Error, sync_playwright

    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=path, args=ARGS, headless=True)
            browser.new_page().set_content("<p>ok</p>")
            browser.close()
    except Error as err:
        return str(err).splitlines()[0]
    return None


def first_that_starts() -> str | None:
    for path in candidates():
        error = starts(path)
        if error is None:
            return path
        print(f"chromium: {path} does not start: {error}", file=sys.stderr)
    return None


def install_with_playwright() -> bool:
    print("chromium: none found; trying Playwright's installer (a download of about 150-200 MB)")
    proc = subprocess.run([sys.executable, "-m", "playwright", "install", "chromium"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        lines = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr).splitlines()
        errors = [line for line in lines if line.startswith("Error")] or lines[-1:] or ["?"]
        print(f"chromium: Playwright's installer failed: {errors[0].strip()}")
    return proc.returncode == 0


def install_with_apt() -> bool:
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        print("chromium: Debian's package needs apt-get, run as root; "
              + ("not root" if apt else "no apt-get on PATH"))
        return False
    print("chromium: installing Debian's chromium package with apt-get (about 460 MB with its libraries)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(step, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            print(f"chromium: `{' '.join(step)}` failed: {proc.stderr.strip()[-300:]}")
            return False
    return True


def ensure() -> int:
    path = first_that_starts()
    for install in (install_with_playwright, install_with_apt):
        if path is not None:
            break
        if install():
            path = first_that_starts()
    if path is None:
        print(HOW_TO, file=sys.stderr)
        return 1
    RECORD.parent.mkdir(exist_ok=True)
    if not RECORD.is_file() or RECORD.read_text() != path:
        RECORD.write_text(path)
        print(f"chromium: using {path}")
    return 0


def recorded() -> str:
    """The Chromium that `make browser` settled on; RuntimeError naming the fix if none."""
    path = RECORD.read_text().strip() if RECORD.is_file() else ""
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"No usable Chromium is recorded in {RECORD}: run `make browser`, "
                           "which finds or installs one. " + HOW_TO)
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["ensure"]:
        sys.exit(f"usage: {sys.argv[0]} ensure")
    sys.exit(ensure())
