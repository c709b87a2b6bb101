"""The shared secret of the data and admin ports: one way to read a token file and one
constant-time comparison, for the daemon, its admin API, the CLI, kvperf and the
engine connectors."""
from __future__ import annotations

import hmac

TOKEN_FILE_BYTES_MAX = 4096  # a token file is one secret line, not a document


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and the problem."""


def read_token_file(path: str) -> str:
    """The token in ``path``, surrounding whitespace stripped."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(TOKEN_FILE_BYTES_MAX + 1)
    except OSError as exc:
        raise TokenFileError(f"token_file {path}: {exc.strerror}") from None
    if len(raw) > TOKEN_FILE_BYTES_MAX:
        raise TokenFileError(f"token_file {path}: longer than {TOKEN_FILE_BYTES_MAX} bytes")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"token_file {path}: not UTF-8 text") from None
    if not token:
        raise TokenFileError(f"token_file {path}: empty")
    return token


def token_matches(presented: str | None, expected: str | None) -> bool:
    """Whether ``presented`` is the configured token (any, when none is configured), in
    time that does not depend on where they differ."""
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())
