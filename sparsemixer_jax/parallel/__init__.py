"""The device mesh and where model state goes on it: logical axis names and their rules
(:mod:`.partitioning`, JAX alone), the mesh and the placement of state and batches
(:mod:`.sharding`)."""
