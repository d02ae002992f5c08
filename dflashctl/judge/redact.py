"""Secrets out of everything we write or show: every value the job file marks secret (env names holding TOKEN, KEY,
SECRET, PASSWORD..., its `secret_env`, the webhook URL's path and query) is replaced by `***` wherever job text
appears. A multi-line value (a PEM key, a JSON credential) is taken out whole and line by line, so a job that
prints it reflowed, or one line of it, still shows none of it.

Pure and stdlib only (the remote agent ships it and runs it on Python 3.8): the caller gives the values. After a job
has ended for good its plain values are scrubbed from the run dir; what stays is their fingerprints (salted sha256
of each piece and its length), which find the same pieces in text by sliding a window over it: slower, but no
secret at rest. A short value (under MIN_LEN characters) is left alone: masking every `1` in a log would hide the
log, not a secret.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus, unquote, urlsplit

MASK = "***"
MIN_LEN = 4  # a piece shorter than this is not searched for
_STARTS = re.compile(r"(?<![A-Za-z0-9])|(?=[^A-Za-z0-9])")  # where a fingerprinted piece may start (zero-width)
_B64_RUN = re.compile(r"[A-Za-z0-9+/]{9,}")  # a run that may hold a secret's base64 anywhere inside it


def pieces(value: str) -> list[str]:
    """What of one secret value must never appear: the value whole (without a trailing newline) and each of its
    lines (stripped), each also in every form a program prints it (`printed`), longest first so that the whole goes
    before its parts."""
    if not isinstance(value, str) or value == MASK:
        return []
    found = {value.strip("\r\n")}
    found |= {line.strip() for line in value.splitlines()}
    found |= {form for p in list(found) if len(p) >= MIN_LEN for form in printed(p)}
    return sorted((p for p in found if len(p) >= MIN_LEN), key=lambda p: (-len(p), p))


def printed(value: str) -> set[str]:
    """The forms programs print a value in, besides itself: percent-encoded as `quote` and `quote_plus` write it (a
    password inside a database URL, as SQLAlchemy prints one), JSON-escaped (a value inside a logged JSON string),
    and base64 (an Authorization: Basic header), whole and as the part of a longer base64 text that depends on the
    value alone (at each of the three alignments)."""
    forms = {quote(value, safe=""), quote(value), quote_plus(value), json.dumps(value)[1:-1]}
    raw = value.encode("utf-8", "surrogateescape")
    forms.add(base64.b64encode(raw).decode())
    for shift in range(3):  # inside a longer text: the characters fixed by the value's bytes alone
        enc = base64.b64encode(b"\0" * shift + raw).decode().rstrip("=")
        start = -(-shift * 4 // 3)  # the first character no earlier byte touches
        end = (shift + len(raw)) * 4 // 3  # the last character no later byte touches
        if end - start >= 8:
            forms.add(enc[start:end])
    forms.discard(value)
    return forms


def url_secrets(url: str) -> list[str]:
    """The secret parts of a webhook URL: the URL, its path and query (Slack and Discord put the token in the path,
    ntfy's topic is the path), each non-trivial path segment, and any user info. Scheme and host are not secret."""
    if not isinstance(url, str) or not url:
        return []
    parts = urlsplit(url)
    found = [url]
    if parts.path not in ("", "/"):
        found.append(parts.path + (f"?{parts.query}" if parts.query else ""))
        found.append(parts.path)
        found += [seg for seg in parts.path.split("/") if len(seg) >= 8]
    if parts.query:
        found.append(parts.query)
        found += [kv.split("=", 1)[1] for kv in parts.query.split("&") if "=" in kv and len(kv.split("=", 1)[1]) >= 8]
    if parts.password:
        found += [parts.password, unquote(parts.password)]
    if parts.username:
        found.append(unquote(parts.username))
    return [p for p in found if len(p) >= MIN_LEN]


def redact_url(url: str) -> str:
    """A webhook URL as every output shows it: `scheme://host:port/***` (its path and any user info are the
    credential; the port is kept, it tells two local listeners apart)."""
    if not isinstance(url, str):
        return f"?://?/{MASK}"
    parts = urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ":?"
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme or '?'}://{host}{port}/{MASK}"


