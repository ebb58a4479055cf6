"""Prefill worker: pulls prompts from the Redis stream, prefills them in batches, hands the KV over."""
