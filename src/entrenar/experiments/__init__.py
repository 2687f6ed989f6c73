"""Experiments: commands built from the same pieces as ``train``: models trained from scratch (:mod:`.scratch`),
their architecture record (:mod:`.arch`), synthetic data (:mod:`.synth`) and the precision diagnosis
(:mod:`.diagnose`). See docs/EXPERIMENTS.md."""
