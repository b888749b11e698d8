"""`make bench`: how fast the book builds and is tested, and how fast the module runs, as one table.

    python tools/bench.py [--skip-build] [--skip-suite] [--skip-autograde]

Measures, on this machine, in one run:
- the floor: the fastest of five warm `import torch, matplotlib.pyplot`, read at the start,
  after the clean build and after `make test`, the least reading counting; the budgets are in
  floors, so that they mean the same on a faster or slower machine;
- the clean build (every cell executed, as `make book`) and a no-op rebuild, against 58 floors;
- each chapter's execution time (recorded by myst-nb during the clean build), against 10 floors;
- the size of the site, what its explorable figures add (the Vega bundle, once, and the
  figures' blocks), and its heaviest page;
- `make test` itself, run as the Makefile runs it, against 232 floors: its two pytest runs, each
  test file, the book tests' costly steps (the build, the browser visits, the notebooks alone,
  nbgrader, the PDF; tests/conftest.py records them) and, per chapter, its execution in the
  build, alone and under nbgrader (--skip-suite leaves this out);
- nbgrader's autograde of one student's submission, per chapter, against 3x a kernel's start,
  and `make autograde`'s students per minute with 1, 2 and every core's JOBS (--skip-autograde
  leaves both out);
- the forward time of code/attention.py against PyTorch's math path of
  `scaled_dot_product_attention` and against `torch.nn.MultiheadAttention`, as ratios.
The table is printed and written to _build/bench.md, headed by the date, the commit and the
machine. A complete run (nothing skipped) also puts it in README.md, between README_START and
README_END, so that README shows the current measurement and not older ones.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))


def timed(cmd: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return elapsed


def build_times(out: pathlib.Path) -> tuple[float, float, dict[str, float]]:
    build = [sys.executable, str(ROOT / "tools" / "build_book.py"), str(ROOT),
             "--path-output", str(out), "-W", "-n", "--keep-going"]
    clean = timed(build + ["--all"])
    noop = timed(build)
    with open(out / "_build" / ".doctrees" / "environment.pickle", "rb") as f:
        env = pickle.load(f)
    chapters = {doc.split("/")[-1]: data["exec_data"]["runtime"]
                for doc, data in env.nb_metadata.items() if data.get("exec_data")}
    return clean, noop, dict(sorted(chapters.items()))


README_START = "<!-- make bench writes the lines below: do not edit them by hand -->"
README_END = "<!-- end of make bench's table -->"
README_TEST = "test_readme_shows_one_measurement_of_make_bench_for_the_book_as_it_is"
NOOP_BUDGET = 15.0  # seconds for a no-op rebuild
MODULE_BUDGET_RATIO = 1.5  # the module's forward pass within 1.5x PyTorch's

# Budgets in floors (import_floor: 2.58 s on the 2-core machine they were set on, where
# `make test` had 600 s, a clean build 150 s and a chapter 25 s of the build).
SUITE_BUDGET_FLOORS = 232  # `make test`, once the environment is installed
BUILD_BUDGET_FLOORS = 58  # a clean build
CHAPTER_BUDGET_FLOORS = 10  # one chapter's execution in the build (two run side by side)


def import_floor(repeats: int = 5) -> float:
    """The floor: the fastest of `repeats` warm runs of `import torch, matplotlib.pyplot` in a
    new Python, the least any chapter, notebook or test process pays."""
    times = []
    for _ in range(repeats):
        times.append(timed([sys.executable, "-c", "import torch, matplotlib.pyplot"]))
    return min(times)


def suite_times() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """`make test`'s two pytest runs, as the Makefile runs them: their wall times, the seconds
    each test file took (setup included, summed over both workers for the fast tests), from
    pytest's JUnit report, and the book tests' costly steps as tests/conftest.py records them
    (record_time), per chapter where they run per chapter."""
    import json
    import xml.etree.ElementTree as ET

    walls, files = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        steps_file = pathlib.Path(tmp) / "steps.json"
        for marker, extra in (("not book", ["-n", "2"]), ("book and not release", [])):
            report = pathlib.Path(tmp) / "junit.xml"
            # Less the one test that reads what this run is about to write into README.
            walls[marker] = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "-m", marker, *extra, f"--junitxml={report}", "--deselect",
                                   "tests/test_tools.py::" + README_TEST],
                                  env={**os.environ, "BOOK_SUITE_TIMES": str(steps_file)})
            for case in ET.parse(report).iter("testcase"):
                parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
                name = next((part for part in parts if part.startswith("test_")), parts[0])
                files[name] = files.get(name, 0.0) + float(case.get("time", 0))
        steps = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
    return walls, dict(sorted(files.items(), key=lambda kv: -kv[1])), steps


def kernel_floor(repeats: int = 3) -> float:
    """Median time to start a kernel and import torch and matplotlib in it: what nbgrader pays
    per submission before any of the student's cells."""
    import jupyter_client

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
        try:
            kc.execute_interactive("import torch, matplotlib.pyplot", timeout=120)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


