"""ELECTRA-style pretraining, Base setting, Switch+SparseMixer with 4 experts on every other FFN.

`--config.router.name=switch` gives the Switch baseline of the paper's Table 2.
"""

from configs import electra_base


def get_config():
    c = electra_base.get_config()
    c.model.num_experts = 4
    return c
