"""RSA keys that sign and verify exactly as hivemind's ``RSAPrivateKey``/``RSAPublicKey`` do (OpenSSH public
bytes, PSS-SHA256 signatures in base64), without importing hivemind: `cotrain token` stays quick.

Unlike hivemind's keys, a signature is accepted only in one spelling: canonical base64 (no line breaks, no
junk, exact padding) of exactly the key's size in bytes. Lenient decoding would let many byte strings carry
the same signature, and anything keyed to a signature's bytes (a token's old fingerprint) could be dodged.
"""

from __future__ import annotations

import base64
import binascii

MIN_KEY_BITS, MAX_KEY_BITS = 2048, 8192  # RSA key sizes accepted from files and tokens


def decode_signature(signature: bytes, size: int) -> bytes:
    """The raw bytes of a base64 ``signature`` of a ``size``-byte RSA key; ValueError unless ``signature`` is
    the one canonical spelling of exactly ``size`` bytes."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError("a signature is not base64") from None
    if base64.b64encode(raw) != signature:
        raise ValueError("a signature is not in canonical base64")
    if len(raw) != size:
        raise ValueError(f"a signature has {len(raw)} bytes, not the key's {size}")
    return raw


class PublicKey:
    """An RSA public key, as hivemind's ``RSAPublicKey`` writes and checks them."""

    def __init__(self, key) -> None:
        self._key = key

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = serialization.load_ssh_public_key(data)
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("not an RSA key")
        if not MIN_KEY_BITS <= key.key_size <= MAX_KEY_BITS:
            raise ValueError(f"an RSA key of {key.key_size} bits (accepted: {MIN_KEY_BITS}-{MAX_KEY_BITS})")
        return cls(key)

    @property
    def signature_size(self) -> int:
        return (self._key.key_size + 7) // 8

    def to_bytes(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def verify(self, data: bytes, signature: bytes) -> bool:
        """Whether ``signature`` (canonical base64, see ``decode_signature``) signs ``data``."""
        from cryptography import exceptions
        from cryptography.hazmat.primitives import hashes

        try:
            raw = decode_signature(signature, self.signature_size)
            self._key.verify(raw, data, _pss(), hashes.SHA256())
            return True
        except (ValueError, TypeError, exceptions.InvalidSignature):
            return False

    def __getstate__(self) -> dict:
        return {"openssh": self.to_bytes()}

    def __setstate__(self, state: dict) -> None:
        self._key = PublicKey.from_bytes(state["openssh"])._key


class PrivateKey:
    """An RSA private key that signs as hivemind's ``RSAPrivateKey`` does (and stands in for it)."""

    def __init__(self, key=None) -> None:
        if key is None:
            from cryptography.hazmat.primitives.asymmetric import rsa

            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._key = key

    @classmethod
    def from_pem(cls, data: bytes) -> PrivateKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = serialization.load_pem_private_key(data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
        if not MIN_KEY_BITS <= key.key_size <= MAX_KEY_BITS:
            raise ValueError(f"an RSA key of {key.key_size} bits (accepted: {MIN_KEY_BITS}-{MAX_KEY_BITS})")
        return cls(key)

    def to_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.private_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PrivateFormat.PKCS8,
            encryption_algorithm=serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes

        return base64.b64encode(self._key.sign(data, _pss(), hashes.SHA256()))

    def get_public_key(self) -> PublicKey:
        return PublicKey(self._key.public_key())

    def __getstate__(self) -> dict:
        return {"pem": self.to_pem()}

    def __setstate__(self, state: dict) -> None:
        self._key = PrivateKey.from_pem(state["pem"])._key


def _pss():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
