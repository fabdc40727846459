"""The last configuration an engine applied, kept on disk (``--output-rate-state-dir``).

An engine (re)started while no control plane answers enforces what it last applied
instead of its command-line limits alone (docs/live-push.md, "Saved state"). Each
connection to the control plane keeps a file of its own: the engine core its limits and
its fleet size (fleet users start at their safe share), its API server (api-key mode)
its API keys.

The file holds the configuration as a protocol ``Snapshot`` frame (the same validation
applies when it is read back) inside a small envelope: a format number, the engine id
and role it belongs to, and when it was written; an engine core's also holds its fleet
serving counts and outage policy (``SavedFleet``), so that a restart during an outage
enforces the outage shares it did before (docs/fleet.md, "Outage policy"). A file
written before them has none: no counts (the safe share of the saved fleet). It is
rewritten after every applied version and every change of the counts, atomically (a
temporary file, fsync, rename, fsync of the directory), mode 0600 in a directory
created 0700: it lists API key hashes and every user's limit.

Writing is off the applying thread: ``StateWriter`` gets the snapshot and the ops the
connection applied (a queue put each), keeps its own copy of the model and writes the
newest state; versions applied while a write is under way go in the next one. A file
that cannot be read (missing, corrupt, written by another format, or for another engine
id) is logged and ignored; nothing here raises into the engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import msgspec

from output_rate_core import protocol as p
from output_rate_core.key_table import KeyTable
from output_rate_core.limits import LimitModel
from output_rate_core.outage import OutageMode

logger = logging.getLogger("vllm.output_rate." + __name__)

# The envelope's layout; a file of another format is ignored (and rewritten).
FORMAT = 1
SUBDIR = "output_rate"


def default_state_dir() -> str:
    """Under vLLM's cache root (``VLLM_CACHE_ROOT``, default ``~/.cache/vllm``)."""
    import vllm.envs as envs

    return os.path.join(envs.VLLM_CACHE_ROOT, SUBDIR)


class SavedFleet(msgspec.Struct, frozen=True):
    """An engine core's fleet counts and outage policy, as its ``LimitTable`` held them
    (engine_ext/limit_table.py, ``ShareState``; restored by ``LimitTable.restore_fleet``)."""

    # user -> the engines serving it, as the control plane last said
    serving: dict[str, Annotated[int, msgspec.Meta(ge=1, le=2**31)]] = {}
    # user -> when its count expires (Unix seconds), for counts kept past their share
    serving_until: dict[str, float] = {}
    outage: OutageMode = "serving"
    outage_keep_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    outage_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # The longest lease a Shares frame gave it (ms): a restart takes the lease it held to
    # end that long (and the keep time) after it started, unless it was in an outage.
    lease_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    in_outage: bool = False


class SavedState(msgspec.Struct, frozen=True):
    format: int
    engine_id: str
    role: p.Role
    # Unix seconds, for the logs.
    saved_at: float
    # An encoded protocol Snapshot (output_rate_core/protocol.py).
    snapshot: bytes
    # Added after the fields above: a file without it reads as no counts.
    fleet: SavedFleet | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedState)


@dataclass(frozen=True)
class Loaded:
    snapshot: p.Snapshot
    saved_at: float
    fleet: SavedFleet | None = None

    @property
    def saved_at_text(self) -> str:
        return datetime.fromtimestamp(self.saved_at, UTC).isoformat(timespec="seconds")


class StateFile:
    """One connection's file: ``<dir>/<role>-<engine id, percent-encoded>.state``."""

    def __init__(self, state_dir: str | os.PathLike[str], engine_id: str, role: p.Role) -> None:
        self.dir = Path(state_dir)
        self.engine_id = engine_id
        self.role = role
        # Engine ids hold letters, digits and . _ - : @ [ ]; the last four are encoded
        # (%3A ...), which no id holds, so two ids never share a file.
        self.path = self.dir / f"{role}-{quote(engine_id, safe='._-')}.state"

    def load(self) -> Loaded | None:
        """The saved state, or None (no file, or one that is not usable: logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning(
                "output-rate: cannot read the saved state %s (%s); ignored", self.path, e
            )
            return None
        try:
            saved = _decoder.decode(data)
            if saved.format != FORMAT:
                raise ValueError(f"format {saved.format}, this engine reads {FORMAT}")
            if (saved.engine_id, saved.role) != (self.engine_id, self.role):
                raise ValueError(f"it belongs to {saved.engine_id!r} ({saved.role})")
            snapshot = p.decode(saved.snapshot)
            if not isinstance(snapshot, p.Snapshot):
                raise ValueError(f"it holds a {type(snapshot).__name__}, not a snapshot")
        except (msgspec.DecodeError, msgspec.ValidationError, p.ProtocolError, ValueError) as e:
            logger.warning(
                "output-rate: the saved state %s is not usable (%s); ignored", self.path, e
            )
            return None
        return Loaded(snapshot, saved.saved_at, saved.fleet)

    def save(self, snapshot: p.Snapshot, fleet: SavedFleet | None = None) -> None:
        """Replace the file with ``snapshot`` (and ``fleet``), atomically (OSError if it
        cannot be)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        envelope = SavedState(
            FORMAT, self.engine_id, self.role, time.time(), p.encode(snapshot), fleet
        )
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(_encoder.encode(envelope))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The rename itself survives a crash once the directory is on disk.
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# What the applying thread hands the writer: a snapshot it installed, the ops of a delta
# it applied (with its version), a new fleet size, or new fleet counts (SavedFleet).
@dataclass(frozen=True)
class _Ops:
    version: int
    ops: Sequence[p.Op]


