"""KV cache bookkeeping: the page pool and its prefix cache."""
