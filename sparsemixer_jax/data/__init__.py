"""Data pipelines, one module per concern.

* :mod:`.sources`     -- translation text pairs from TFDS, line-aligned files or the synthetic pair;
* :mod:`.synthetic`   -- the generated language pair;
* :mod:`.tokenizer`   -- the joint SentencePiece vocabulary;
* :mod:`.batching`    -- tokenized pairs, length buckets, training and evaluation batches;
* :mod:`.translation` -- all of the above together (:func:`translation.load_datasets`).
* :mod:`.text`        -- pretraining text: readers, vocabulary with [CLS]/[SEP]/[MASK], packing,
                         MLM-masked batches.
* :mod:`.glue`        -- GLUE tasks from a GLUE-layout directory, [CLS] a [SEP] b [SEP] inputs.
* :mod:`.lm_text`     -- language-modelling documents and rows: held-out splits, packing, batches.
* :mod:`.chat`        -- chat and instruction rows: chat templates, the assistant-token loss mask.
"""

Pair = tuple[str, str]  # a (source, target) sentence pair