AUTOGRADE_BUDGET_FLOORS = 3.0  # autograding one submission: at most 3 kernel starts' worth


AUTOGRADE_STUDENTS = 4  # submissions graded by one `nbgrader autograde`, as a class would be


def autograde_seconds() -> dict[str, float]:
    """Seconds per student that nbgrader's autograde takes on each chapter: AUTOGRADE_STUDENTS
    copies of the reference solution graded by one command (a class is graded that way, so
    nbgrader's own start is shared), in a throwaway course made as `make assignments` makes it."""
    sys.path.insert(0, str(ROOT / "tools"))
    import classroom

    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        course = pathlib.Path(tmp)
        for path in classroom.write_assignments(course):
            name = path.parent.name
            classroom.nbgrader(course, "generate_assignment", name, "--force")
            for student in range(AUTOGRADE_STUDENTS):
                shutil.copytree(course / "source" / name,
                                course / "submitted" / f"student{student}" / name)
            start = time.perf_counter()
            classroom.nbgrader(course, "autograde", name, "--force")
            times[name] = (time.perf_counter() - start) / AUTOGRADE_STUDENTS
    return times


THROUGHPUT_CHAPTER = "08-position"  # GRADED_IN_TEST: the chapter `make test` grades with nbgrader
THROUGHPUT_STUDENTS = 6
THROUGHPUT_BUDGET = 1.6  # two workers grade at least 1.6 times as many students as one


def autograde_throughput() -> dict[int, float]:
    """{JOBS: students per minute} of `make autograde` (tools/autograde.py) on
    THROUGHPUT_STUDENTS copies of THROUGHPUT_CHAPTER's reference solution, every student graded
    again (FORCE) with 1, 2 and every core's worth of JOBS."""
    sys.path.insert(0, str(ROOT / "tools"))
    import autograde
    import classroom

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        course = pathlib.Path(tmp)
        classroom.write_assignments(course)
        name = THROUGHPUT_CHAPTER
        classroom.nbgrader(course, "generate_assignment", name, "--force")
        for student in range(THROUGHPUT_STUDENTS):
            shutil.copytree(course / "source" / name,
                            course / "submitted" / f"student{student}" / name)
        for jobs in sorted({1, 2, os.cpu_count() or 1}):
            start = time.perf_counter()
            autograde.run(course, name, autograde.Options(jobs, autograde.DEFAULT_TIMEOUT, True),
                          say=lambda line: None)
            rates[jobs] = THROUGHPUT_STUDENTS / (time.perf_counter() - start) * 60
    return rates


EXPLORABLE = re.compile(r'<div class="explorable" id="[^"]+">.*?</div>', re.S)
VEGA_BUNDLE = pathlib.Path("_static") / "vega" / "vega-bundle.js"


