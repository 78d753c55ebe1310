"""WMT'14 En-De, Switch Transformer-base with 2 experts per MoE layer, SparseMixer router."""

from configs import wmt_base


def get_config():
    c = wmt_base.get_config()
    c.model.num_experts = 2
    return c
