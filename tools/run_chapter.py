"""Execute one chapter the way the book build does and report where the time goes.

    .venv/bin/python tools/run_chapter.py chapters/03-scaling.md [--cells] [--save PATH]

Runs the MyST notebook, after the setup cell that the build puts in front of it
(tools/chapter_structure.py), with its working directory set to chapters/ (as myst-nb does),
prints the total execution time and, with --cells, the slowest cells; with --save PATH it writes
the executed notebook there (to compare two runs' outputs, e.g. under another
ATEN_CPU_CAPABILITY). Exits non-zero if a cell raises
or writes to stderr, which the book build would also refuse.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbclient
import nbformat

import chapter_structure

sys.path.insert(0, str(chapter_structure.ROOT / "code"))
from explorable import BOOK_HTML  # noqa: E402


def execute(path: pathlib.Path, timeout: int = 120):
    """Execute the notebook at ``path``; return (notebook, seconds, per-cell seconds)."""
    # As in the build (_ext/explorables.py): explorable figures are rendered as the HTML book
    # shows them, a still image drawn by vl-convert included. The kernel inherits this.
    os.environ[BOOK_HTML] = "1"
    nb = chapter_structure.chapter_notebook(path)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    cell_seconds = []
    start = time.perf_counter()
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            t0 = time.perf_counter()
            client.execute_cell(cell, index)
            cell_seconds.append((time.perf_counter() - t0, index))
    return nb, time.perf_counter() - start, cell_seconds


def stderr_outputs(nb):
    """The text of every stderr stream a cell wrote."""
    return [
        "".join(out.get("text", ""))
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stderr"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=pathlib.Path)
    parser.add_argument("--cells", action="store_true", help="list the five slowest cells")
    parser.add_argument("--save", type=pathlib.Path, metavar="PATH",
                        help="write the executed notebook to PATH")
    args = parser.parse_args()
    nb, seconds, cells = execute(args.chapter.resolve())
    print(f"{args.chapter}: {seconds:.1f} s (kernel start included)")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, args.save)
    if args.cells:
        for sec, index in sorted(cells, reverse=True)[:5]:
            first = nb.cells[index].source.splitlines()[:1] or [""]
            print(f"  cell {index:3d}: {sec:5.2f} s  {first[0][:70]}")
    errors = stderr_outputs(nb)
    for text in errors:
        print("stderr output:", text.strip()[:500], file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
