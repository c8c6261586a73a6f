"""The native model: its configuration, decoder layers, the weights and the forward
(`NativeModel`), the KV cache pool that batches sequences, one sequence (the `Backend`), the
draft head on the same layers, and the building of it all for a target."""
