# One command sets up a fresh machine and runs the tests: `make test`.
# torch is pinned to 2.13.0 here because that release is a CPU build; an unpinned torch pulls a CUDA build of
# several GB. The code itself supports torch >= 2.6.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# command:package pairs. The demo runs on the built-in `local` host: tmux and git are all it needs. The tests add a
# real OpenSSH server on loopback (and rsync, which `doctor` looks for), and Slurm's daemons and munge for their
# one-machine cluster (tests/slurm_cluster.py) and nothing else: where apt cannot install those, the Slurm tests skip
# and say why, and the rest runs.
DEMO_DEPS := tmux:tmux git:git
TEST_DEPS := sshd:openssh-server ssh:openssh-client rsync:rsync
SLURM_DEPS := slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge

.PHONY: test test-fast lint bytecode system-deps test-deps venv demo docs clean

define missing_of
missing=""; for p in $(1); do cmd=$${p%%:*}; pkg=$${p##*:}; \
  command -v $$cmd >/dev/null 2>&1 || [ -x /usr/sbin/$$cmd ] || missing="$$missing $$pkg"; done
endef

# what `make demo` needs
system-deps:
	@$(call missing_of,$(DEMO_DEPS)); \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# what `make test` needs besides
test-deps: system-deps
	@$(call missing_of,$(TEST_DEPS)); \
	if [ -n "$$missing" ]; then \
	  echo "installing (for the tests):$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@$(call missing_of,$(SLURM_DEPS)); \
	if [ -n "$$missing" ]; then \
	  echo "installing (for the Slurm tests):$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) || \
	    echo "could not install$$missing: the Slurm tests will skip"; \
	fi

# --no-compile: pip byte-compiles every package it installs one file at a time (24 of torch's 36 s here, 60 s of the
# virtualenv's 120), 2,600 unused model folders of transformers among them; `bytecode` compiles what is used, on
# every core.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH_CPU)"
	$(PY) -m pip install -q --no-compile -e ".[trainer,report,tensorboard,dev]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check dflashctl trainer tests bench
	$(VENV)/bin/ruff format --check dflashctl trainer tests bench

# Three workers, one test module at a time each: the end-to-end tests spend much of their time waiting on processes
# (a job's interval, a stall threshold, a backoff). With two on a 2-core machine the cores stood idle a fifth of the
# suite (947 s); with three, under a tenth (docs/benchmarks.md, "Round 15: the suite's time, two workers or three").
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?= --durations=30

# Bytecode must exist before the suite: where PYTHONDONTWRITEBYTECODE is set (CI sets it) nothing is cached at
# import, and every process (each CLI call, each trainer rank) would compile what it imports again: 6 s -> 17 s a
# trainer start. The installed packages once per virtualenv, on every core (skipped: transformers' model folders
# other than the ones the trainer loads, pip, test suites); the project's own files at each run (an editable
# install compiles none of them).
BYTECODE_SKIP := transformers/models/(?!auto/|qwen3/)|/(pip|setuptools|torch/testing/_internal)/|/tests?/
$(VENV)/.bytecode: $(VENV)/.installed
	$(PY) -m compileall -q -j 0 -x '$(BYTECODE_SKIP)' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null
	touch $@

bytecode: $(VENV)/.bytecode
	$(PY) -m compileall -q -j 0 dflashctl trainer tests bench > /dev/null

# The system packages and the virtualenv are independent: apt and pip run side by side (two jobs).
test:
	$(MAKE) -j2 test-deps venv
	$(MAKE) lint bytecode
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: venv
	$(VENV)/bin/pytest -q -m "not slow"

# The main job on this machine: deploy to the built-in `local` host, launch the tiny CPU trainer job (two ranks under
# torchrun), follow it to the end and summarise it.
demo: system-deps venv bytecode
	$(VENV)/bin/dflashctl deploy local
	$(VENV)/bin/dflashctl launch jobs/tiny-cpu.yaml
	$(VENV)/bin/dflashctl watch --until-done
	$(VENV)/bin/dflashctl status
	$(VENV)/bin/dflashctl report

# The one-page command reference, generated from the CLI itself (a test checks that it is current).
docs: venv
	$(PY) -m dflashctl.reference > docs/commands.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
