"""Throwaway X.509 material for TLS tests, made with `cryptography`: a CA, a server
certificate for 127.0.0.1/localhost and a client certificate signed by it, and a second,
untrusted CA with its own client certificate."""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    folder: pathlib.Path

    def path(self, name: str) -> str:
        return str(self.folder / name)

    def read(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(subject: str, issuer_name: x509.Name, issuer_key, key, *, is_ca: bool,
           usage=None, names=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _ca(folder: pathlib.Path, prefix: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(f"{prefix} test CA", _name(f"{prefix} test CA"), key, key, is_ca=True)
    (folder / f"{prefix}-ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _leaf(folder: pathlib.Path, name: str, ca, usage, names=()) -> None:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(name, ca_cert.subject, ca_key, key, is_ca=False, usage=usage, names=names)
    (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(_key_pem(key))
    (folder / f"{name}.key").chmod(0o600)


def make_pki(folder: pathlib.Path) -> Pki:
    """Files: ca.crt, server.{crt,key}, client.{crt,key} (signed by ca), rogue-ca.crt and
    rogue-client.{crt,key} (signed by the rogue CA)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = _ca(folder, "good")
    (folder / "ca.crt").write_bytes((folder / "good-ca.crt").read_bytes())
    _leaf(folder, "server", ca, ExtendedKeyUsageOID.SERVER_AUTH,
          (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    _leaf(folder, "client", ca, ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _ca(folder, "rogue")
    _leaf(folder, "rogue-client", rogue, ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(folder)
