"""Several `output-rate serve` processes on one PostgreSQL database (docs/replicas.md)."""
