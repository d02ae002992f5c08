# One command sets up a fresh machine and runs the tests: `make test`.
# torch is pinned to 2.13.0 here because that release is a CPU build; an unpinned torch pulls a CUDA build of
# several GB. The code itself supports torch >= 2.6.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# command:package pairs. The Slurm daemons and munge are for the tests' one-machine cluster (tests/slurm_cluster.py)
# and nothing else: where apt cannot install them, the Slurm tests skip and say why, and the rest runs.
REQUIRED_DEPS := sshd:openssh-server ssh:openssh-client tmux:tmux rsync:rsync git:git
SLURM_DEPS := slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge

.PHONY: test test-fast lint bytecode system-deps venv demo clean

define missing_of
missing=""; for p in $(1); do cmd=$${p%%:*}; pkg=$${p##*:}; \
  command -v $$cmd >/dev/null 2>&1 || [ -x /usr/sbin/$$cmd ] || missing="$$missing $$pkg"; done
endef

system-deps:
	@$(call missing_of,$(REQUIRED_DEPS)); \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@$(call missing_of,$(SLURM_DEPS)); \
	if [ -n "$$missing" ]; then \
	  echo "installing (for the Slurm tests):$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) || \
	    echo "could not install$$missing: the Slurm tests will skip"; \
	fi

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[trainer,report,tensorboard,dev]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check dflashctl trainer tests bench

# Two workers, one test module at a time each: the end-to-end tests spend much of their time waiting on processes,
# so two run side by side on a 2-core machine (about 1.5 cores busy on average).
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= --durations=30

# The project's own bytecode, written once: an editable install compiles none of it, and where
# PYTHONDONTWRITEBYTECODE is set every process (each CLI call, each trainer rank) would compile it again (0.2 s).
bytecode: venv
	$(PY) -m compileall -q -j 0 dflashctl trainer tests bench > /dev/null

test: system-deps venv lint bytecode
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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