def fingerprint(piece: str, salt: bytes) -> str:
    return hashlib.sha256(salt + piece.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class Redactor:
    """Replaces every secret piece in text by `***`: plain values (a live job's) and fingerprints (an ended one's).
    Callable on a string; `deep` walks JSON-like data (dict values, list items; keys are ours, left as they are)."""

    def __init__(
        self, values: Iterable[str] = (), salt: str = "", hashed: Iterable[str] = (), lengths: Iterable[int] = ()
    ) -> None:
        found: set[str] = set()
        for v in values:
            found.update(pieces(v))
        self.plain = sorted(found, key=lambda p: (-len(p), p))
        self.salt = bytes.fromhex(salt) if salt else b""
        self.hashed = {h for h in hashed if isinstance(h, str)}
        self.lengths = sorted({n for n in lengths if isinstance(n, int) and n >= MIN_LEN}, reverse=True)

    def __bool__(self) -> bool:
        return bool(self.plain or (self.hashed and self.lengths))

    def fingerprints(self, salt: bytes) -> dict:
        """What stays at rest once the plain values are scrubbed: the salt, each piece's fingerprint, their lengths."""
        return {
            "salt": salt.hex(),
            "hashed": sorted({fingerprint(p, salt) for p in self.plain}),
            "lengths": sorted({len(p) for p in self.plain}),
        }

    def __call__(self, text: str) -> str:
        if not isinstance(text, str) or not text:
            return text
        for p in self.plain:
            if p in text:
                text = text.replace(p, MASK)
        if self.hashed:
            text = self._unhash(text)
        return text

    def chunk(self, text: str) -> str:
        """A piece of a longer text (a log read from an offset): redacted, and a secret cut by either edge masked
        too: a start that is the end of a secret piece, an end that is its beginning."""
        text = self(text)
        if not isinstance(text, str) or not text:
            return text
        for p in self.plain:
            for k in range(len(p) - 1, MIN_LEN - 1, -1):
                if text.endswith(p[:k]):
                    text = text[:-k] + MASK
                    break
            for k in range(len(p) - 1, MIN_LEN - 1, -1):
                if text.startswith(p[-k:]):
                    text = MASK + text[k:]
                    break
        return text

    def _unhash(self, text: str) -> str:
        """Every window of a fingerprinted length whose fingerprint is known, masked (longest lengths first). A
        window starts where a secret can: at the text's start, after a character that is not a letter or digit
        (`=`, a space, a quote, a line's end), or at one that is not (a path's `/`): a fifth of the positions of a
        log, so a scrubbed job's log is still read in a fraction of a second."""
        for n in self.lengths:
            if len(text) < n:
                continue
            out, start = [], 0
            for m in _STARTS.finditer(text):
                i = m.start()
                if i < start or i + n > len(text):
                    continue
                if fingerprint(text[i : i + n], self.salt) in self.hashed:
                    out += [text[start:i], MASK]
                    start = i + n
            if out:
                out.append(text[start:])
                text = "".join(out)
        return self._unhash_base64(text)

    def _unhash_base64(self, text: str) -> str:
        """A secret's base64 inside a longer base64 text (`Basic dXNlcjpw...`) starts anywhere in it: every offset
        of the runs of base64 characters longer than a fingerprinted length is tried (rare and short in a log)."""
        for n in self.lengths:
            found = []
            for m in _B64_RUN.finditer(text):
                run = m.group(0)
                if len(run) <= n:
                    continue
                for i in range(1, len(run) - n + 1):
                    if fingerprint(run[i : i + n], self.salt) in self.hashed:
                        found.append((m.start() + i, m.start() + i + n))
                        break
            for a, b in reversed(found):
                text = text[:a] + MASK + text[b:]
        return text

    def deep(self, data):
        """`data` with every string in it redacted (a new structure; numbers, booleans and keys as they were)."""
        if not self:
            return data
        if isinstance(data, str):
            return self(data)
        if isinstance(data, dict):
            return {k: self.deep(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return [self.deep(v) for v in data]
        return data
