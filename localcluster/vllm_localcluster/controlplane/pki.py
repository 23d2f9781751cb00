"""Credentials generated per run: a CA, the API server's serving certificate, the key that signs
service-account tokens, and one bearer token per identity.

Nothing is reused between runs, so a leaked test kubeconfig is worthless once the run ends.
Keys are ECDSA P-256 (fast to generate: a few milliseconds, where RSA-2048 takes ~100 ms on
these cores); every file is written 0600 into the run's private directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The identities the control plane's bootstrap RBAC already knows: the admin (system:masters)
# for tests, the demo and kubectl; the controller manager and the scheduler as themselves, so
# that Events and audit entries name the component that acted.
ADMIN = ("admin", "system:masters")
CONTROLLER_MANAGER = ("system:kube-controller-manager", "")
SCHEDULER = ("system:kube-scheduler", "")
# The node agent authenticates as an administrator: the Node authorizer would demand a client
# certificate named system:node:<name>, and the agent is test infrastructure, not a kubelet.
NODE_AGENT = ("vllm-localcluster:node-agent", "system:masters")
# The operator under test: its own name, so the audit log tells its requests from the test's.
# No group: callers bind it to what it may do (the chart's ClusterRole, or cluster-admin).
OPERATOR = ("vllm-autotuner", "")
IDENTITIES = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, NODE_AGENT, OPERATOR)


@dataclass(frozen=True)
class Pki:
    """Paths of the generated files and the tokens (user name -> token)."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    service_account_key: Path  # signs tokens (kube-apiserver --service-account-signing-key-file)
    service_account_public_key: Path  # verifies them (--service-account-key-file)
    token_file: Path  # kube-apiserver --token-auth-file
    tokens: dict[str, str]

    def token(self, user: str) -> str:
        return self.tokens[user]


def _write_private(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    days: int = 7,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        # Key identifiers: strict verifiers (urllib3 2, Python 3.13) refuse chains without.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        usage = x509.KeyUsage(True, False, True, False, False, False, False, False, False)
        builder = (
            builder.add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        )
    return builder.sign(issuer_key, hashes.SHA256())


def generate(directory: Path) -> Pki:
    """Write a fresh CA, serving certificate, service-account key and token file."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("vllm-localcluster-ca", ca_key, None, ca_key, ca=True)
    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving = _certificate("kube-apiserver", serving_key, ca.subject, ca_key, ca=False)
    sa_key = ec.generate_private_key(ec.SECP256R1())
    tokens = {user: secrets.token_urlsafe(32) for user, _ in IDENTITIES}
    # kube-apiserver's static token file: token,user,uid,"group1,group2"
    lines = [
        f'{tokens[user]},{user},{user},"{group}"' if group else f"{tokens[user]},{user},{user}"
        for user, group in IDENTITIES
    ]
    pem = serialization.Encoding.PEM
    return Pki(
        ca_cert=_write_private(directory / "ca.crt", ca.public_bytes(pem)),
        serving_cert=_write_private(directory / "apiserver.crt", serving.public_bytes(pem)),
        serving_key=_write_private(directory / "apiserver.key", _key_pem(serving_key)),
        service_account_key=_write_private(directory / "sa.key", _key_pem(sa_key)),
        service_account_public_key=_write_private(
            directory / "sa.pub",
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        ),
        token_file=_write_private(directory / "tokens.csv", ("\n".join(lines) + "\n").encode()),
        tokens=tokens,
    )
