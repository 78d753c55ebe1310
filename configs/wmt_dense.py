"""WMT'14 En-De, the dense Transformer-base (no experts): ``configs/wmt.py:dense``.

    python -m experiments.wmt --config configs/wmt_dense.py --workdir runs/wmt_dense

Every field comes from configs/wmt.py; this file only names the variant.
"""

from configs import wmt


def get_config():
    return wmt.get_config("dense")
