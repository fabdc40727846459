"""Limits: users' records, tiers, the default limit, and the config version, snapshot and
change log that engines are pushed."""
