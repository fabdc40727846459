"""What each connection is sent of the configuration, in order: a snapshot first, then
every committed change after the version it has, as read back from the durable change
log (nothing is published before it is committed and nothing is lost), and a heartbeat
after every frame up to the version it names.

Snapshots go to one connection at most once per SNAPSHOT_MIN_INTERVAL_S, and only once it
acknowledged the last one (or SNAPSHOT_UNREAD_RESEND_S passed) (docs/live-push.md,
"Slow readers"). An engine core gets the limits; an API server (role "api") the API keys
only: a snapshot of the keys and every delta with only its key ops, the version kept, so
it sees no gap (docs/control-plane.md, "API keys"). The reads are the log reader's; this
runs on the socket thread.
"""

from __future__ import annotations

import time
from functools import partial

from control_plane.push.leadership import FleetLeadership
from control_plane.push.log_reader import LogRead, LogReader
from control_plane.push.outbox import Outbox
from control_plane.push.peers import Peer, PeerTable
from output_rate_core import protocol as p

# At most one snapshot per connection this often, whatever asks for it (HELLO, RESYNC,
# a pruned change log); below the engines' retry period.
SNAPSHOT_MIN_INTERVAL_S = p.RESYNC_RETRY_S / 2
# A peer gets its next snapshot only once it acknowledged the last one, or after this
# long (a snapshot lost on the way): a peer that does not read cannot make the server
# queue snapshot after snapshot for it.
SNAPSHOT_UNREAD_RESEND_S = 30.0


def snapshot_due(peer: Peer, now: float) -> bool:
    """Whether a peer that asks for a snapshot gets one now (at most one in flight)."""
    elapsed = now - peer.last_snapshot_at
    if peer.unread_snapshot is not None:
        return elapsed >= SNAPSHOT_UNREAD_RESEND_S
    return elapsed >= SNAPSHOT_MIN_INTERVAL_S


class Publisher:
    def __init__(
        self,
        *,
        peers: PeerTable,
        outbox: Outbox,
        reader: LogReader,
        leadership: FleetLeadership,
    ) -> None:
        self._peers = peers
        self._outbox = outbox
        self._reader = reader
        self._leadership = leadership
        # role -> identity -> the peer waiting for the snapshot read for that role (every
        # peer that asks while a read is under way shares it)
        self._awaiting: dict[p.Role, dict[bytes, Peer]] = {}
        # Roles whose snapshot is being read.
        self._loading: set[p.Role] = set()
        # The newest version a log read brought here.
        self._newest = 0
        # HELLO/RESYNC answered with nothing: a snapshot went to that connection just now.
        self.num_snapshots_refused = 0
        self.num_snapshots_sent = 0

    # ---- snapshots -----------------------------------------------------------------

    def ask_snapshot(self, identity: bytes, peer: Peer, now: float) -> None:
        """A HELLO or RESYNC from a bound connection: a snapshot if one is due."""
        if snapshot_due(peer, now):
            self.send_snapshot(identity, peer, now)
        else:
            self.num_snapshots_refused += 1

    def send_snapshot(self, identity: bytes, peer: Peer, now: float) -> None:
        """It gets the next snapshot read; until it went, no delta."""
        # The rate limit counts from now: what asks again meanwhile is refused.
        peer.last_snapshot_at = now
        self._awaiting.setdefault(peer.role, {})[identity] = peer
        self._read_snapshot(peer.role)

    def _read_snapshot(self, role: p.Role) -> None:
        if role in self._loading:
            return
        self._loading.add(role)
        # The engines it goes to count in the fleet size it carries.
        joining = frozenset(peer.engine_id for peer in self._awaiting.get(role, {}).values())
        num_engines, count_rows = self._leadership.fleet_size(role, joining)
        self._reader.snapshot(
            role,
            num_engines,
            count_rows,
            joining,
            partial(self._snapshot_read, role),
            partial(self._loading.discard, role),  # read again at the next poll
        )

    def _snapshot_read(self, role: p.Role, read: tuple[int, bytes]) -> None:
        version, frame = read
        self._loading.discard(role)
        now = time.monotonic()
        num_sent = 0
        for identity, peer in self._awaiting.pop(role, {}).items():
            if self._peers.get(identity) is not peer:
                continue  # gone meanwhile
            queued = self._outbox.send(identity, frame)
            peer.sent_version = version
            peer.last_snapshot_at = now
            # A snapshot that could not even be queued is not waiting to be read.
            peer.unread_snapshot = version if queued else None
            self.num_snapshots_sent += queued
            num_sent += 1
        if num_sent and version < self._newest:
            self._reader.read(version)  # the deltas after it went out before it did

    def acked(self, peer: Peer, version: int) -> bool:
        """An ACK: whether it acknowledged the snapshot it was sent (it reads and speaks
        the protocol)."""
        self.applied(peer, version)
        if peer.unread_snapshot is None or version < peer.unread_snapshot:
            return False
        peer.unread_snapshot = None
        return True

    def applied(self, peer: Peer, version: int) -> None:
        """An ACK or an engine's heartbeat restates what it applied (a lost ack is
        harmless)."""
        if version <= peer.sent_version:
            peer.applied_version = version

    # ---- deltas and heartbeats ------------------------------------------------------

    def on_read(self, read: LogRead) -> None:
        """Send each connection the deltas after the version it has, in order. One whose
        next version is not in the log (pruned, or unsendable) starts over from a
        snapshot (within the snapshot rate limit; the next poll tries again); one behind
        what the read started after gets a read of its own."""
        self._newest = max(self._newest, read.newest)
        now = time.monotonic()
        behind = []
        for identity, peer in self._peers.items():
            if not self._takes_deltas(identity, peer):
                continue
            if peer.sent_version < read.since:
                behind.append(peer.sent_version)
            elif peer.sent_version + 1 in read.deltas:
                while peer.sent_version + 1 in read.deltas:
                    self._outbox.send(identity, read.deltas[peer.sent_version + 1][peer.role])
                    peer.sent_version += 1
            elif peer.sent_version < read.newest and snapshot_due(peer, now):
                self.send_snapshot(identity, peer, now)
        if behind:
            self._reader.read(min(behind))

    def beat(self) -> None:
        for identity, peer in self._peers.items():
            if peer.has_snapshot:
                # Sent after every frame up to sent_version: the engine checks it holds that.
                self._outbox.send(identity, p.encode(p.Heartbeat(peer.sent_version)))

    def poll(self) -> None:
        """The safety net, every poll interval: connections still behind the newest
        version read catch up; a snapshot read that failed is read again."""
        behind = [
            peer.sent_version
            for identity, peer in self._peers.items()
            if self._takes_deltas(identity, peer) and peer.sent_version < self._newest
        ]
        if behind:
            self._reader.read(min(behind))
        for role, waiting in list(self._awaiting.items()):
            alive = {i: peer for i, peer in waiting.items() if self._peers.get(i) is peer}
            if not alive:
                del self._awaiting[role]
                continue
            self._awaiting[role] = alive
            self._read_snapshot(role)

    def _takes_deltas(self, identity: bytes, peer: Peer) -> bool:
        """It has its snapshot, and no other is on its way to it."""
        return peer.has_snapshot and identity not in self._awaiting.get(peer.role, {})