def site_size(html: pathlib.Path) -> dict:
    """Sizes in MiB: the whole site; what the explorable figures add to it (the Vega bundle,
    stored once, and the figures' blocks of spec and still image in the pages); the heaviest
    page with everything it loads that the theme's pages do not share (its images, and the
    Vega bundle if it has an explorable figure)."""
    files = [p for p in html.rglob("*") if p.is_file()]
    pages = [p for p in files if p.suffix == ".html" and "_static" not in p.parts]
    bundle = html / VEGA_BUNDLE
    bundle_size = bundle.stat().st_size if bundle.is_file() else 0
    blocks = {page: EXPLORABLE.findall(page.read_text(encoding="utf-8")) for page in pages}

    def weight(page: pathlib.Path) -> int:
        text = page.read_text(encoding="utf-8")
        images = {p for p in (html / "_images").glob("*") if p.name in text}
        return (page.stat().st_size + sum(p.stat().st_size for p in images)
                + (bundle_size if blocks[page] else 0))

    heaviest = max(pages, key=weight)
    figures = [b for found in blocks.values() for b in found]
    mib = 2**20
    return {"total": sum(p.stat().st_size for p in files) / mib,
            "bundle": bundle_size / mib,
            "figures": len(figures),
            "figure_pages": sum(1 for found in blocks.values() if found),
            "blocks": sum(len(b.encode()) for b in figures) / mib,
            "heaviest": str(heaviest.relative_to(html)), "heaviest_mib": weight(heaviest) / mib}


def best_of_alternating(mine, ref, repeats: int = 30) -> tuple[float, float]:
    """Best time of each of two functions, run in alternation so that both see the same
    machine (a shared machine's speed drifts between one loop and the next)."""
    mine(), ref()  # warm up
    best_mine = best_ref = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        mine()
        best_mine = min(best_mine, time.perf_counter() - start)
        start = time.perf_counter()
        ref()
        best_ref = min(best_ref, time.perf_counter() - start)
    return best_mine, best_ref


