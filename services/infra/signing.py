"""Signatures of the messages a worker writes to a stream, so the coordinator can tell which
worker wrote them: HMAC-SHA256 of the message's bytes under a key only that worker and the
coordinator hold (the coordinator makes it at registration, `keys.WORKER_KEYS`).

Pure: no Redis, no clock. It does not decide what an unsigned or wrongly signed message means
(the coordinator parks it) nor where keys live.
"""

import hashlib
import hmac
import secrets

KEY_BYTES = 32  # a signing key's length; its hex form has twice as many characters
SIGNATURE_FIELD = b"s"  # the stream entry's field holding the signature (hex), beside `m`


def new_key() -> str:
    """A fresh random signing key, as hex."""
    return secrets.token_hex(KEY_BYTES)


def key_bytes(key: str | bytes) -> bytes:
    """A key as the HMAC takes it: hex text (as stored and as the coordinator answers it) or
    bytes of that text read from Redis, decoded to its 32 raw bytes. ValueError: not hex."""
    text = key.decode() if isinstance(key, bytes) else key
    return bytes.fromhex(text)


def sign(key: bytes, payload: bytes) -> str:
    """The signature of `payload` under `key` (raw bytes): HMAC-SHA256, hex."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def consumer_secret(key: bytes, worker_id: str) -> str:
    """The secret part of `worker_id`'s jobs consumer name (`contracts.consumers`), under the
    coordinator's key: the same at each registration of that id, unguessable without the key."""
    return sign(key, f"jobs consumer {worker_id}".encode())[:32]


def registration_proof(key: bytes, worker_id: str) -> str:
    """What a worker that registers again while alive shows: that it holds its current key."""
    return sign(key, f"register {worker_id}".encode())


def verify(key: bytes, payload: bytes, signature: str | bytes | None) -> bool:
    """Whether `signature` (hex, as text or the bytes Redis answers) is `payload`'s under
    `key`; a missing signature is not. Compared in constant time."""
    if not signature:
        return False
    given = signature if isinstance(signature, bytes) else signature.encode()
    return hmac.compare_digest(sign(key, payload).encode(), given)
