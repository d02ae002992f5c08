"""The remote agent: what dflashctl runs on a host, as one stdlib-only package (Python 3.8+, nothing installed there).

    python3 agent.pyz probe REQUEST_JSON [GPU_CSV APPS_CSV]   one action on a job or the host (probe.py)
    python3 agent.pyz release REQUEST_JSON < tar              an atomic, verified release (release.py)
    python3 agent.pyz launch RUN_DIR [ARGS...]                the job's keeper in its tmux pane (launcher.py)

The client ships it as one zipapp (dflashctl/remote/agent_bundle.py), checked by its SHA-256 on arrival; its modules
import nothing outside the standard library and this package (tests/test_layers.py), and share common.py.
"""
