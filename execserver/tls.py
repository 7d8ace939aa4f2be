"""TLS for ``wss://`` listeners and clients, through Twisted's own TLS (``twisted[tls]``).

Twisted wraps pyOpenSSL (``CertificateOptions`` for servers,
``optionsForClientTLS`` with service_identity for clients); nothing here
speaks TLS itself. The minimum protocol version is TLS 1.2. pyOpenSSL is
imported only when TLS is used, so a server without it still serves
``ws://``, ``unix://`` and ``stdio://``, and says what to install when asked
for ``wss://``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final

import attrs

_PEM_CERT: Final = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL
)

MISSING_EXTRAS: Final = (
    "TLS needs Twisted's TLS extras (pyOpenSSL and service_identity): pip install 'twisted[tls]'"
)


class TlsConfigError(Exception):
    """A certificate, key or CA file cannot be used; the message names the file."""


def _ssl() -> Any:
    try:
        import OpenSSL  # noqa: F401
        import service_identity  # noqa: F401
        from twisted.internet import ssl
    except ImportError:
        raise TlsConfigError(MISSING_EXTRAS) from None
    return ssl


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TlsConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def _certificates(path: str, what: str) -> list[Any]:
    ssl = _ssl()
    blocks = _PEM_CERT.findall(_read(path, what))
    if not blocks:
        raise TlsConfigError(f"{what} {path} holds no PEM certificate")
    try:
        return [ssl.Certificate.loadPEM(block) for block in blocks]
    except Exception as exc:
        raise TlsConfigError(f"{what} {path}: not a valid certificate ({exc})") from None


@attrs.frozen
class ServerTls:
    """``--tls-cert`` (certificate, then any intermediates), ``--tls-key``, ``--tls-client-ca``."""

    cert_path: str
    key_path: str
    client_ca_path: str | None = None

    def options(self) -> Any:
        """The ``CertificateOptions`` of a ``wss://`` listener (checked: raises TlsConfigError)."""
        ssl = _ssl()
        from OpenSSL import crypto

        chain = _certificates(self.cert_path, "--tls-cert")
        try:
            key = ssl.KeyPair.load(_read(self.key_path, "--tls-key"), crypto.FILETYPE_PEM)
        except TlsConfigError:
            raise
        except Exception as exc:
            raise TlsConfigError(
                f"--tls-key {self.key_path}: not a PEM private key ({exc})"
            ) from None
        leaf = chain[0]
        if leaf.getPublicKey().keyHash() != key.keyHash():
            raise TlsConfigError(
                f"--tls-key {self.key_path} does not belong to the certificate in "
                f"--tls-cert {self.cert_path}"
            )
        verify: dict[str, Any] = {}
        if self.client_ca_path is not None:
            cas = _certificates(self.client_ca_path, "--tls-client-ca")
            verify = {
                "verify": True,
                "caCerts": [ca.original for ca in cas],
                "requireCertificate": True,
            }
        return ssl.CertificateOptions(
            privateKey=key.original,
            certificate=leaf.original,
            extraCertChain=[c.original for c in chain[1:]],
            raiseMinimumTo=ssl.TLSVersion.TLSv1_2,
            **verify,
        )


@attrs.frozen
class ClientTls:
    """What a client uses for ``wss://``: a CA file (else the system store), a certificate."""

    ca_file: str | None = None
    #: PEM certificate to present (mutual TLS); its key in ``client_key``
    #: or in the same file.
    client_cert: str | None = None
    client_key: str | None = None

    def options(self, host: str) -> Any:
        return client_options(host, self.ca_file, self.client_cert, self.client_key)


def client_options(
    host: str,
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> Any:
    """``optionsForClientTLS`` for ``host``: ``ca_file`` or the system's trust store."""
    ssl = _ssl()
    from OpenSSL import crypto

    trust: Any = None
    if ca_file is not None:
        cas = _certificates(ca_file, "CA file")
        trust = ssl.trustRootFromCertificates(cas)
    own: Any = None
    if client_cert is not None:
        certificate = _certificates(client_cert, "client certificate")[0]
        key_text = _read(client_key or client_cert, "client key")
        try:
            key = ssl.KeyPair.load(key_text, crypto.FILETYPE_PEM)
        except Exception as exc:
            raise TlsConfigError(f"client key: not a PEM private key ({exc})") from None
        own = ssl.PrivateCertificate.fromCertificateAndKeyPair(certificate, key)
    return ssl.optionsForClientTLS(
        host,
        trustRoot=trust,
        clientCertificate=own,
        extraCertificateOptions={"raiseMinimumTo": ssl.TLSVersion.TLSv1_2},
    )


def certificate_identity(transport: Any) -> str | None:
    """``cert:`` and a hash of the peer's certificate on a TLS transport, or None."""
    get = getattr(transport, "getPeerCertificate", None)
    if get is None:
        return None
    cert = get()
    if cert is None:
        return None
    from OpenSSL import crypto

    der = crypto.dump_certificate(crypto.FILETYPE_ASN1, cert)
    return "cert:" + hashlib.sha256(der).hexdigest()[:24]


def tls_error_text(error: BaseException | None) -> str | None:
    """The reasons of a pyOpenSSL error (``certificate verify failed``), or None if not one."""
    try:
        from OpenSSL import SSL
    except ImportError:
        return None
    if not isinstance(error, SSL.Error):
        return None
    details = error.args[0] if error.args and isinstance(error.args[0], list) else []
    reasons = [d[-1] for d in details if isinstance(d, tuple) and d and d[-1]]
    return "; ".join(str(r) for r in reasons) or str(error) or type(error).__name__
