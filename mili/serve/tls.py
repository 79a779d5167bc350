"""TLS for `mili serve`: its --tls-* flags (passed to every child, and used by its own health
checks of them), and --tls-demo's throwaway certificates.

    --tls-cert/--tls-key/--tls-ca  the same files for every child; the health checks present
                                   them and verify each child as the host it announced
    --tls-demo                     mili.rpc.certs.write_demo in a temporary directory, removed
                                   on exit: each service its own certificate (mTLS between
                                   them), the frontend's port plain TLS (clients need only the
                                   CA), `client.*` for the health checks and for users
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mili.errors import StartupError
from mili.rpc.tls import Tls, TlsFiles

if TYPE_CHECKING:
    from mili.rpc.certs import CertFiles  # cryptography: imported only for --tls-demo

CHILD_KINDS = ("tokenizer", "prefill", "decode", "frontend")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tls = parser.add_argument_group("TLS")
    tls.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help="every child's certificate chain (PEM): every port serves TLS; the children and "
        "mili serve's health checks present it; it must name --host (default: plaintext)",
    )
    tls.add_argument(
        "--tls-key", type=Path, default=None, metavar="FILE", help="its private key (PEM)"
    )
    tls.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="the CA certificate (PEM) that signed it: every port then requires client "
        "certificates it signed (mTLS; the frontend's: see serve-frontend --public-tls)",
    )
    tls.add_argument(
        "--tls-demo",
        action="store_true",
        help="make a throwaway CA and a certificate per service in a temporary directory "
        "(removed on exit): mTLS between the services, TLS on the frontend port; prints the "
        "grpcurl command line to call it",
    )


@dataclass(frozen=True)
class ChildTls:
    flags: dict[str, list[str]]  # by kind; a kind missing runs in plaintext
    health: Tls | None  # what the health checks dial with


def tls_plan(args: argparse.Namespace, demo: dict[str, CertFiles] | None) -> ChildTls:
    """Each kind of child's TLS flags, and what our health checks dial with (StartupError
    naming the flag when a file is missing or the flags do not fit together)."""
    given = args.tls_cert is not None or args.tls_key is not None or args.tls_ca is not None
    if demo is not None:
        if given:
            raise StartupError("--tls-demo makes its own certificates: drop --tls-cert/-key/-ca")
        flags_of = {kind: _tls_flags(files) for kind, files in demo.items()}
        flags_of["frontend"] += ["--public-tls", args.public_tls or "tls"]
        return ChildTls(flags_of, _load(demo["client"]))
    if not given:
        if args.public_tls not in (None, "off"):
            raise StartupError(f"--public-tls {args.public_tls} needs --tls-cert and --tls-key")
        return ChildTls({}, None)
    if args.tls_ca is not None and args.tls_cert is None:
        # The children would serve plaintext yet dial each other over TLS.
        raise StartupError("--tls-ca needs --tls-cert and --tls-key: every child serves TLS")
    try:
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca).load()
    except ValueError as e:
        raise StartupError(str(e)) from None
    if tls.cert is not None:
        problem = certificate_problem(tls.cert, tls.ca, args.host)
        if problem is not None:
            raise StartupError(f"--tls-cert {args.tls_cert}: {problem}")
    same: list[str] = []
    if args.tls_cert is not None:
        same += ["--tls-cert", str(args.tls_cert), "--tls-key", str(args.tls_key)]
    if args.tls_ca is not None:
        same += ["--tls-ca", str(args.tls_ca)]
    return ChildTls({kind: list(same) for kind in CHILD_KINDS}, tls)


def certificate_problem(cert_pem: bytes, ca_pem: bytes | None, host: str) -> str | None:
    """Why every child's certificate cannot work, found before any child starts: expired (or
    not valid yet), not naming `host` (which the children announce and are dialed at), or not
    signed by the CA. Each only made every health check fail until the start-up timeout."""
    import datetime

    from cryptography import x509  # here: only with --tls-cert
    from cryptography.exceptions import InvalidSignature

    cert = x509.load_pem_x509_certificates(cert_pem)[0]
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc <= now:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_before_utc > now:
        return f"not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    host = host.strip("[]")
    if host not in _ANY_HOST and not _names(cert, host):
        return f"it does not name --host {host} (its subject alternative names must)"
    if ca_pem is not None:
        ca = x509.load_pem_x509_certificates(ca_pem)[0]
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            return f"not signed by --tls-ca ({ca.subject.rfc4514_string()})"
    return None


_ANY_HOST = ("0.0.0.0", "::", "")  # every address: the children announce another one


def _names(cert: Any, host: str) -> bool:
    """Whether `cert`'s subject alternative names cover `host` (an IP literal or a name; a
    leading "*." label matches one label, as TLS does)."""
    from cryptography import x509

    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        names = [n.lower() for n in sans.get_values_for_type(x509.DNSName)]
        host = host.lower()
        return any(
            n == host or (n.startswith("*.") and host.partition(".")[2] == n[2:]) for n in names
        )
    return ip in sans.get_values_for_type(x509.IPAddress)


def _tls_flags(files: CertFiles) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def _load(files: CertFiles) -> Tls:
    return TlsFiles(files.cert, files.key, files.ca).load()


@contextlib.contextmanager
def demo_certificates(
    args: argparse.Namespace, say: Callable[[str], None]
) -> Iterator[dict[str, CertFiles] | None]:
    """With --tls-demo, write_demo's files in a temporary directory for the duration (None
    without)."""
    if not args.tls_demo:
        yield None
        return
    from mili.rpc.certs import write_demo

    with tempfile.TemporaryDirectory(prefix="mili-tls-") as directory:
        demo = write_demo(Path(directory), demo_names(args.host))
        say(f"--tls-demo: throwaway CA and certificates in {directory} (removed on exit)")
        yield demo


def demo_names(host: str) -> list[str]:
    """What --tls-demo's certificates are valid for: --host (as the children announce it and
    the frontend dials them), and this machine's loopback names."""
    names = ["localhost", "127.0.0.1", "::1", host.strip("[]")]
    return list(dict.fromkeys(names))


def demo_usage(client: CertFiles, frontend: str, http_url: str | None = None) -> list[str]:
    """The command lines that call the frontend through --tls-demo's TLS ports: gRPC on
    `frontend` (HOST:PORT) and, with an HTTP port, HTTPS on `http_url` (same certificate)."""
    body = '{"prompt":"Hello","sampling":{"max_tokens":16,"temperature":0}}'
    lines = [
        "--tls-demo: the frontend's ports speak TLS; call them with",
        f"  grpcurl -cacert {client.ca} -d '{body}' {frontend} "
        "mili.frontend.v1.GenerationService/Generate",
        f"  mili generate --address {frontend} --tls-ca {client.ca} Hello",
    ]
    if http_url is not None:
        lines.append(f"  curl --cacert {client.ca} {http_url}/v1/models")
    lines.append(
        "the internal services require a client certificate (mTLS): add "
        f"-cert {client.cert} -key {client.key} (grpcurl) or --tls-cert/--tls-key (mili)"
    )
    return lines
