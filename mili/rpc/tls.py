"""TLS between the services and on the public port: certificates read once, credentials made
from them.

    --tls-cert FILE --tls-key FILE   this process's certificate (PEM chain) and private key:
                                     its server port speaks TLS, and its client channels
                                     present the certificate to the services they call
    --tls-ca FILE                    the CA that signs every MILI certificate: a server port
                                     then requires a client certificate it signed (mTLS), and
                                     clients verify servers against it (else the system roots)

A peer dialled by address is verified against the name it was dialled by; an instance found
through `dns:///NAME:PORT` is dialled by IP and verified against NAME (so one certificate for
the headless Service's name covers every pod behind it).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """The three flags, as given (any may be None)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")

    @property
    def is_enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def load(self) -> Tls:
        """Read every file now (ValueError naming the file when one cannot be read, or when
        the key is not the certificate's: grpc only failed to bind, "is the port in use?")."""
        tls = Tls(
            cert=_read(self.cert, "--tls-cert"),
            key=_read(self.key, "--tls-key"),
            ca=_read(self.ca, "--tls-ca"),
        )
        if self.cert is not None and self.key is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            except ssl.SSLError as e:
                raise ValueError(
                    f"--tls-key {self.key} is not the key of --tls-cert {self.cert}: {e.reason}"
                ) from None
        return tls


@dataclass(frozen=True)
class Tls:
    """PEM bytes of the certificate chain, its key and the CA (each None when not given)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate needs its key, and a key its certificate")

    def server_credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        """A server port's credentials; `require_client_auth`: only clients with a certificate
        the CA signed complete the handshake (others are refused before any call)."""
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server port needs --tls-cert and --tls-key")
        if require_client_auth and self.ca is None:
            raise ValueError("verifying client certificates needs --tls-ca")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if require_client_auth else None,
            require_client_auth=require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: verify servers against the CA (or the system roots), present our
        certificate when we have one."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data
