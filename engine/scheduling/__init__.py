"""Continuous batching: requests, the token-budget scheduler, the KV cache manager and its block pool."""
