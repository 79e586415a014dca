"""Benchmarks: the timing harness (`harness`, a leaf), the KV cache (`kv`), the workspace's decode cost
(`workspace`), the backbone against HF transformers (`vs_hf`), training throughput (`train`), a router model's decode
step by part (`decode`) and long contexts (`long`); `cli` reads their options and runs the one asked for."""

MIN_NEW_TOKENS = 3  # `bench decode`: the first generated step holds the prefill, two more make a timed mean (its
#   command line's bound and its own check read this one number)
