"""Credentials never travel in URLs: the one check and the one redaction of them.

A URL may name a user but not carry a secret in a query option (``?password=...``,
``?token=...``), at any depth: an option's value that is itself a URL (a FeatureStore URL's
``registry=postgresql://...``) is checked the same way. Passwords come from the environment
(``PGPASSWORD``, ``REDIS_PASSWORD``, ``.pgpass``, a Kubernetes Secret). :func:`redact_url`
and :func:`redact_text` replace whatever secret a URL carries by ``***`` before it is
printed, logged or written; :func:`credential_problems` names what a URL carries without its
value.
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"
"""What a secret is replaced with in anything printed."""

SECRET_WORDS = (
    "password",
    "passwd",
    "pwd",
    "secret",
    "token",
    "credential",
    "apikey",
    "accesskey",
    "signature",
    "auth",
)
"""An option whose name contains one of these (ignoring ``-``, ``_`` and case) is a secret."""

SECRET_PARTS = frozenset({"key", "pass", "sig", "sas"})
"""An option with one of these as a whole ``_``/``-``-separated part of its name (``key``,
``access_key``, ``sas``) is a secret too."""

_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_USERINFO = re.compile(r"([^\s:/@'\"=]+):(?!\*\*\*@)[^\s/@'\"]+@")
_MAX_DEPTH = 8


def is_secret_option(name: str) -> bool:
    """Whether a query option called ``name`` holds a credential."""
    lowered = name.lower()
    squashed = lowered.replace("-", "").replace("_", "")
    if any(word in squashed for word in SECRET_WORDS):
        return True
    return any(part in SECRET_PARTS for part in re.split(r"[-_.]", lowered))


def credential_problems(url: str, _depth: int = 0) -> list[str]:
    """What credentials ``url`` carries, described without their values; [] for none.

    Looks at the userinfo's password, every query option's name, and every option value
    that is itself a URL (recursively).
    """
    if _depth > _MAX_DEPTH or "://" not in url:
        return []
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return ["an unparseable URL"]
    where = "" if _depth == 0 else f" (in a URL nested {_depth} deep)"
    problems = [f"a password{where}"] if password else []
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if is_secret_option(key):
            problems.append(f"the query option {key!r}{where}")
        else:
            problems += credential_problems(value, _depth + 1)
    return problems


def check_no_credentials(name: str, url: str) -> None:
    """Refuse a URL that carries a password or a secret option, at any depth.

    Args:
        name: what the URL is (``store_url``, ``--store``): named in the error.
        url: the URL.

    Raises:
        ValueError: naming ``name`` and what it carries, never the value.
    """
    problems = credential_problems(url)
    if problems:
        raise ValueError(
            f"{name} carries {', '.join(problems)}; remove it and put the credential into the "
            "environment or the credentials Secret (PGPASSWORD, REDIS_PASSWORD, ...)"
        )


def redact_url(url: str, _depth: int = 0) -> str:
    """``url`` with every secret it carries replaced by ``***``.

    Masks the userinfo's password, the values of secret options and, recursively, the
    secrets of URLs nested in option values; an unparseable URL becomes ``<unparseable URL>``.
    """
    if "://" not in url or _depth > _MAX_DEPTH:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if password is not None:
        user, _, host = netloc.rpartition("@")
        name = user.partition(":")[0]
        netloc = f"{name}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        redacted = [
            (k, MASK if is_secret_option(k) else redact_url(v, _depth + 1)) for k, v in pairs
        ]
        if redacted != pairs:
            query = urllib.parse.urlencode(redacted, safe="*:/@")
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def urls_in(text: str) -> list[str]:
    """The URLs (``scheme://...``) written in ``text``."""
    return _URL_IN_TEXT.findall(text) if "://" in text else []


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    if "@" in text:  # user:password@host without a scheme
        text = _USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    return text
