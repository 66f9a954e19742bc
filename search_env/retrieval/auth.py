"""Bearer tokens of the retrieval server: one token file read by the server and by every client.

The file holds one token per line (blank lines and lines starting with `#` are skipped); the server
accepts any of them, a client sends the first. A file that group or others can read is refused, so a
token is never shared by accident on a multi-user host. Mechanism: docs/security.md.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

AUTH_HEADER = "authorization"
MIN_TOKEN_CHARS = 16


class AuthFileError(ValueError):
    """The token file is missing, empty, too open or holds a token that is too short."""


def load_tokens(path: str | os.PathLike[str]) -> list[str]:
    """The tokens of ``path``; AuthFileError naming the file and the fix when it is unreadable,
    readable by group or others (mode & 0o077), empty, or holds a token under 16 characters."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AuthFileError(f"auth token file {p}: cannot read it ({err})") from None
    if mode & 0o077:
        raise AuthFileError(
            f"auth token file {p} has mode {stat.filemode(mode)}: group and others can read it; "
            f"run `chmod 600 {p}`"
        )
    tokens = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not tokens:
        raise AuthFileError(
            f'auth token file {p} holds no token; write one, e.g. `python -c "import secrets; '
            f'print(secrets.token_urlsafe(32))" > {p}`'
        )
    short = [i for i, t in enumerate(tokens) if len(t) < MIN_TOKEN_CHARS or any(c.isspace() for c in t)]
    if short:
        raise AuthFileError(
            f"auth token file {p}: token {short[0] + 1} is shorter than {MIN_TOKEN_CHARS} characters or "
            "holds a space; use e.g. secrets.token_urlsafe(32)"
        )
    return tokens


def bearer_headers(path: str | os.PathLike[str] | None) -> dict[str, str]:
    """The HTTP headers a client sends: ``{"Authorization": "Bearer <first token>"}``, or ``{}``
    when ``path`` is None or empty (no auth)."""
    if not path:
        return {}
    return {"Authorization": f"Bearer {load_tokens(path)[0]}"}


def token_matches(header: str | None, tokens: list[str]) -> bool:
    """Whether an ``Authorization`` header value carries one of ``tokens``, compared in constant
    time (every token is compared, so the time does not tell which one was near)."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer ") :].strip().encode("utf-8", "surrogatepass")
    found = False
    for token in tokens:
        found |= hmac.compare_digest(given, token.encode("utf-8"))
    return found
