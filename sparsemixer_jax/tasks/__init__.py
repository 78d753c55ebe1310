"""The experiments as tasks of the one training loop (:mod:`sparsemixer_jax.training`).

* :mod:`~sparsemixer_jax.tasks.translation`: the Switch Transformer on a language pair (WMT'14).
* :mod:`~sparsemixer_jax.tasks.pretraining`: ELECTRA-style pretraining of the MoE encoder.
* :mod:`~sparsemixer_jax.tasks.finetuning`: GLUE fine-tuning of a pretrained encoder.
"""
