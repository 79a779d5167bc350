"""A throwaway certificate authority for local mTLS: one CA, and certificates it signs for the
services (server and client use both), written as PEM files.

For tests and local demos only (tests/rpc/test_tls.py, tests/e2e/test_topology.py, and
`mili serve --tls-demo`, which writes `write_demo`'s files into a temporary directory it
removes on exit): keys are made fresh each time and never leave the directory they are
written to. A real deployment brings its own CA (cert-manager, a Kubernetes Secret; see
deploy/kubernetes/).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=2)  # throwaway: long enough for a demo, short if it leaks


@dataclass(frozen=True)
class CertFiles:
    """PEM files of one certificate: --tls-cert, --tls-key, and the CA for --tls-ca."""

    cert: Path
    key: Path
    ca: Path


class Authority:
    """A CA made in memory; `issue` signs leaf certificates for names and IPs."""

    def __init__(self, common_name: str = "MILI throwaway CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self._name = name
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, common_name: str, names: Sequence[str], valid: datetime.timedelta = _VALID
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for `names` (DNS names or IP literals), usable
        as a server and as a client certificate for `valid` from now (negative: expired, for
        tests)."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(min(now, now + valid) - datetime.timedelta(minutes=5))
            .not_valid_after(now + valid)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def write(
        self,
        directory: Path,
        stem: str,
        names: Sequence[str],
        valid: datetime.timedelta = _VALID,
    ) -> CertFiles:
        """Issue a certificate for `names` (see `issue`) and write DIR/STEM.crt, DIR/STEM.key
        (mode 0600) and DIR/ca.crt."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(stem, names, valid)
        ca = directory / "ca.crt"
        ca.write_bytes(self.cert_pem)
        cert_path = directory / f"{stem}.crt"
        cert_path.write_bytes(cert)
        key_path = directory / f"{stem}.key"
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        return CertFiles(cert=cert_path, key=key_path, ca=ca)


# `mili serve --tls-demo`: one certificate per service (each also a client of the others), and
# one for clients outside (grpcurl, mili generate/bench) and for mili serve's health checks.
DEMO_STEMS = ("tokenizer", "prefill", "decode", "frontend", "client")


def write_demo(directory: Path, names: Sequence[str]) -> dict[str, CertFiles]:
    """A fresh CA and a certificate for every stem of DEMO_STEMS, each valid for `names`
    (the addresses the services are dialled by), written into `directory`."""
    authority = Authority("MILI tls-demo CA")
    return {stem: authority.write(directory, stem, names) for stem in DEMO_STEMS}
