"""WMT'14 En-De, Transformer-base with 8 experts per MoE layer: ``configs/wmt.py:n8``.

    python -m experiments.wmt --config configs/wmt_n8.py --workdir runs/wmt_n8

Every field comes from configs/wmt.py; this file only names the variant.
"""

from configs import wmt


def get_config():
    return wmt.get_config("n8")
