"""What the benchmarks measure with: models of known shapes, decode policies, perplexity, memory, reports."""
