"""The routers, one module per concern; :mod:`sparsemixer_jax.routing` gathers their public
names.

* :mod:`~sparsemixer_jax.routers.common`: :class:`RouterOutput` and the argument checks.
* :mod:`~sparsemixer_jax.routers.sparsemixer`: SparseMixer and GRIN's SparseMixer-v2.
* :mod:`~sparsemixer_jax.routers.switch`: Switch routing (also DenseMixer's and Default MoE's
  forward).
* :mod:`~sparsemixer_jax.routers.successors`: DenseMixer's and Default MoE's term for the
  experts a token did not choose.
* :mod:`~sparsemixer_jax.routers.losses`: load-balancing loss, z-loss, routing statistics.
* :mod:`~sparsemixer_jax.routers.registry`: routers by name and their options.
"""
