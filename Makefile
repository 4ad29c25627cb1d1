# Newcomer commands: `make demo` and `make test`. Both create .venv/ when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU wheel by default (see constraints.txt); `make test TORCH_SPEC=` keeps an already installed torch.
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS := $(if $(TORCH_SPEC),-c constraints.txt,)

.PHONY: demo test install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[plot]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(PY)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(VENV)/bin/groupwise train

# pytest exits 5 when it collects no test; that is not a failure of the suite itself.
test: $(VENV)/.installed-dev
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
