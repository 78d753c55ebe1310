"""Studies and their results: a convergence study's arms (:mod:`.arms`), runs (:mod:`.runner`),
summary (:mod:`.summary`) and figures (:mod:`.figures`); training curves and router diagnostics
of any run (:mod:`.curves`); GLUE tables (:mod:`.glue_table`); the exact-gradient experiment's
tables and figure (:mod:`.gradient_accuracy`); the mask's eligibility at initialisation
(:mod:`.mask_eligibility`); parameter counts (:mod:`.param_counts`).
"""
