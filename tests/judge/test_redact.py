"""Secrets masked whole and line by line (judge/redact.py), found again from fingerprints once scrubbed; a run dir's
secrets read from its files and scrubbed from every one of them (agent/common.py), in every form a program prints
them. Real files."""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

from dflashctl.agent import common
from dflashctl.judge.redact import MASK, Redactor, pieces, url_secrets

PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEF\nq1w2e3r4t5y6u7i8o9p0\n-----END PRIVATE KEY-----\n"
CRED = json.dumps({"type": "service_account", "private_key": "abc'def\nghijklmnop", "client_id": "1234567890"})


def test_a_multi_line_value_is_masked_whole_and_line_by_line():
    r = Redactor(["hf_tokenvalue1", PEM, "ab"])  # "ab": too short to search for, left alone
    text = f"token=hf_tokenvalue1 and a key:\n{PEM}one line of it: q1w2e3r4t5y6u7i8o9p0 ab"
    out = r(text)
    assert "hf_tokenvalue1" not in out and "MIIEvQIBADANBgkqhkiG9w0BAQEF" not in out and "q1w2e3r4" not in out
    assert out.startswith(f"token={MASK} and a key:\n{MASK}") and out.endswith(f"one line of it: {MASK} ab")
    # as a JSON string the key's lines are joined by \n: each is still found
    assert "MIIEvQ" not in r(json.dumps({"pem": PEM}))
    assert r.deep({"a": ["x hf_tokenvalue1"], "n": 3, "hf_tokenvalue1": True}) == {
        "a": [f"x {MASK}"],
        "n": 3,
        "hf_tokenvalue1": True,
    }
    assert pieces(MASK) == [] and not Redactor([MASK, "", "abc"])


def test_a_secret_cut_by_a_read_boundary_is_masked_at_either_edge():
    r = Redactor(["hf_tokenvalue1"])
    assert r.chunk("...token=hf_token") == f"...token={MASK}"
    assert r.chunk("envalue1 more") == f"{MASK} more"
    assert r.chunk("plain text") == "plain text"


def test_fingerprints_find_the_same_pieces_with_no_plain_value_kept():
    salt = os.urandom(16)
    kept = Redactor(["hf_tokenvalue1", PEM]).fingerprints(salt)
    assert "hf_tokenvalue1" not in json.dumps(kept) and "MIIEvQ" not in json.dumps(kept)
    r = Redactor(salt=kept["salt"], hashed=kept["hashed"], lengths=kept["lengths"])
    out = r(f"x=hf_tokenvalue1;\n{PEM}")
    assert "hf_tokenvalue1" not in out and "MIIEvQ" not in out and "q1w2e3r4t5" not in out and out.startswith("x=")
    # another salt finds nothing: a fingerprint is of this run dir alone
    other = Redactor(salt=os.urandom(16).hex(), hashed=kept["hashed"], lengths=kept["lengths"])
    assert other("x=hf_tokenvalue1") == "x=hf_tokenvalue1"


def test_a_webhook_urls_path_and_token_are_secret_its_host_is_not():
    parts = url_secrets("https://hooks.slack.com/services/T000/B000/XXXXsecretXXXX?token=abcdefgh12")
    r = Redactor(parts)
    said = r(
        "posting to https://hooks.slack.com/services/T000/B000/XXXXsecretXXXX?token=abcdefgh12 failed; "
        "token abcdefgh12, path part XXXXsecretXXXX"
    )
    assert "XXXXsecretXXXX" not in said and "abcdefgh12" not in said and "hooks.slack.com" not in said
    assert r("hooks.slack.com is up") == "hooks.slack.com is up"


def write_run(tmp_path: Path, env: dict[str, str], names: list[str], hook: str | None = None) -> Path:
    """A run dir as a launch writes it: job.json naming the secrets, run.sh with the exports (shlex-quoted, as
    remote/session.py writes them), job.env NUL-separated, supervise.json with the webhook."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "job.json").write_text(json.dumps({"id": "j", "secret_names": names, "job": {"watch": {}}}))
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    (run / "run.sh").write_text(f'#!/usr/bin/env bash\nRUN="$(cd "$(dirname "$0")" && pwd)"\n{exports}\necho hi\n')
    (run / "job.env").write_bytes("".join(f"{k}={v}\0" for k, v in env.items()).encode())
    if hook:
        (run / "supervise.json").write_text(json.dumps({"job_id": "j", "notify": {"webhook": hook}}))
    for f in run.iterdir():
        f.chmod(0o600)
    return run


def test_scrub_leaves_no_line_of_a_multi_line_secret_in_run_sh_or_job_env(tmp_path):
    env = {"PLAIN": "visible", "HF_TOKEN": "hf_tokenvalue1", "PEM_KEY": PEM, "GCP_CREDENTIAL": CRED}
    run = write_run(tmp_path, env, ["HF_TOKEN", "PEM_KEY", "GCP_CREDENTIAL"], "https://h.example/hook/s3cretPath99")
    assert set(common.secret_values(str(run))) >= {"hf_tokenvalue1", PEM, CRED}
    done = common.scrub_secrets(str(run))
    assert done == ["GCP_CREDENTIAL", "HF_TOKEN", "PEM_KEY"]
    secrets = [
        "hf_tokenvalue1",
        "MIIEvQIBADANBgkqhkiG9w0BAQEF",
        "q1w2e3r4t5y6u7i8o9p0",
        "ghijklmnop",
        "1234567890",
        "s3cretPath99",
    ]
    for f in run.iterdir():
        text = f.read_bytes().decode()
        assert [s for s in secrets if s in text] == [], f.name
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name
    script = (run / "run.sh").read_text()
    assert "export PLAIN=visible" in script and "export PEM_KEY='***'" in script and script.endswith("echo hi\n")
    records = (run / "job.env").read_bytes().split(b"\0")
    assert b"PLAIN=visible" in records and b"HF_TOKEN=***" in records
    # what stays finds them in the job's own log: the fingerprints, not the values
    r = common.job_redactor(str(run))
    assert r(f"token hf_tokenvalue1\n{PEM}") == f"token {MASK}\n{MASK}\n"
    assert common.scrub_secrets(str(run)) == []  # twice: nothing left to scrub, nothing broken


def test_a_secret_is_masked_in_every_form_a_program_prints_it():
    """Percent-encoded (quote, quote_plus: a password in a database URL as SQLAlchemy prints it), JSON-escaped, and
    base64 (whole, and inside a longer base64 text such as an Authorization header); from fingerprints too."""
    import base64
    from urllib.parse import quote, quote_plus

    secret = 'p@ss/w0rd+"x y'
    r = Redactor([secret])
    printed = [
        f"postgresql://app:{quote_plus(secret)}@db:5432/x",
        f"url=https://h/?k={quote(secret, safe='')}",
        f"path /{quote(secret)}",
        json.dumps({"password": secret}),
        base64.b64encode(secret.encode()).decode(),
        "Authorization: Basic " + base64.b64encode(f"app:{secret}".encode()).decode(),
        "Basic " + base64.b64encode(f"a:{secret}".encode()).decode(),
        "Basic " + base64.b64encode(f"ab:{secret}".encode()).decode(),
    ]
    hashed = Redactor((), **{k: v for k, v in r.fingerprints(b"0123456789abcdef").items()})
    for text in printed:
        for who in (r, hashed):
            out = who(text)
            assert MASK in out, (text, out)
            assert secret not in out and quote_plus(secret) not in out and quote(secret, safe="") not in out
            assert base64.b64encode(secret.encode()).decode()[:-4] not in out
