# Two entry points, both self-contained on a fresh machine:
#   make run   -> venv + install + `batchgen run` on examples/requests.jsonl with the default model
#   make test  -> venv + install + the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch (an unpinned torch would pull a multi-GB CUDA build). On this
# project's machines pip finds the 2.13.0 CPU wheel locally; elsewhere point pip at PyTorch's
# CPU wheel index: make test TORCH_INDEX="--index-url <PyTorch CPU wheel index URL>"
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install run test clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX) "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/batchgen run -i examples/requests.jsonl -o results.jsonl

test: install
	$(BIN)/python -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) results.jsonl
