"""ELECTRA-style pretraining, Base setting, a dense discriminator (no experts):
``configs/electra.py:dense``.

    python -m experiments.pretrain --config configs/electra_dense.py --workdir runs/electra_dense

Every field comes from configs/electra.py; this file only names the variant.
"""

from configs import electra


def get_config():
    return electra.get_config("dense")
