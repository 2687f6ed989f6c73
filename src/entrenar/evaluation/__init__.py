"""Evaluation beyond held-out loss: classification and regression metrics (``metrics``), calibration, and the
report written at the end of a classification run or by ``entrenar classify eval`` (``report``).

Held-out loss and perplexity of a language model stay in :mod:`entrenar.evaluation.loss`.
"""
