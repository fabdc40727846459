"""Limits: users' records, tiers and the default limit: their rules, views and previews
(every write commits through the config log, control_plane/config/)."""
