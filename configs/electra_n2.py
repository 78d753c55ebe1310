"""ELECTRA-style pretraining, Base setting, Switch+SparseMixer with 2 experts on every other FFN.

`--config.router.name=switch` gives the Switch baseline of the paper's Table 2.
"""

from configs import electra_base


def get_config():
    c = electra_base.get_config()
    c.model.num_experts = 2
    return c
