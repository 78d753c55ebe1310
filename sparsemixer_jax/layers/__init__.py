"""The models' building blocks (Flax NNX): attention and its cache, Gated DeltaNet (linear
attention) and its delta rule, rotary positions, norms, projections and the dense feed-forward,
imported from their modules (this package's ``__init__`` imports nothing)."""
