"""TLS on the router's public port, mutual TLS on every internal hop.

A process given a certificate, its key and the cluster's CA (``SPLITSERVE_TLS_CERT``, ``_KEY``,
``_CA``) serves TLS with that certificate. Its internal servers (decode and prefill workers)
also ask every caller for a client certificate signed by the CA: a caller without one fails the
handshake and never reaches a handler. Its channels to other processes present the same
certificate and trust only the CA. The router's public port asks for no client certificate:
the public API's clients are authenticated otherwise. Without the three settings every hop is
plaintext, as a local stack on loopback runs.

Internal peers are dialled by address (a pod's IP in a cluster), so their certificates would
need every such address as a name: ``SPLITSERVE_TLS_SERVER_NAME`` names the one name every
internal certificate carries instead (gRPC's ``ssl_target_name_override``).

``make_local_ca`` writes a throwaway CA and one certificate for a stack on this host
(``splitserve up --tls``), with the ``cryptography`` package.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TLSFiles:
    cert: str  # PEM certificate, used as server and client certificate
    key: str  # its PEM private key
    ca: str  # PEM CA certificate(s) that sign every peer's certificate
    server_name: str = ""  # the name internal peers' certificates carry ("": the address's host)

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for field, path in (("tls_cert", self.cert), ("tls_key", self.key), ("tls_ca", self.ca)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise ValueError(f"{field}: cannot read {path}: {e.strerror or e}") from None
        return out[0], out[1], out[2]


# The settings that turn TLS on, all three together (files_of)
TLS_SETTINGS = ("tls_cert", "tls_key", "tls_ca")


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this host's own processes only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def check_internal_plaintext(settings) -> None:
    """ValueError (one line, naming the setting that allows it) when a worker's internal gRPC
    server would be plaintext where that is unsafe: any process that reaches it can call Decode,
    FirstToken (setting a request's first token) or PutKV. Unsafe: with tenants (their tokens
    guard the public port only), or bound beyond loopback."""
    if settings.allow_plaintext_internal or any(getattr(settings, f) for f in TLS_SETTINGS):
        return
    if settings.auth_tokens_file:
        why = "tenants are set (auth_tokens_file)"
    elif not is_loopback(settings.host):
        why = f"it binds {settings.host}, beyond loopback"
    else:
        return
    raise ValueError(
        f"the internal gRPC servers would be plaintext while {why}: give them mutual TLS (tls_cert, tls_key, "
        f"tls_ca; splitserve up --tls), or set allow_plaintext_internal=true (SPLITSERVE_ALLOW_PLAINTEXT_INTERNAL)"
    )


def files_of(settings) -> TLSFiles | None:
    """The settings' TLS files, or None for plaintext; ValueError naming the setting when only
    some are given, or one cannot be read."""
    given = {f: getattr(settings, f) for f in TLS_SETTINGS}
    if not any(given.values()):
        return None
    missing = [f for f, v in given.items() if not v]
    if missing:
        raise ValueError(f"{', '.join(missing)}: TLS needs tls_cert, tls_key and tls_ca together")
    files = TLSFiles(settings.tls_cert, settings.tls_key, settings.tls_ca, settings.tls_server_name)
    files.read()
    return files


def server_credentials(files: TLSFiles, client_auth: bool) -> grpc.ServerCredentials:
    cert, key, ca = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=client_auth)


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def bind(server, address: str, files: TLSFiles | None, client_auth: bool) -> int:
    """server.add_*_port(address): TLS with files (client certificates required with client_auth),
    plaintext without; the port bound (0 when it cannot be)."""
    if files is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(files, client_auth))


def _open(api, address: str, files: TLSFiles | None, options: list):
    """api.*_channel (api: grpc or grpc.aio): mTLS with files, plaintext without."""
    if files is None:
        return api.insecure_channel(address, options=options)
    name = [("grpc.ssl_target_name_override", files.server_name)] if files.server_name else []
    return api.secure_channel(address, channel_credentials(files), options=[*options, *name])


def channel(address: str, files: TLSFiles | None, options: list) -> grpc.Channel:
    """A channel to another process of the stack: mTLS with files, plaintext without."""
    return _open(grpc, address, files, options)


def aio_channel(address: str, files: TLSFiles | None, options: list) -> grpc.aio.Channel:
    return _open(grpc.aio, address, files, options)


def make_local_ca(folder: str, hosts: list[str] | None = None, days: int = 30) -> TLSFiles:
    """A throwaway CA and one certificate it signs for these hosts (default 127.0.0.1, ::1,
    localhost and this host's name), for server and client use, written under folder (keys
    readable by this user only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = hosts or ["127.0.0.1", "::1", "localhost", socket.gethostname()]
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("splitserve local CA"))
        .issuer_name(name("splitserve local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, cert and CRL signing
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt = []
    for h in dict.fromkeys(hosts):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    os.makedirs(folder, mode=0o700, exist_ok=True)
    files = TLSFiles(os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem"), os.path.join(folder, "ca.pem"))
    pem = serialization.Encoding.PEM
    for path, data, mode in (
        (files.ca, ca.public_bytes(pem), 0o644),
        (files.cert, cert.public_bytes(pem), 0o644),
        (
            files.key,
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            0o600,
        ),
    ):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return files
