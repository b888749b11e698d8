"""`jupyter-book build`, with the chapters executed in parallel.

Jupyter Book 1 runs Sphinx with one process; its command line has no `-j`. Every extension
the book uses declares itself safe for parallel reading, and reading a chapter is where its
notebook executes, so asking Sphinx for several processes runs several chapters at once.

    python tools/build_book.py [jupyter-book build arguments ...]

The number of processes is $BOOK_JOBS, by default the number of cores.
"""

from __future__ import annotations

import functools
import os
import sys

import jupyter_book.sphinx
import sphinx.builders
import sphinx_jupyterbook_latex
import sphinx_multitoc_numbering
from sphinx_proof.domain import ProofDomain
from jupyter_book.cli.main import main

jobs = int(os.environ.get("BOOK_JOBS") or os.cpu_count() or 1)
# The CLI imports build_sphinx from jupyter_book.sphinx when it runs, so this takes effect.
jupyter_book.sphinx.build_sphinx = functools.partial(jupyter_book.sphinx.build_sphinx, jobs=jobs)


def _declare_parallel_safe(module):
    """Make ``module``'s Sphinx extension say it is safe for parallel reading.

    Two extensions that Jupyter Book always loads do not say, so Sphinx would fall back to a
    serial read with a warning (an error under -W). Both are safe: sphinx-multitoc-numbering
    only replaces the method that assigns section numbers, which Sphinx calls in the main
    process after the parallel reads are merged; sphinx-jupyterbook-latex only adds node
    types and transforms for the LaTeX builder and keeps nothing in the environment.
    """
    setup = module.setup

    def parallel_safe_setup(app):
        metadata = setup(app) or {}
        return {**metadata, "parallel_read_safe": True, "parallel_write_safe": True}

    module.setup = parallel_safe_setup


_declare_parallel_safe(sphinx_multitoc_numbering)
_declare_parallel_safe(sphinx_jupyterbook_latex)


def _merge_nothing(self, docnames, otherdata):
    """sphinx-proof keeps its records in env.proof_list, which its own env-merge-info handler
    merges; its domain holds no data, so there is nothing to merge here."""


# sphinx-proof says it is parallel safe but leaves Domain.merge_domaindata unimplemented.
ProofDomain.merge_domaindata = _merge_nothing



def _one_page_per_chunk(docnames, nproc, maxbatch=10):
    """Hand the worker processes one page at a time.

    Sphinx splits the pages into nproc equal-sized batches up front; with a few slow chapters
    among quick pages, one process can get most of the chapters while the other idles. With
    one page per batch a free process takes the next page as soon as it is done.
    """
    return [[docname] for docname in docnames]


sphinx.builders.make_chunks = _one_page_per_chunk

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
