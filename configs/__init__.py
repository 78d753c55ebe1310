"""ml_collections configs: plain `get_config()` functions, data only."""
