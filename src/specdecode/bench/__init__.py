"""`specdecode bench`: side-by-side benchmarks against plain decoding and transformers' baselines."""
