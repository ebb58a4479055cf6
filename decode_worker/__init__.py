"""Decode worker: adopts KV handed over by prefill workers and decodes with continuous batching."""
