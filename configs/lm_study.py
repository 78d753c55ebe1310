"""The language-model router study on a CPU: the quickstart model (Mixtral-style, 8 experts,
top-2) trained from scratch on the Wikipedia sample for 600 updates, validated every 100 on the
last 300 articles, then on WikiText-2's test file.

    python -m experiments.compare --config configs/lm_study.py --root runs/lm_study \
        --arms sparsemixer_v2star_n8 sparsemixer_v2_n8 switch_n8_eps0 densemixer_n8_eps0 \
               default_moe_n8_eps0 \
        --versus switch_n8_eps0 --seeds 0 1 2 3 4 --parallel 2 --compact --no-dense

The arms set the router (``router.name``); for the routers with Switch's forward, ``_eps0`` turns
Switch's jitter off, which with the Mixtral type's renormalised gates (``norm_topk_prob`` is
always on for Mixtral) is Mixtral's top-2 routing. SparseMixer-v2 and v2* keep
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
