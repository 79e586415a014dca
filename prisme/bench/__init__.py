"""Benchmarks: the timing harness (`harness`, a leaf), the KV cache (`kv`), the workspace's decode cost
(`workspace`), the backbone against HF transformers (`vs_hf`) and training throughput (`train`)."""
