"""`jupyter-book build`, with the chapters executed in parallel.

Jupyter Book 1 runs Sphinx with one process; its command line has no `-j`. Every extension
the book uses declares itself safe for parallel reading (or is declared so below), and reading
a chapter is where its notebook executes, so asking Sphinx for several processes runs several
chapters at once.

    python tools/build_book.py [jupyter-book build arguments ...]

The number of processes is $BOOK_JOBS, by default the number of cores.

Every change this makes to the code of another project is in `patch()` below, one function
per patch, each with its reason and the upstream change that would let it go. Each has a test
in tests/test_tools.py that fails once the pinned version no longer needs it.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_size(source: pathlib.Path) -> int:
    """Characters in the code cells of a page's MyST source (0 if it has none or is not one):
    what executing it costs, roughly."""
    if not source.is_file():
        return 0
    cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", source.read_text(encoding="utf-8"),
                       re.S | re.M)
    return sum(map(len, cells))


def pass_jobs(jobs: int) -> None:
    """Jupyter Book's CLI calls `jupyter_book.sphinx.build_sphinx` without `jobs`, although
    the function takes it and hands it to Sphinx. The CLI imports the function when it runs, so
    replacing the module attribute reaches it. Upstream: a `--jobs` option of `jupyter-book
    build` (jupyter-book/jupyter-book#1735; the pull request #1955 was closed unmerged)."""
    import jupyter_book.sphinx

    jupyter_book.sphinx.build_sphinx = functools.partial(jupyter_book.sphinx.build_sphinx,
                                                         jobs=jobs)


def declare_multitoc_numbering_parallel_safe() -> None:
    """sphinx-multitoc-numbering, which Jupyter Book loads for numbering across parts, does
    not say whether it is parallel safe, so Sphinx would read serially with a warning (an
    error under -W). It is safe: it only replaces the method that assigns section numbers,
    which Sphinx calls in the main process after the parallel reads are merged. Upstream:
    `parallel_read_safe` in its setup() (executablebooks/sphinx-multitoc-numbering#27)."""
    import sphinx_multitoc_numbering

    setup = sphinx_multitoc_numbering.setup

    def parallel_safe_setup(app):
        metadata = setup(app) or {}
        return {**metadata, "parallel_read_safe": True, "parallel_write_safe": True}

    sphinx_multitoc_numbering.setup = parallel_safe_setup


def merge_proof_domain() -> None:
    """sphinx-proof declares itself parallel safe, but its ProofDomain leaves
    `Domain.merge_domaindata` unimplemented, which raises NotImplementedError when Sphinx
    merges a worker's environment. Its records live in env.proof_list, which its own
    env-merge-info handler merges; the domain's data holds nothing to merge. Upstream: a
    `merge_domaindata` on ProofDomain (no issue filed there that we found)."""
    from sphinx_proof.domain import ProofDomain

    def merge_domaindata(self, docnames, otherdata):
        """Nothing: sphinx-proof's records are merged by its env-merge-info handler."""

    ProofDomain.merge_domaindata = merge_domaindata


def one_page_per_chunk() -> None:
    """Sphinx splits the pages into equal batches per process up front
    (`sphinx.util.parallel.make_chunks`, looked up by `sphinx.builders` when it reads); with a
    few slow chapters among quick pages, one process can get most of the chapters while the
    other idles. With one page per batch a free process takes the next page as soon as it is
    done; and the pages with the most code go first, so that the last pages left, when one
    process may have nothing more to take, are quick ones. Upstream: a work queue for parallel
    reading (sphinx-doc/sphinx#6330, pull request #13738) or a configurable batch size
    (sphinx-doc/sphinx#10967)."""
    import sphinx.builders

    def make_chunks(docnames, nproc, maxbatch=10):
        return [[docname] for docname in sorted(docnames, key=lambda doc: code_size(ROOT / f"{doc}.md"),
                                                reverse=True)]

    sphinx.builders.make_chunks = make_chunks


class _FirstInFirstOut(dict):
    """A dict whose popitem() gives the entry added first, as a queue does."""

    def popitem(self):
        key = next(iter(self))
        return key, self.pop(key)


def start_waiting_pages_in_order() -> None:
    """Sphinx's ParallelTasks keeps the tasks that wait for a free process in a dict and starts
    the next one with `dict.popitem()`, which takes the one added *last*. Every page is added
    at once when reading, so after the first `nproc` pages the rest start in reverse order:
    one_page_per_chunk's slowest chapters ran last, and one process read the slowest chapter
    alone while the other idled (measured: chapter 13, 18 s, started last and ended the
    reading 17 s after every other page). Giving each ParallelTasks a waiting list that
    pops the first entry starts the pages in the order they were added. Upstream: a queue in
    `sphinx.util.parallel.ParallelTasks` (no issue filed there that we found)."""
    from sphinx.util.parallel import ParallelTasks

    init = ParallelTasks.__init__

    def __init__(self, nproc: int) -> None:
        init(self, nproc)
        self._precvsWaiting = _FirstInFirstOut(self._precvsWaiting)

    ParallelTasks.__init__ = __init__


def _detach_registered_nodes(app, doctree) -> None:
    """The registry's nodes of the page just read, as copies that hold no document."""
    for entry in getattr(app.env, "sphinx_exercise_registry", {}).values():
        if entry["docname"] == app.env.docname:
            copy = entry["node"].deepcopy()
            for node in copy.findall():
                node._document = None  # the copy's parent is None already
            entry["node"] = copy


def detach_exercise_registry() -> None:
    """sphinx-exercise keeps every exercise and solution node in `env.sphinx_exercise_registry`
    with its `document`, so pickling the environment pickles every page's whole doctree with
    it: 6.8 of the environment's 8.2 MB here. In a parallel build each process sends back the
    whole environment it forked, registry included, and the main process unpickles it, so the
    cost grows with every page read. Its post-transforms read the registry's nodes for their
    labels, titles and types only, never their document, so the registry keeps a copy
    without one. Upstream: sphinx-exercise storing the data it needs rather than the node (no
    issue filed there that we found)."""
    import sphinx_exercise

    setup = sphinx_exercise.setup

    def setup_with_detached_registry(app):
        metadata = setup(app)
        app.connect("doctree-read", _detach_registered_nodes)
        return metadata

    sphinx_exercise.setup = setup_with_detached_registry


def cache_bibtex_plugin_lookups() -> None:
    """pybtex finds its plugins (the citation style, its labels, names and sorting) through
    `entry_points(group=..., name=...)`, which reads the metadata of every installed
    distribution, 17 ms here, and sphinxcontrib-bibtex asks again for every citation it
    formats: about 500 lookups per build (each page's references, and their copies in the
    chapter notebooks), some 9 s of the main process. The installed entry points do not change
    during a build, so each lookup is made once (`register_plugin`'s plugins, which pybtex
    looks up before the entry points, are unaffected). Upstream: a cached lookup in
    `pybtex.plugin` (no issue filed there that we found)."""
    import functools

    import pybtex.plugin

    lookup = pybtex.plugin.entry_points

    @functools.lru_cache(maxsize=None)
    def entry_points(**selection):
        return tuple(lookup(**selection))

    pybtex.plugin.entry_points = entry_points


def skip_iri_parsers() -> None:
    """jsonschema, which nbformat imports (and myst-nb imports nbformat), imports
    rfc3987_syntax if it is installed, for an IRI format check that nothing here uses, and that
    builds 38 Lark parsers at import: 2 s of one core before the build starts. Marked missing,
    jsonschema goes without it, as where it is not installed. The chapters' setup cell, the test
    processes (tests/conftest.py) and nbgrader's (tools/classroom.py, tools/autograde.py) do the
    same. Upstream: parsers built when first used; tests/test_tools.py fails when
    rfc3987_syntax builds them lazily."""
    sys.modules.setdefault("rfc3987_syntax", None)


class _DoctreeCopies:
    """The build environment, but each page's doctree unpickled once (see
    resolve_numrefs_from_one_copy_per_page)."""

    def __init__(self, env, copies: dict) -> None:
        self._env, self._copies = env, copies

    def __getattr__(self, name: str):
        return getattr(self._env, name)

    def get_doctree(self, docname: str):
        if docname not in self._copies:
            self._copies[docname] = self._env.get_doctree(docname)
        return self._copies[docname]


def resolve_numrefs_from_one_copy_per_page() -> None:
    """To resolve a `{numref}`, Sphinx's standard domain unpickles the whole doctree of the page
    that holds the target (`StandardDomain._resolve_numref_xref` calls `env.get_doctree`), only
    to find the target's node and its type; it does so again for every reference. The book's
    140-odd numrefs unpickled chapters 160 times, 7.1 s of the main process while it writes, in
    which it resolves the pages one after another. The resolution only reads that doctree, and
    the doctrees do not change once read, so each page's copy is unpickled once per build.
    Upstream: a lookup that needs no doctree, such as the target's node type kept with the
    label (no issue filed there that we found)."""
    import weakref

    from sphinx.domains.std import StandardDomain

    resolve = StandardDomain._resolve_numref_xref
    copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _resolve_numref_xref(self, env, *args, **kwargs):
        return resolve(self, _DoctreeCopies(env, copies.setdefault(env, {})), *args, **kwargs)

    StandardDomain._resolve_numref_xref = _resolve_numref_xref


def patch(jobs: int) -> None:
    """Every patch the build needs, applied before Jupyter Book starts Sphinx."""
    skip_iri_parsers()
    pass_jobs(jobs)
    declare_multitoc_numbering_parallel_safe()
    merge_proof_domain()
    one_page_per_chunk()
    start_waiting_pages_in_order()
    cache_bibtex_plugin_lookups()
    detach_exercise_registry()
    resolve_numrefs_from_one_copy_per_page()


if __name__ == "__main__":
    from jupyter_book.cli.main import main

    patch(int(os.environ.get("BOOK_JOBS") or os.cpu_count() or 1))
    sys.exit(main(["build", *sys.argv[1:]]))
