"""Evaluation metrics: BLEU (:mod:`.bleu`) and GLUE's dev metrics (:mod:`.glue_metrics`),
imported from their modules."""
