"""The identifier rules, shared by every side: REST paths and bodies, bulk, the wire
protocol, the vLLM flags and the database columns (their lengths are these).

Pure Python (no vLLM, no SQLAlchemy, no pydantic): the patterns are plain regular
expressions that pydantic, msgspec and ``re`` all accept.

- User ids: 1-256 characters, no control characters (U+0000-U+001F, U+007F, so no NUL),
  no ``/`` (no route could address such a user) and no U+FFFD (what invalid UTF-8
  decodes to: two different byte strings would become one user).
- Engine ids: 1-256 characters of letters, digits and ``. _ - : @ [ ]`` (host names,
  ``host:port``, ``[::1]:8000``, pod names): addressable as ``/engines/{id}`` and
  writable in an allow-list (OUTPUT_RATE_ZMQ_CLIENT_KEYS ``KEY=id1|id2``).
- Neither is ``.`` or ``..``: every URL client removes such a path segment (RFC 3986
  dot segments), so no browser could open, edit or delete it. The patterns say it
  without lookarounds (pydantic's regex engine has none): an id holds a character that
  is not a dot, or is three or more dots.
- Model names: at most 512 characters, no control characters (``/`` is fine).
- Tier names: 1-64 characters of letters, digits, ``. _ -``, starting with a letter
  or a digit.
- vLLM versions (what an engine says it runs, shown in ``GET /engines``): at most 64
  characters of letters, digits and ``. + ! _ -`` (PEP 440 versions, local labels
  included: ``0.32.0+cpu``); empty: not known.
"""

from __future__ import annotations

import re

MAX_USER_ID_LEN = 256
MAX_ENGINE_ID_LEN = 256
MAX_MODEL_LEN = 512
MAX_TIER_NAME_LEN = 64
MAX_VLLM_VERSION_LEN = 64

_USER_CHAR = r"[^\x00-\x1f\x7f/\ufffd]"
_USER_CHAR_NO_DOT = r"[^\x00-\x1f\x7f/\ufffd.]"
_ENGINE_CHAR = r"[A-Za-z0-9._:@\[\]-]"
_ENGINE_CHAR_NO_DOT = r"[A-Za-z0-9_:@\[\]-]"
USER_ID_PATTERN = rf"^(?:{_USER_CHAR}*{_USER_CHAR_NO_DOT}{_USER_CHAR}*|\.{{3,}})$"
ENGINE_ID_PATTERN = rf"^(?:{_ENGINE_CHAR}*{_ENGINE_CHAR_NO_DOT}{_ENGINE_CHAR}*|\.{{3,}})$"
MODEL_PATTERN = r"^[^\x00-\x1f\x7f]*$"
TIER_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_TIER_NAME_LEN - 1}}}$"
VLLM_VERSION_PATTERN = r"^[A-Za-z0-9.+!_-]*$"

# Each pattern's rule in words (error messages say these, never the pattern).
USER_ID_RULE = "may not contain '/', control characters or U+FFFD, nor be '.' or '..'"
ENGINE_ID_RULE = "may only contain letters, digits and . _ - : @ [ ], and may not be '.' or '..'"
MODEL_RULE = "may not contain control characters"
TIER_NAME_RULE = (
    f"must be 1-{MAX_TIER_NAME_LEN} letters, digits, '.', '_' or '-', starting with a letter "
    "or a digit"
)
VLLM_VERSION_RULE = "may only contain letters, digits and . + ! _ -"
PATTERN_RULES = {
    USER_ID_PATTERN: USER_ID_RULE,
    ENGINE_ID_PATTERN: ENGINE_ID_RULE,
    MODEL_PATTERN: MODEL_RULE,
    TIER_NAME_PATTERN: TIER_NAME_RULE,
    VLLM_VERSION_PATTERN: VLLM_VERSION_RULE,
}

_USER_ID = re.compile(USER_ID_PATTERN)
_ENGINE_ID = re.compile(ENGINE_ID_PATTERN)
_VLLM_VERSION = re.compile(VLLM_VERSION_PATTERN)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "...")


def check_user_id(user: object) -> str:
    """The user id, or ValueError saying which rule it breaks."""
    if not isinstance(user, str) or not user:
        raise ValueError(f"user ids must be non-empty strings, got {user!r}")
    if len(user) > MAX_USER_ID_LEN:
        raise ValueError(f"user id longer than {MAX_USER_ID_LEN} characters: {_shown(user)}")
    if not _USER_ID.fullmatch(user):
        raise ValueError(f"user id {_shown(user)}: a user id {USER_ID_RULE}")
    return user


def is_user_id(user: str) -> bool:
    return 0 < len(user) <= MAX_USER_ID_LEN and _USER_ID.fullmatch(user) is not None


def check_engine_id(engine_id: object) -> str:
    """The engine id, or ValueError saying which rule it breaks."""
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine ids must be non-empty strings, got {engine_id!r}")
    if len(engine_id) > MAX_ENGINE_ID_LEN:
        raise ValueError(
            f"engine id longer than {MAX_ENGINE_ID_LEN} characters: {_shown(engine_id)}"
        )
    if not _ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"engine id {_shown(engine_id)}: an engine id {ENGINE_ID_RULE}")
    return engine_id


def wire_pattern(pattern: str) -> str:
    """``pattern`` for msgspec, which reads it with Python's re: there ``$`` also
    matches before a final newline, ``\\Z`` only at the end (REST's pydantic reads
    ``$`` as the end and knows no ``\\Z``; the checks here use fullmatch)."""
    return pattern.removesuffix("$") + r"\Z"


def is_vllm_version(version: str) -> bool:
    return len(version) <= MAX_VLLM_VERSION_LEN and _VLLM_VERSION.fullmatch(version) is not None
