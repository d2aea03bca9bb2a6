"""Paged KV cache: block pool, prefix caching, paged storage and attention."""
