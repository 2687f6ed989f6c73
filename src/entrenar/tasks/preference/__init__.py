"""Preference optimisation: DPO, IPO, SimPO, ORPO and KTO as a task on the one training loop.

One module per idea, each importing only those before it:

* :mod:`.losses`: each loss from sequence log-probabilities, with TRL's semantics (differences said there);
* :mod:`.logprobs`: the completion log-probabilities of a batch's sequences, chunk by chunk from the hidden states;
* :mod:`.sharing`: whether a pair's prompt is computed once for both completions (``task.share_prompt``);
* :mod:`.precomputed`: the reference's log-probabilities kept in the run folder (``task.reference: precomputed``);
* :mod:`.reference`: what ``task.reference`` becomes, and the reference model's log-probabilities of a batch;
* :mod:`.metrics`: TRL's metrics summed on the device, held-out evaluations and which one is the best;
* :mod:`.scoring`: a batch's per-pair losses from the policy's and the reference's log-probabilities;
* :mod:`.task`: :class:`PreferenceTask`, the Task protocol (:mod:`entrenar.tasks.base`) built from the above;
* :mod:`.commands`: a model's preference metrics on a data file (``entrenar eval``).
"""

from entrenar.tasks.preference.commands import evaluate_preference_file
from entrenar.tasks.preference.metrics import ACCURACY, PreferenceEval
from entrenar.tasks.preference.reference import reference_of
from entrenar.tasks.preference.sharing import share_prompt_of
from entrenar.tasks.preference.task import PreferenceTask

__all__ = ["ACCURACY", "PreferenceEval", "PreferenceTask", "evaluate_preference_file", "reference_of",
           "share_prompt_of"]
