"""Fleet scope: one user's limit holds summed over every engine (docs/fleet.md)."""
