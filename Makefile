# Two commands do everything on a fresh machine with Python 3.11:
#   make book   build the HTML book in _build/html, executing every cell
#   make test   run the module's tests and a full strict build
# The environment lives in .venv/ and is created on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

# A strict, complete build: every page re-read (--all), warnings are errors (-W),
# references nitpicky (-n), and all warnings reported before failing (--keep-going).
JB_FLAGS := --all -W -n --keep-going

.PHONY: book test test-code clean serve venv chapter

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

book: $(STAMP)
	rm -rf _build/html _build/.doctrees _build/jupyter_execute
	$(BIN)/jupyter-book build . $(JB_FLAGS)

# The module's tests first (fast), then the whole book, strictly.
test: $(STAMP)
	$(BIN)/python -m pytest

test-code: $(STAMP)
	$(BIN)/python -m pytest -m "not book"

serve: book
	@echo "Serving _build/html at http://localhost:$(PORT) (Ctrl-C to stop)"
	$(BIN)/python -m http.server $(PORT) --directory _build/html

clean:
	rm -rf _build .pytest_cache .hypothesis
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

# Execute one chapter as the build does and list its slowest cells: make chapter NAME=03-scaling
chapter: $(STAMP)
	$(BIN)/python tests/run_chapter.py chapters/$(NAME).md --cells