@dataclass(frozen=True)
class _FleetSize:
    num_engines: int


_Event = p.Snapshot | _Ops | _FleetSize | SavedFleet | None
_CLOSE = None
# How long close() waits for the last write.
CLOSE_WAIT_S = 5.0


class StateWriter:
    """Keeps a ``StateFile`` at the newest version a connection applied, on a thread of
    its own. ``on_*`` are called by the applying thread and cost a queue put."""

    def __init__(self, file: StateFile) -> None:
        self.file = file
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        # Writer-thread state: the model as the connection applied it.
        self._version: int | None = None
        self._model = LimitModel()
        self._keys = KeyTable()
        self._num_engines = 1
        self._fleet: SavedFleet | None = None
        self._failing: str | None = None
        self.num_written = 0
        self._thread = threading.Thread(
            target=self._loop, name=f"output-rate-state-{file.role}", daemon=True
        )
        self._thread.start()

    def on_snapshot(self, snapshot: p.Snapshot) -> None:
        self._events.put(snapshot)

    def on_ops(self, version: int, ops: Sequence[p.Op]) -> None:
        self._events.put(_Ops(version, ops))

    def on_fleet_size(self, num_engines: int) -> None:
        self._events.put(_FleetSize(num_engines))

    def on_fleet(self, fleet: SavedFleet) -> None:
        self._events.put(fleet)

    def close(self) -> None:
        """Write what is queued, then stop."""
        if self._thread.is_alive():
            self._events.put(_CLOSE)
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _loop(self) -> None:
        closing = False
        while not closing:
            events = [self._events.get()]
            while not self._events.empty():
                events.append(self._events.get_nowait())
            changed = False
            for event in events:
                if event is _CLOSE:
                    closing = True
                else:
                    changed = self._take(event) or changed
            if changed and self._version is not None:
                self._write()

    def _take(self, event: p.Snapshot | _Ops | _FleetSize | SavedFleet) -> bool:
        if isinstance(event, p.Snapshot):
            self._version = event.version
            self._model = LimitModel.from_snapshot(event)
            self._keys = KeyTable.from_snapshot(event)
            self._num_engines = event.num_engines
            return True
        if isinstance(event, _Ops):
            if self._version is None:
                return False  # deltas follow a snapshot; none came
            for op in event.ops:
                self._model.apply(op)
                self._keys.apply(op)
            self._version = event.version
            return True
        if isinstance(event, SavedFleet):
            changed = event != self._fleet
            self._fleet = event
            return changed
        changed = event.num_engines != self._num_engines
        self._num_engines = event.num_engines
        return changed

    def _write(self) -> None:
        assert self._version is not None
        model = self._model
        snapshot = msgspec.structs.replace(
            p.Snapshot.of(self._version, model.default, model.tiers, model.users),
            num_engines=max(1, self._num_engines),
            keys=dict(self._keys.keys),
        )
        try:
            self.file.save(snapshot, self._fleet)
        except OSError as e:
            # Logged once per kind of failure (a full disk is not a line per version).
            if str(e) != self._failing:
                self._failing = str(e)
                logger.error(
                    "output-rate: cannot save the applied configuration to %s (%s); a restart "
                    "while the control plane is down would not have it",
                    self.file.path,
                    e,
                )
            return
        if self._failing is not None:
            logger.info("output-rate: saving the applied configuration to %s again", self.file.path)
            self._failing = None
        self.num_written += 1
