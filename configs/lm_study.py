"""The language-model router study on a CPU: the quickstart model (Mixtral-style, 8 experts,
top-2) trained from scratch on the Wikipedia sample for 600 updates, validated every 100 on the
last 300 articles, then on WikiText-2's test file.

    python -m experiments.compare --config configs/lm_study.py --root runs/lm_study \
        --arms sparsemixer_v2star_n8 sparsemixer_v2_n8 switch_n8_eps0_norm1 \
               densemixer_n8_eps0_norm1 default_moe_n8_eps0_norm1 \
        --versus switch_n8_eps0_norm1 --seeds 0 1 2 3 4 --parallel 2 --compact --no-dense

The arms set the router (``router.name``); the routers with Switch's forward route as Mixtral
does (the model type's ``norm_topk_prob`` is always on, and the config must say so): no jitter
(``_eps0``) and the two gates renormalised (``_norm1``). SparseMixer-v2 and v2* keep
``jitter_eps = 0.1`` as their mask threshold. docs/lm.md has the results.
"""

from configs import lm_quickstart


def get_config():
    c = lm_quickstart.get_config()
    c.data.valid_articles = 300  # validation every 100 updates: a smaller held-out set
    c.train_steps = 600
    c.optim.decay_steps = 600
    c.eval_every = 100
    c.checkpoint_every = 100
    c.sample.tokens = 20
    return c
