"""RSA keys that sign and verify exactly as hivemind's ``RSAPrivateKey``/``RSAPublicKey`` do (OpenSSH public
bytes, PSS-SHA256 signatures in base64), without importing hivemind: `cotrain token` stays quick."""

from __future__ import annotations

import base64


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
        return cls(key)

    def to_bytes(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def verify(self, data: bytes, signature: bytes) -> bool:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import hashes

        try:
            self._key.verify(base64.b64decode(signature), data, _pss(), hashes.SHA256())
            return True
        except (ValueError, TypeError, exceptions.InvalidSignature):
            return False


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

        return cls(serialization.load_pem_private_key(data, password=None))

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
