# Two commands do everything on a fresh machine with Python 3.11:
#   make book   build the HTML book in _build/html, executing every cell
#   make test   run the module's tests and a full strict build
# The environment lives in .venv/ and is created on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000
COURSE ?= course

# Python writes the bytecode of the project's own modules (code/, tools/, tests/, the last
# rewritten by pytest) to __pycache__/, as it does by default: an environment that sets
# PYTHONDONTWRITEBYTECODE would make every process of `make test` (kernels, grading processes,
# pytest and its workers) compile them again. site-packages is compiled at install.
export PYTHONDONTWRITEBYTECODE :=

# A strict, complete build: every page re-read (--all), warnings are errors (-W),
# references nitpicky (-n), and all warnings reported before failing (--keep-going).
JB_FLAGS := --all -W -n --keep-going

.PHONY: book html bench test check-release test-code clean serve venv browser chapter screenshots notebooks \
        student assignments release autograde feedback grades pdf models test-matrix

venv: $(STAMP)

# pip compiles what it installs in one process, a minute of the install here; compileall does
# it on every core. Files that do not compile (a package's test written for a newer Python) are
# skipped, as pip skips them. Compiled here, not on first import: the answer's process of the
# isolated grading writes no bytecode, so a module it imports first would be compiled anew in
# every grading.
$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -c "import compileall, sysconfig; \
	    compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2, workers=0)"
	touch $(STAMP)

# A Chromium for the site tests and screenshots: the system's or Playwright's if one starts,
# else installed by Playwright's installer or, as root, Debian's package (tools/chromium.py).
# Its path goes to .venv/chromium-path. Checked on every run; installs only when none starts.
browser: $(STAMP)
	$(BIN)/python tools/chromium.py ensure

# tools/build_book.py is `jupyter-book build` with Sphinx's parallel reading, so chapters
# execute side by side on all cores (BOOK_JOBS=1 for one at a time).
book: $(STAMP)
	rm -rf _build/html _build/.doctrees _build/jupyter_execute _build/notebooks
	$(BIN)/python tools/build_book.py . $(JB_FLAGS)

# The chapter notebooks that Colab, Binder and the download button give readers: every build
# writes them (_ext/notebooks.py) to _build/notebooks/; this copies them into chapters/, where they
# are committed. tests/test_book.py fails while the committed ones differ from the build's.
notebooks: book
	cp _build/notebooks/chapters/*.ipynb chapters/

# The book as two PDFs: the whole book, _build/pdf/book.pdf, and the core path (every deeper
# section left out), _build/pdf/book-core.pdf: every page printed from the built site by the
# site tests' Chromium, with a title page, contents, page numbers and bookmarks (tools/pdf.py).
pdf: book browser
	$(BIN)/python tools/pdf.py _build/html _build/pdf/book.pdf
	$(BIN)/python tools/pdf.py _build/html _build/pdf/book-core.pdf --core

# One notebook per chapter for students, in _build/student/: solutions out, stubs and checks in.
student: $(STAMP)
	rm -rf _build/student
	$(BIN)/python tools/classroom.py student _build/student

# An nbgrader course in $(COURSE)/ (see chapters/instructors.md). Run again after a change to
# the book, it rewrites source/ and keeps gradebook.db and every student's folder.
assignments: $(STAMP)
	$(BIN)/python tools/classroom.py assignments $(COURSE)

# nbgrader's steps with the book's environment, activated or not: make release A=03-scaling.
# make autograde grades JOBS students at a time (default: every core), each for at most TIMEOUT
# seconds, and only those whose submission changed since their last grading unless FORCE=1; with
# SCHEDULER=tcp://host:port (or a scheduler file), on that Dask cluster's workers
# (tools/autograde.py).
release autograde feedback: $(STAMP)
	JOBS='$(JOBS)' TIMEOUT='$(TIMEOUT)' FORCE='$(FORCE)' SCHEDULER='$(SCHEDULER)' \
	    $(BIN)/python tools/classroom.py $@ $(COURSE) $(A)

grades: $(STAMP)
	$(BIN)/python tools/classroom.py grades $(COURSE)

# The trained runs that chapters 6 (Multi-head attention), 8 (Position), 9 (Inference), 11 (The
# Transformer block), 12 (Induction heads) and 13 (A language model on real text) load, trained
# again one after another on one thread in float64 and written to models/lookups/,
# models/position/, models/sinks/, models/block/, models/induction/ and models/lm/ (committed):
# a state_dict and a JSON of its config, log and SHA-256 per run, chapter 13's analysis of its
# held-out text and its byte-pair tokenizer. README ("Trained models") says why they are
# trained here and not in the chapters; tests/test_models.py checks them against the book's
# code. About 30 minutes.
models: $(STAMP)
	$(BIN)/python tools/models.py

# Incremental: re-reads (and re-executes) only pages whose source, or code/attention.py, changed.
html: $(STAMP)
	$(BIN)/python tools/build_book.py . -W -n --keep-going

# Build time, no-op rebuild, per-chapter execution, site size, module speed against PyTorch.
bench: $(STAMP)
	$(BIN)/python tools/bench.py

# The fast tests first, on both cores (module, chapter sources, tools: a broken module fails in
# seconds), then the whole book: one strict build, every page in Chromium, the notebooks alone
# on another numerical path, nbgrader on one chapter, a PDF of a few pages.
test: $(STAMP) browser
	$(BIN)/python -m pytest -m "not book" -n 2
	$(BIN)/python -m pytest -m "book and not release"

# Before the site is published (.github/workflows/book.yml runs it after `make test`): what
# `make test` leaves out for time. The whole book and its core path as PDFs, every page with a
# figure or a switch in the dark theme, axe-core's colour rules on every page, nbgrader on every
# other chapter. One build of its own.
check-release: $(STAMP) browser
	$(BIN)/python -m pytest -m release

# The fast tests only: the module and the chapter sources, no book build, no browser.
test-code: $(STAMP)
	$(BIN)/python -m pytest -m "not book" -n 2

# The fast tests once per numerical path that a reader's CPU may take (tools/test_matrix.py:
# MKL's instruction sets and its compatible mode, PyTorch's vector kernels, one thread).
test-matrix: $(STAMP)
	$(BIN)/python tools/test_matrix.py -n 2

serve: book
	@echo "Serving _build/html at http://localhost:$(PORT) (Ctrl-C to stop)"
	$(BIN)/python -m http.server $(PORT) --directory _build/html

clean:
	rm -rf _build .pytest_cache .hypothesis
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

# Execute one chapter as the build does and list its slowest cells: make chapter NAME=03-scaling
chapter: $(STAMP)
	$(BIN)/python tools/run_chapter.py chapters/$(NAME).md --cells

# Full-page screenshots of every page at desktop (1280 px) and phone (390 px) width, offline,
# into _build/screenshots/ (builds the book first when _build/html is missing).
screenshots: $(STAMP) browser
	test -f _build/html/index.html || $(MAKE) book
	$(BIN)/python tools/screenshots.py _build/html _build/screenshots
