"""WMT'14 En-De, dense Transformer-base (no experts): the baseline of the paper's Table 1."""

from configs import wmt_base


def get_config():
    c = wmt_base.get_config()
    c.model.num_experts = 0
    return c
