"""The special token ids every vocabulary of the library shares, below both the models and the
data pipelines that agree on them.

Every SentencePiece vocabulary has ``pad = 0``, ``eos = 1``, ``unk = 2`` and no BOS (the
translation decoder's teacher-forcing shift uses ``PAD_ID`` as its start symbol); pretraining
vocabularies add the user-defined pieces ``[CLS] = 3``, ``[SEP] = 4``, ``[MASK] = 5``.
"""

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
CLS_ID = 3
SEP_ID = 4
MASK_ID = 5
FIRST_WORD_ID = 6  # ids below this are never masked, predicted or sampled
