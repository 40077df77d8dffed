VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench gpu-check clean browser

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m smpart.cli demo

# Two pytest workers: a test's ranks wait on each other (spawns, rendezvous, timeouts) more than
# they compute, so on two cores the suite takes ~8.5 minutes instead of ~11.5 (TEST_WORKERS=0: one).
TEST_WORKERS ?= 2

test: browser $(STAMP)
	$(PY) -m ruff check smpart tests bench examples
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The page tests drive Debian's chromium. Installed here when this machine can (root, apt-get),
# otherwise `make test` stops at once with the command to run; instant when it is already there.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || [ "$$SMPART_SKIP_BROWSER" = 1 ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium for the page tests (apt-get)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq chromium >/dev/null && command -v chromium >/dev/null; \
	  else \
	    echo "the page tests need Chromium; run:  sudo apt-get update && sudo apt-get install -y chromium" >&2; \
	    echo "(or skip them: SMPART_SKIP_BROWSER=1 make test)" >&2; \
	    exit 1; \
	  fi; }

lint: $(STAMP)
	$(PY) -m ruff check smpart tests bench examples

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# On a machine with a CUDA GPU: the CUDA tests and the GPU benchmarks, one command.
gpu-check: $(STAMP)
	PY=$(PY) bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
