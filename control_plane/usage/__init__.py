"""Usage: live usage as engines report it (the book), its per-minute history (the
recorder and its queries), and the per-tier rates /metrics shows."""
