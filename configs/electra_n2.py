"""ELECTRA-style pretraining, Base setting, 2 experts per MoE layer of the discriminator:
``configs/electra.py:n2``.

    python -m experiments.pretrain --config configs/electra_n2.py --workdir runs/electra_n2

Every field comes from configs/electra.py; this file only names the variant.
"""

from configs import electra


def get_config():
    return electra.get_config("n2")
