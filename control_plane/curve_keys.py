"""CURVE keys as the settings spell them: a key in Z85, and the allow-list of engine keys
with the engine ids each may claim. Pure rules: `Settings` checks its variables with them
at startup, and the push endpoint admits what the allow-list names."""

from __future__ import annotations

from zmq.utils import z85

from output_rate_core.ids import check_engine_id

Z85_KEY_LEN = 40
# Engine ids a key may claim, per key; None: any engine id.
AllowList = dict[str, frozenset[str] | None]


def check_z85_key(value: str, *, variable: str) -> str:
    """A CURVE key in Z85 (40 characters, 32 bytes), or ValueError naming the variable."""
    hint = ""
    if value[:1] in "'\"" or value[-1:] in "'\"":
        hint = " (the quotes are part of the value: remove them)"
    elif value != value.strip():
        hint = " (it has surrounding spaces)"
    if len(value) != Z85_KEY_LEN:
        raise ValueError(
            f"{variable}: a CURVE key is {Z85_KEY_LEN} Z85 characters, got {len(value)}{hint}"
        )
    try:
        decoded = z85.decode(value.encode("ascii"))
    except Exception:  # z85.decode raises various errors for bad input
        decoded = b""
    if len(decoded) != 32:
        raise ValueError(f"{variable}: {value[:6]}... is not a Z85-encoded key{hint}")
    return value


def parse_allow_list(text: str, *, variable: str = "OUTPUT_RATE_ZMQ_CLIENT_KEYS") -> AllowList:
    """``KEY[=ID[|ID...]],...``: the engine public keys admitted, each with the engine ids
    it may claim (a bare KEY may claim any id). Whitespace around entries is ignored;
    anything else that is not a key or an engine id is an error naming the variable."""
    allowed: AllowList = {}
    for number, raw in enumerate(text.split(","), 1):
        entry = raw.strip()
        if not entry:
            if text.strip():
                raise ValueError(f"{variable}: entry {number} is empty (a stray comma?)")
            continue
        if any(c in entry for c in "'\"") or any(c.isspace() for c in entry):
            raise ValueError(
                f"{variable}: entry {number} contains quotes or spaces (quotes are part of "
                "the value in an env file or a systemd unit: remove them)"
            )
        key, rest = entry[:Z85_KEY_LEN], entry[Z85_KEY_LEN:]
        if rest and not rest.startswith("="):
            raise ValueError(
                f"{variable}: entry {number} is not KEY or KEY=engine-id: a key has "
                f"{Z85_KEY_LEN} characters, this entry {len(entry)} and no '=' after them"
            )
        check_z85_key(key, variable=f"{variable} entry {number}")
        ids: frozenset[str] | None = None
        if rest:
            try:
                ids = frozenset(check_engine_id(i) for i in rest[1:].split("|"))
            except ValueError as e:
                raise ValueError(f"{variable}: entry {number}: {e}") from None
        if key in allowed:
            known = allowed[key]
            ids = None if known is None or ids is None else known | ids
        allowed[key] = ids
    return allowed
