"""Bearer-token authentication of WebSocket upgrades (and ``GET /metrics``).

Tokens come from ``--auth-token-file`` (one per line, so that a new token
can be added before the old one is removed) or from the environment
variable ``EXEC_SERVER_AUTH_TOKEN``, which is removed from the server's own
environment once read so that no child can inherit it.

A token is never logged, rendered or compared in variable time: the
identity a connection gets is :class:`TokenIdentity`, a label derived from
a keyed hash of the token, and sessions are owned by that identity.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import stat
from typing import Any, Final

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger

log = Logger()

TOKEN_ENV: Final = "EXEC_SERVER_AUTH_TOKEN"

#: Longest accepted token (a line of the file); longer lines are refused at load.
MAX_TOKEN_BYTES: Final = 4096


class AuthConfigError(Exception):
    """The token source cannot be used; the message says why (never the token)."""


@attrs.frozen
class TokenIdentity:
    """Who authenticated: a stable label of the token, never the token itself."""

    label: str

    def __str__(self) -> str:
        return self.label


def identity_of(token: bytes) -> TokenIdentity:
    # A hash prefix is enough to tell tokens apart in logs and to own
    # sessions; 96 bits cannot be searched back to a usable token.
    digest = hashlib.sha256(b"exec-server token identity\0" + token).hexdigest()
    return TokenIdentity(f"token:{digest[:24]}")


def parse_tokens(text: bytes, source: str) -> tuple[bytes, ...]:
    """The tokens of a token file: one per line; blank lines and ``#`` comments skipped."""
    tokens = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if len(line) > MAX_TOKEN_BYTES:
            raise AuthConfigError(
                f"{source} line {number}: a token is longer than {MAX_TOKEN_BYTES} bytes"
            )
        if any(c < 0x21 or c > 0x7E for c in line):
            raise AuthConfigError(
                f"{source} line {number}: a token must be printable ASCII without spaces"
            )
        tokens.append(line)
    if not tokens:
        raise AuthConfigError(f"{source} holds no token")
    return tuple(tokens)


def read_token_file(path: str) -> tuple[bytes, ...]:
    """Read and check a token file: it must not be readable or writable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise AuthConfigError(f"cannot read --auth-token-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise AuthConfigError(f"--auth-token-file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise AuthConfigError(
                f"--auth-token-file {path} is accessible by group or other users "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); refusing to start: "
                f"run `chmod 600 {path}`"
            )
        return parse_tokens(f.read(), f"--auth-token-file {path}")


class TokenStore:
    """The accepted tokens; :meth:`reload` re-reads the file (SIGHUP)."""

    def __init__(self, tokens: tuple[bytes, ...], path: str | None = None) -> None:
        self._set(tokens)
        self.path = path

    def _set(self, tokens: tuple[bytes, ...]) -> None:
        # Digests are compared, not the tokens: equal lengths, so not even
        # a token's length shows in the comparison time.
        self._digests = tuple((hashlib.sha256(t).digest(), t) for t in tokens)

    @classmethod
    def from_file(cls, path: str) -> TokenStore:
        return cls(read_token_file(path), path)

    @classmethod
    def from_environment(cls, environ: dict[str, str] | os._Environ[str]) -> TokenStore | None:
        """The store of ``EXEC_SERVER_AUTH_TOKEN`` (removed from ``environ``), or None."""
        value = environ.pop(TOKEN_ENV, None)
        if value is None:
            return None
        return cls(parse_tokens(value.encode("utf-8", "surrogateescape"), f"${TOKEN_ENV}"))

    @property
    def count(self) -> int:
        return len(self._digests)

    def reload(self) -> None:
        """Re-read the file; on error keep the old tokens and raise :class:`AuthConfigError`."""
        if self.path is not None:
            self._set(read_token_file(self.path))

    def authenticate(self, authorization: str | None) -> TokenIdentity | None:
        """The identity of an ``Authorization: Bearer TOKEN`` header value, or None."""
        if authorization is None:
            return None
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = hashlib.sha256(credential.strip().encode("latin-1", "replace")).digest()
        found: bytes | None = None
        # Every token is compared, each in constant time, so the time taken
        # does not tell which (or whether a) token matched.
        for digest, token in self._digests:
            if hmac.compare_digest(presented, digest) and found is None:
                found = token
        return None if found is None else identity_of(found)


class TokenReloadService(Service):
    """Re-reads the token file on SIGHUP; connections keep the identity they have."""

    def __init__(self, store: TokenStore, reactor: IReactorThreads) -> None:
        self.store = store
        self.reactor = reactor
        self._previous: Any = None

    def startService(self) -> None:
        super().startService()
        self._previous = signal.signal(signal.SIGHUP, self._on_signal)

    def stopService(self) -> None:
        super().stopService()
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame: object) -> None:
        # A signal handler runs between bytecodes: hand the work to the reactor.
        self.reactor.callFromThread(self.reload)

    def reload(self) -> None:
        try:
            self.store.reload()
        except AuthConfigError as exc:
            log.error("SIGHUP: keeping the previous tokens: {error}", error=str(exc))
            return
        log.info(
            "SIGHUP: {count} token(s) loaded from {path}",
            count=self.store.count,
            path=self.store.path,
        )