def forward_ratios() -> list[tuple[str, float, float, float]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attention import MultiHeadAttention, scaled_dot_product_attention

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: far steadier timings on a shared 2-core machine
    rows = []
    for B, H, L, E in [(8, 8, 128, 64), (4, 8, 512, 64), (1, 8, 1024, 64)]:
        q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            mine, ref = best_of_alternating(
                lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        rows.append((f"SDPA B={B} H={H} L=S={L} E={E}, causal", mine * 1e3, ref * 1e3, mine / ref))
    for B, L, D, H in [(8, 128, 256, 8), (2, 512, 256, 8)]:
        ref_module = torch.nn.MultiheadAttention(D, H, batch_first=True).eval()
        module = MultiHeadAttention.from_torch(ref_module).eval()
        x = torch.randn(B, L, D)
        with torch.no_grad():
            mine, ref = best_of_alternating(
                lambda: module(x, x, x),
                lambda: ref_module(x, x, x, average_attn_weights=False))
        rows.append((f"MHA B={B} L={L} d_model={D} H={H}, weights returned", mine * 1e3, ref * 1e3, mine / ref))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-build", action="store_true", help="no build timings")
    parser.add_argument("--skip-suite", action="store_true", help="no `make test` timings")
    parser.add_argument("--skip-autograde", action="store_true", help="no nbgrader timings")
    args = parser.parse_args()

    lines = [heading(), ""]
    # The floor is read before the build, after it and after `make test` (on a shared machine it
    # read 3.1 s and 4.3 s on one day), and the fastest reading counts: a busy moment at the
    # start cannot make a budget look met.
    readings = [import_floor()]
    chapters: dict[str, float] = {}
    if not args.skip_build:
        out = pathlib.Path(tempfile.mkdtemp(prefix="bench-"))
        try:
            clean, noop, chapters = build_times(out)
            site = site_size(out / "_build" / "html")
        finally:
            shutil.rmtree(out, ignore_errors=True)
        readings.append(import_floor())
    if not args.skip_suite:
        walls, files, steps = suite_times()
        readings.append(import_floor())
    floor = min(readings)
    lines += [f"The floor, the fastest of five warm `import torch, matplotlib.pyplot`, is "
              f"{floor:.2f} s here, the least of its readings at the start, after the clean "
              "build and after `make test`, whichever ran ("
              f"{', '.join(f'{r:.2f}' for r in readings)} s); budgets are in floors.", ""]
    if not args.skip_build:
        executed = sum(chapters.values())
        lines += [
            "| build | seconds | floors |", "| --- | ---: | ---: |",
            f"| clean build, every cell executed (wall) | {clean:.1f} | {clean / floor:.0f} |",
            f"| no-op rebuild (wall) | {noop:.1f} | {noop / floor:.0f} |",
            f"| chapter execution, summed (two chapters run side by side) | {executed:.1f} | "
            f"{executed / floor:.0f} |",
            f"| budget: clean build within {BUILD_BUDGET_FLOORS} floors | | "
            f"{'met' if clean <= BUILD_BUDGET_FLOORS * floor else 'NOT met'} |",
            f"| budget: no-op rebuild within {NOOP_BUDGET:.0f} s | | "
            f"{'met' if noop <= NOOP_BUDGET else 'NOT met'} |",
            f"| budget: every chapter within {CHAPTER_BUDGET_FLOORS} floors in the build | | "
            f"{'met' if max(chapters.values()) <= CHAPTER_BUDGET_FLOORS * floor else 'NOT met'} |",
            "", "| site | |", "| --- | ---: |",
            f"| total size | {site['total']:.1f} MiB |",
            f"| without the explorable figures (no Vega bundle, no figure blocks) | "
            f"{site['total'] - site['bundle'] - site['blocks']:.1f} MiB |",
            f"| Vega bundle, one file in _static/vega/, loaded by {site['figure_pages']} pages | "
            f"{site['bundle']:.2f} MiB |",
            f"| {site['figures']} explorable figures' blocks (spec + still image) | "
            f"{site['blocks']:.2f} MiB |",
            f"| heaviest page (HTML + its images + Vega if it has a figure) | "
            f"{site['heaviest']}, {site['heaviest_mib']:.2f} MiB |",
            "",
        ]
    if not args.skip_suite:
        total = sum(walls.values())
        lines += [
            "| `make test` | seconds | floors |", "| --- | ---: | ---: |",
            f"| fast tests, `pytest -m \"not book\" -n 2` (wall) | {walls['not book']:.1f} | "
            f"{walls['not book'] / floor:.0f} |",
            f"| book tests, `pytest -m \"book and not release\"` (wall) | "
            f"{walls['book and not release']:.1f} | {walls['book and not release'] / floor:.0f} |",
            f"| the two together | {total:.1f} | {total / floor:.0f} |",
            f"| budget: within {SUITE_BUDGET_FLOORS} floors | | "
            f"{'met' if total <= SUITE_BUDGET_FLOORS * floor else 'NOT met'} |",
            "", "| the book tests' steps | seconds |", "| --- | ---: |",
            *[f"| {step} | {sec:.1f} |" for step, sec in group_totals(steps).items()],
            "", "| test file (summed test time, setup included) | seconds |", "| --- | ---: |",
            *[f"| {name} | {sec:.1f} |" for name, sec in files.items() if sec >= 1.0],
            "",
        ]
        per_chapter = chapter_columns(steps, chapters)
        if per_chapter:
            columns = [c for c in CHAPTER_COLUMNS if any(c in row for row in per_chapter.values())]
            lines += ["| chapter | " + " | ".join(columns) + " |",
                      "| --- | " + " | ".join("---:" for _ in columns) + " |",
                      *[f"| {name} | " + " | ".join(
                          f"{row[c]:.1f}" if c in row else "" for c in columns) + " |"
                        for name, row in per_chapter.items()], ""]
    elif chapters:
        lines += ["| chapter | executed in the build, s |", "| --- | ---: |",
                  *[f"| {name} | {sec:.1f} |" for name, sec in chapters.items()], ""]
    if not args.skip_autograde:
        floor = kernel_floor()
        times = autograde_seconds()
        limit = AUTOGRADE_BUDGET_FLOORS * floor
        lines += [
            f"| nbgrader autograde, per student ({AUTOGRADE_STUDENTS} graded together) | seconds | / floor | "
            f"within {AUTOGRADE_BUDGET_FLOORS:.0f}x floor |", "| --- | ---: | ---: | --- |",
            f"| floor: kernel start + `import torch, matplotlib` | {floor:.1f} | 1.00 | |",
            *[f"| {name} | {sec:.1f} | {sec / floor:.2f} | {'yes' if sec <= limit else 'NO'} |"
              for name, sec in times.items()],
            f"| a class of 200, all chapters, one after another | "
            f"{200 * sum(times.values()) / 3600:.1f} h | | |",
            "",
        ]
        rates = autograde_throughput()
        lines += [
            f"| `make autograde`, {THROUGHPUT_STUDENTS} students of {THROUGHPUT_CHAPTER} | "
            "students/min | s per student / floor |", "| --- | ---: | ---: |",
            *[f"| JOBS={jobs} | {rate:.1f} | {60 / rate / floor:.2f} |"
              for jobs, rate in rates.items()],
            f"| budget: JOBS=2 at least {THROUGHPUT_BUDGET}x JOBS=1 | | "
            f"{'met' if rates.get(2, 0) >= THROUGHPUT_BUDGET * rates[1] else 'NOT met'} "
            f"({rates.get(2, 0) / rates[1]:.2f}x) |",
            "",
        ]
    lines += ["| forward pass (CPU, 1 thread, no grad, best of 30) | module ms | PyTorch ms | ratio |",
              "| --- | ---: | ---: | ---: |"]
    ratios = forward_ratios()
    lines += [f"| {name} | {mine:.2f} | {ref:.2f} | {ratio:.2f} |" for name, mine, ref, ratio in ratios]
    within = sum(ratio <= MODULE_BUDGET_RATIO for *_, ratio in ratios)
    lines += [f"| budget: within {MODULE_BUDGET_RATIO}x of PyTorch | | | {within} of {len(ratios)} |"]
    report = "\n".join(lines)
    print(report)
    (ROOT / "_build").mkdir(exist_ok=True)
    (ROOT / "_build" / "bench.md").write_text(report + "\n")
    if not (args.skip_build or args.skip_suite or args.skip_autograde):
        readme = ROOT / "README.md"
        readme.write_text(with_table(readme.read_text(encoding="utf-8"), report), encoding="utf-8")
        print(f"\nREADME.md now shows this table ({readme}).")


def group_totals(steps: dict[str, float]) -> dict[str, float]:
    """The steps recorded per chapter ("group / chapter") summed per group, the others as
    they are; the build's per-chapter executions are left out (they are inside the build)."""
    totals: dict[str, float] = {}
    for key, sec in steps.items():
        group = key.split(" / ")[0]
        if group != "chapter executed in the build":
            totals[group] = totals.get(group, 0.0) + sec
    return totals


def chapter_columns(steps: dict[str, float], build: dict[str, float]) -> dict[str, dict]:
    """{chapter: {column: seconds}}: its execution in the bench's own clean build (when one
    ran), in `make test`'s build, alone, and in nbgrader, from the recorded steps."""
    rows: dict[str, dict] = {}
    for name, sec in build.items():
        rows.setdefault(name, {})[CLEAN_BUILD_COLUMN] = sec
    for key, sec in steps.items():
        if " / " in key:
            group, chapter = key.split(" / ", 1)
            rows.setdefault(chapter, {})[CHAPTER_STEPS[group]] = sec
    return dict(sorted(rows.items()))


# The per-chapter table's columns: the bench's clean build, then the steps that
# tests/conftest.py and tests/test_classroom.py record per chapter, by the names they record.
CLEAN_BUILD_COLUMN = "clean build, s"
CHAPTER_STEPS = {"chapter executed in the build": "in `make test`'s build, s",
                 "chapter executed alone, as in Colab": "alone, as in Colab, s",
                 "nbgrader: release, autograde five submissions, feedback": "nbgrader, s"}
CHAPTER_COLUMNS = (CLEAN_BUILD_COLUMN, *CHAPTER_STEPS.values())


def heading() -> str:
    """When, at which commit and on what machine the table was measured."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"Measured by `make bench` on {time.strftime('%Y-%m-%d', time.gmtime())} at commit "
            f"{commit}{' (with uncommitted changes)' if dirty else ''}, on {os.cpu_count()} cores "
            f"({platform.processor() or platform.machine()}, CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}), {memory:.0f} GiB, "
            f"{'a GPU' if torch.cuda.is_available() else 'no GPU'}: "
            f"Python {platform.python_version()}, torch {torch.__version__}.")


def with_table(readme: str, report: str) -> str:
    """README's text with the lines between README_START and README_END replaced by report."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {README_START!r} ... {README_END!r} block")
    return readme[:start + len(README_START)] + "\n\n" + report + "\n\n" + readme[end:]


if __name__ == "__main__":
    main()
