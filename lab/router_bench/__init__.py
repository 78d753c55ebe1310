"""A controlled router-learning benchmark: a student MoE learns a teacher MoE's labels.

Where does SparseMixer's more accurate router gradient pay off against Switch? Here learning
the router is the bottleneck: the teacher's experts are fixed random MLPs that differ, its
router a fixed linear map with a controlled margin (:mod:`.teacher`); the student is the
project's ``MoEFeedForward`` (:mod:`.student`), trained with Adam on every seed at once
(:mod:`.train`); :mod:`.metrics` measures partition agreement, the share of tokens without
router gradient and the cosine with the exact router gradient; :mod:`.arms` lists the arms and
:mod:`.report` turns the runs into tables and plots. Entry point: ``python -m
experiments.router_bench``; findings: ``docs/router_bench.md``.
"""
