"""Audit: who changed what, one entry per change (limits, tiers, the default, tokens)."""
