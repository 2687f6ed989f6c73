"""Preference optimisation: DPO, IPO, SimPO, ORPO and KTO as a task on the one training loop.

* :mod:`.losses`: each loss from sequence log-probabilities, with TRL's semantics (differences said there);
* :mod:`.logprobs`: the completion log-probabilities of a batch's sequences, chunk by chunk from the hidden states;
* :mod:`.task`: :class:`PreferenceTask`, the Task protocol (:mod:`entrenar.tasks.base`).
"""

from entrenar.tasks.preference.task import (
    ACCURACY,
    PreferenceEval,
    PreferenceTask,
    evaluate_preference_file,
    reference_of,
    share_prompt_of,
)

__all__ = ["ACCURACY", "PreferenceEval", "PreferenceTask", "evaluate_preference_file", "reference_of",
           "share_prompt_of"]
