"""API keys: their format, how they are made and hashed, and how a presented key is
checked (docs/identity.md). Pure Python: used by the control plane (which makes keys and
stores only their hashes) and by an engine's API server (which checks them).

A key reads ``ork_<id>_<secret>``: ``id`` is 12 characters of lowercase base32 (public:
shown as the key's prefix, named in ``DELETE /keys/{id}``), ``secret`` 32 random bytes
in URL-safe base64. The stored hash is SHA-256 of the whole key: the secret is 256
random bits, so a plain hash cannot be reversed by guessing, and checking one costs a
microsecond rather than a password hash's many milliseconds on every request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

KEY_PREFIX = "ork"
KEY_ID_LEN = 12
SECRET_BYTES = 32
KEY_ID_PATTERN = rf"^[a-z2-7]{{{KEY_ID_LEN}}}$"
KEY_HASH_PATTERN = r"^[0-9a-f]{64}$"
# Longer than any key this module makes (4 + 12 + 1 + 43 + 1): refused before hashing.
MAX_KEY_LEN = 128

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
# What an unknown key id is compared against, so an unknown id costs what a known one does.
_NO_HASH = "0" * 64


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(key id, key): a fresh key; store only ``hash_key(key)``."""
    key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(KEY_ID_LEN))
    secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()
    return key_id, f"{KEY_PREFIX}_{key_id}_{secret}"


def display_prefix(key_id: str) -> str:
    """What lists show of a key: enough to recognise it, nothing of the secret."""
    return f"{KEY_PREFIX}_{key_id}"


def key_id_of(key: str) -> str | None:
    """The id a presented key claims, or None when it is not shaped like a key."""
    if len(key) > MAX_KEY_LEN:
        return None
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != KEY_ID_LEN or not parts[2]:
        return None
    key_id = parts[1]
    return key_id if all(c in _ID_ALPHABET for c in key_id) else None


def matches(key: str, stored_hash: str | None) -> bool:
    """Whether ``key`` hashes to ``stored_hash``, compared in constant time (None: an
    unknown id, compared against a dummy so that it takes as long)."""
    expected = _NO_HASH if stored_hash is None else stored_hash
    return hmac.compare_digest(hash_key(key), expected) and stored_hash is not None
