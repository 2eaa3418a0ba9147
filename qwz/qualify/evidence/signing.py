"""Keyed signatures over evidence records: who may have written this record.

[Note: digest and signature]
  The digest (``seal.canonical_digest``) is an unkeyed sha256 of the record's
  canonical JSON. Anyone can recompute it, so it catches accidents (a truncated
  copy, a hand edit, bit rot) but not a deliberate edit: change a number, reseal,
  and the digest matches again. The signature is an HMAC-SHA256, under a secret
  key, of that digest (domain-separated by ``SIGNED_MESSAGE_PREFIX``). Only a
  holder of the key can produce it, so a signed record that verifies was written
  by a key holder and not changed since, down to the last byte of its body.

  What the signature does not cover: the ``signature`` object itself (it cannot
  sign itself) and anything outside the record (plots, report.md). A record
  whose signature is removed is simply unsigned: ``compare --require-signature``
  refuses it, and ``report`` labels it unsigned.

Why HMAC and not an asymmetric signature (Ed25519, say)? The standard library
has HMAC and no public-key signatures, so HMAC adds no dependency to a package
whose evidence must be re-runnable anywhere; and the model is a shared secret
that fits CI: the nightly job signs with a repository secret and the same job
(or a maintainer holding the secret) verifies. The cost is that a verifier can
also sign; if records must be verified by people who must not be able to sign,
switch to Ed25519 from a well-kept library (``cryptography``) behind this same
module's interface.

Keys come from ``QWZ_RECORD_KEY`` (hex of at least 16 bytes, or else text of at
least 16 characters) or ``QWZ_RECORD_KEY_FILE`` (a file holding the same); an
empty variable counts as unset. The key id is the first 16 hex digits of the
sha256 of the key bytes: it names the key without revealing it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

KEY_ENV = "QWZ_RECORD_KEY"
KEY_FILE_ENV = "QWZ_RECORD_KEY_FILE"
MIN_KEY_BYTES = 16
SIGNED_MESSAGE_PREFIX = b"qwz-record-signature-v1\x00"
_HEX = re.compile(r"[0-9a-fA-F]+")


class SigningKeyError(ValueError):
    """The configured key cannot be used; the message names the variable and the problem."""


class Signature(BaseModel):
    """HMAC-SHA256 of a record's digest; stored in the record file, outside the digest."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="sha256(key)[:16], hex")
    hmac_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="HMAC-SHA256, hex")


@dataclass(frozen=True, repr=False)
class SigningKey:
    secret: bytes

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.secret).hexdigest()[:16]

    def __repr__(self) -> str:  # never print the secret
        return f"SigningKey(key_id={self.key_id})"


def parse_key(text: str, source: str) -> SigningKey:
    """Hex (an even number of hex digits) is decoded; any other text is used as UTF-8."""
    text = text.strip()
    if _HEX.fullmatch(text) and len(text) % 2 == 0:
        secret = bytes.fromhex(text)
    else:
        secret = text.encode("utf-8", errors="surrogateescape")
    if len(secret) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"{source}: a key of {len(secret)} bytes is too short; use at least "
            f"{MIN_KEY_BYTES} random bytes (for example `openssl rand -hex 32`)"
        )
    return SigningKey(secret)


def configured_key(environ: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key from ``QWZ_RECORD_KEY`` or ``QWZ_RECORD_KEY_FILE``; None when neither is set."""
    from qwz import jsonio

    environ = os.environ if environ is None else environ
    text, path = environ.get(KEY_ENV, ""), environ.get(KEY_FILE_ENV, "")
    if text and path:
        raise SigningKeyError(f"{KEY_ENV} and {KEY_FILE_ENV} are both set; set one")
    if text:
        return parse_key(text, KEY_ENV)
    if path:
        try:
            data = jsonio.read_regular_file(path, max_bytes=4096, what="key file")
        except jsonio.JsonInputError as error:
            raise SigningKeyError(f"{KEY_FILE_ENV}: {error}") from None
        try:
            return parse_key(data.decode("utf-8"), f"{KEY_FILE_ENV} {path}")
        except UnicodeDecodeError:
            return parse_key_bytes(data.strip(), f"{KEY_FILE_ENV} {path}")
    return None


def parse_key_bytes(secret: bytes, source: str) -> SigningKey:
    if len(secret) < MIN_KEY_BYTES:
        raise SigningKeyError(f"{source}: a key of {len(secret)} bytes is too short")
    return SigningKey(secret)


def _mac(digest: str, key: SigningKey) -> str:
    message = SIGNED_MESSAGE_PREFIX + digest.encode("ascii", errors="replace")
    return hmac.new(key.secret, message, hashlib.sha256).hexdigest()


def sign(digest: str, key: SigningKey) -> Signature:
    return Signature(key_id=key.key_id, hmac_sha256=_mac(digest, key))


def verifies(digest: str, signature: Signature, key: SigningKey) -> bool:
    """Whether ``signature`` is ``key``'s HMAC of ``digest`` (constant-time comparison)."""
    return signature.key_id == key.key_id and hmac.compare_digest(
        signature.hmac_sha256, _mac(digest, key)
    )


def describe(digest: str, signature: Signature | None, key: SigningKey | None) -> str:
    """One line for reports and comparisons: signed or unsigned, by which key, verified?"""
    if signature is None:
        return (
            "unsigned: anyone could have written or edited this record "
            "(the digest catches accidents, not edits)"
        )
    head = f"signed (HMAC-SHA256) by key id {signature.key_id}"
    if key is None:
        return f"{head}; not verified: no key configured ({KEY_ENV} or {KEY_FILE_ENV})"
    if signature.key_id != key.key_id:
        return f"{head}; not verified: the configured key is {key.key_id}"
    if verifies(digest, signature, key):
        return f"{head}; verified with the configured key"
    return f"{head}; INVALID: does not verify, the record changed after it was signed"
