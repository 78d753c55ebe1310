"""Compiling for hardware this machine does not have (ahead-of-time, "deviceless" compiles)."""
