"""The CPU benchmarks of training: ``medvol-train bench-learning`` (:mod:`.learning`, the real-CT
learning benchmark, with its settings, cases and scoring in ``learning_*``) and ``medvol-train bench-vision`` (:mod:`.vision`, the synthetic vision sanity
stage), with what they share: the bench models (:mod:`.model`), the output folder, image ablations
and statistics (:mod:`.common`), and tables, curves and result files (:mod:`.report`).

Importing this package imports nothing else: each stage module is imported when it is used.
"""
