"""ELECTRA-style pretraining, Base setting, the dense baseline (no MoE layer)."""

from configs import electra_base


def get_config():
    c = electra_base.get_config()
    c.model.num_experts = 0
    return c
