"""Benchmarks: the timing harness (:mod:`.harness`), the model-FLOP count (:mod:`.flops`), the
profile-trace summary (:mod:`.trace`), the sections that time a training step
(:mod:`.training_step`), single layers (:mod:`.layers`) and decoding (:mod:`.decoding`), the run
over the chosen sections (:mod:`.runner`) and its markdown tables (:mod:`.report`).
"""
