"""A test PKI (a CA, server and client certificates) and the real server on wss:// addresses."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.ws_harness import WsServerProcess

Key = ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str, key: Key, issuer: tuple[str, Key] | None, ca: bool, ip: str | None = None
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca = _cert("test CA", self.ca_key, None, ca=True)
        self.client_ca_key = ec.generate_private_key(ec.SECP256R1())
        self.client_ca = _cert("client CA", self.client_ca_key, None, ca=True)
        other_key = ec.generate_private_key(ec.SECP256R1())
        self.other_ca = _cert("other CA", other_key, None, ca=True)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server = _cert("server", server_key, ("test CA", self.ca_key), ca=False, ip="127.0.0.1")
        client_key = ec.generate_private_key(ec.SECP256R1())
        client = _cert("client", client_key, ("client CA", self.client_ca_key), ca=False)
        second_key = ec.generate_private_key(ec.SECP256R1())
        second = _cert("second", second_key, ("client CA", self.client_ca_key), ca=False)
        self.ca_file = self._pem("ca.pem", self.ca)
        self.client_ca_file = self._pem("client-ca.pem", self.client_ca)
        self.other_ca_file = self._pem("other-ca.pem", self.other_ca)
        self.server_cert = self._pem("server.pem", server)
        self.server_key = self._key("server.key", server_key)
        self.client_cert = self._pem("client.pem", client)
        self.client_key = self._key("client.key", client_key)
        self.second_cert = self._pem("second.pem", second)
        self.second_key = self._key("second.key", second_key)

    def _pem(self, name: str, cert: x509.Certificate) -> str:
        path = self.root / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    def _key(self, name: str, key: Key) -> str:
        path = self.root / name
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)
        return str(path)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def start_wss(pki: Pki, *extra: str) -> WsServerProcess:
    return await WsServerProcess.start(
        "--listen",
        "wss://127.0.0.1:0",
        "--tls-cert",
        pki.server_cert,
        "--tls-key",
        pki.server_key,
        *extra,
    )
