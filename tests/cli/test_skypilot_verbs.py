"""The verbs a SkyPilot user types get ours, as a one-line usage error (exit 2), through the real entry point."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize(
    "args, ours",
    [
        (["queue"], "`dflashctl ls`"),
        (["jobs"], "`dflashctl ls`"),
        (["cancel", "myjob"], "`dflashctl kill`"),
        (["status", "-a"], "`dflashctl ls`"),
        (["--debug", "queue"], "`dflashctl ls`"),
    ],
)
def test_skypilots_verbs_are_answered_with_ours(args, ours):
    res = run_cli(*args)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "did you mean" in lines[0] and ours in lines[0], res.stderr
    assert res.stdout == ""


def test_our_own_commands_that_share_words_are_untouched():
    res = run_cli("diagnose", "--help")
    assert res.code == 0 and "did you mean" not in res.stderr
