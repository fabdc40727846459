"""Prometheus view of the push server: engines, applied versions, refused messages."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.push.server import PushServer
from output_rate_core import protocol as p


class PushCollector(Collector):
    def __init__(self, server: PushServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        bound = self._server.peers.all()
        # Connections that have not acknowledged a snapshot are no engine yet.
        everyone = [peer for peer in bound if peer.proven]
        peers = [peer for peer in everyone if peer.role == p.ENGINE_ROLE]
        connected = GaugeMetricFamily(
            "output_rate_engines_connected", "Engines connected to the push endpoint"
        )
        connected.add_metric([], len({peer.engine_id for peer in peers}))
        yield connected
        unproven = GaugeMetricFamily(
            "output_rate_push_unproven_connections",
            "Connections bound to an engine id that have not acknowledged a snapshot yet",
        )
        unproven.add_metric([], len(bound) - len(everyone))
        yield unproven
        applied = GaugeMetricFamily(
            "output_rate_engine_applied_version",
            "Config version each connected engine applied",
            labels=["engine_id"],
        )
        for peer in peers:
            applied.add_metric([peer.engine_id], peer.applied_version)
        yield applied
        api_applied = GaugeMetricFamily(
            "output_rate_api_server_applied_version",
            "Config version each connected engine's API server applied (its API keys)",
            labels=["engine_id"],
        )
        for peer in everyone:
            if peer.role == p.API_ROLE:
                api_applied.add_metric([peer.engine_id], peer.applied_version)
        yield api_applied
        dropped = CounterMetricFamily(
            "output_rate_push_dropped_messages", "Malformed engine messages dropped"
        )
        dropped.add_metric([], self._server.drops.total)
        yield dropped
        refused = CounterMetricFamily(
            "output_rate_push_snapshots_refused",
            "HELLO/RESYNC left unanswered: that connection got a snapshot within the last "
            "second, or has not acknowledged the last one",
        )
        refused.add_metric([], self._server.publisher.num_snapshots_refused)
        yield refused
        sent = CounterMetricFamily(
            "output_rate_push_snapshots_sent", "Snapshots queued for engine connections"
        )
        sent.add_metric([], self._server.publisher.num_snapshots_sent)
        yield sent
        unsent = CounterMetricFamily(
            "output_rate_push_frames_unsent",
            "Frames not queued because the connection's queue was full (it does not read)",
        )
        unsent.add_metric([], self._server.outbox.num_frames_unsent)
        yield unsent
        allocating = GaugeMetricFamily(
            "output_rate_fleet_allocating",
            "1 while this replica runs the fleet allocator (the leader, or the only replica)",
        )
        allocating.add_metric([], int(self._server.leadership.allocating))
        yield allocating
        share_frames = CounterMetricFamily(
            "output_rate_fleet_share_frames",
            "Shares frames this replica's fleet allocator sent (to its engines or relayed)",
        )
        share_frames.add_metric([], self._server.leadership.num_share_frames)
        yield share_frames
        status_rows = CounterMetricFamily(
            "output_rate_push_engine_status_rows_written",
            "Engine status rows (GET /engines) this replica wrote",
        )
        status_rows.add_metric([], self._server.status.num_status_rows_written)
        yield status_rows
        elsewhere = CounterMetricFamily(
            "output_rate_push_binds_refused_elsewhere",
            "Engine ids refused because another replica holds them",
        )
        elsewhere.add_metric([], self._server.status.num_binds_refused_elsewhere)
        yield elsewhere
        dispatcher = self._server.dispatcher
        demand_refused = CounterMetricFamily(
            "output_rate_push_demand_refused",
            "Demand frames refused: over the rate one connection may send",
        )
        demand_refused.add_metric([], dispatcher.num_demand_refused)
        yield demand_refused
        implausible = CounterMetricFamily(
            "output_rate_push_implausible_demand",
            "Demand frames whose claim no honest engine makes (over 16 x its capacity, or "
            'too many users): the engine is flagged in the log (docs/fleet.md, "Trust")',
        )
        implausible.add_metric([], dispatcher.num_implausible_demands)
        yield implausible
        relay = self._server.leadership.relay
        if relay is not None:
            rows = CounterMetricFamily(
                "output_rate_fleet_relay_rows_written", "Rows this replica wrote to fleet_relay"
            )
            rows.add_metric([], relay.num_rows_written)
            yield rows
            transactions = CounterMetricFamily(
                "output_rate_fleet_relay_transactions",
                "Transactions of this replica's fleet relay (write: batches; read: takes)",
                labels=["kind"],
            )
            transactions.add_metric(["write"], relay.num_write_transactions)
            transactions.add_metric(["read"], relay.num_read_transactions)
            yield transactions
            fenced = CounterMetricFamily(
                "output_rate_fleet_relay_fenced",
                "Share batches refused at write (no longer the leader) or not delivered "
                "(another leader's token)",
            )
            fenced.add_metric([], relay.num_fenced + relay.num_stale)
            yield fenced
