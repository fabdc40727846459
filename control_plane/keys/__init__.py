"""API keys: issued to users over REST, pushed (hashes only) to engines' API servers."""
