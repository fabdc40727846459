"""Tokens: the viewer tokens the admin hands out (read-only bearer tokens)."""
