"""The lab: the project's own benchmarks, studies and experiments, beside the library.

Not part of the installed package (the wheel holds ``sparsemixer_jax`` alone); it lives in the
repository next to ``experiments/``, whose entry points (``python -m experiments.NAME``) drive it.

- :mod:`lab.benchmarks`: timing of routers, MoE layers, training steps and decoding;
- :mod:`lab.studies`: the convergence study, GLUE tables, the gradient-accuracy tables and
  figures, mask eligibility and parameter counts;
- :mod:`lab.router_bench`: the router-learning benchmark (a student MoE learns a teacher's
  routing);
- :mod:`lab.exact_experiment`: the accuracy sweeps of every estimator against the exact-gradient
  oracle (the oracle itself, :mod:`sparsemixer_jax.exact`, is part of the library).

The lab imports the library; the library never imports the lab
(``tests/test_layout.py`` checks).
"""
