"""Experiments: models trained from scratch (:mod:`.scratch`), their architecture record (:mod:`.arch`) and
synthetic data (:mod:`.synth`). See docs/EXPERIMENTS.md."""
