"""Multi30k En-De at ``configs/multi30k_n4.py`` size for the issue-9 study on one GPU.

``experiments/compare.py`` sets the router, N, the seed and the arm's modifiers per run
(docs/science.md has the commands). Same model, data and optimizer as ``multi30k_n4``; denser
validation (every 250 updates) so that "updates to Switch's final loss" is resolved, and fewer
checkpoints (a study keeps none once a run is done). 8,000 updates: 2,500 was not enough for
Switch's validation loss to flatten (issue 9); whether 8,000 is, the study's curves say.
"""

from configs import multi30k_n4


def get_config():
    c = multi30k_n4.get_config()
    c.train_steps = 8000
    c.eval_every = 250
    c.checkpoint_every = 1000
    c.log_every = 50
    return c
