"""Executors: build the batch, run the model, sample. `reference` is the oracle."""
