"""Sequence classification and regression: what a batch means and how it is scored.

One module per concern, each importing only those before it:

* :mod:`.labels`: what the labels of a run are; a record's label parsed, errors naming file and line;
* :mod:`.data`: labeled texts read from data files, :class:`LabeledStream` (BatchStream's order and resume, padded
  rows + ``attention_mask`` + ``labels``), class weights;
* :mod:`.loss`: CE / BCE / MSE summed, divided by the step's (weighted) targets by the training step;
* :mod:`.evaluation`: logits of labeled texts, their metrics, which way each metric is better;
* :mod:`.calibration`: temperature and thresholds fitted on validation at the end of a run;
* :mod:`.saving`: the adapter with the head, or the classifier folder; the calibration in classifier.json;
* :mod:`.task`: :class:`ClassificationTask`, the Task protocol (:mod:`entrenar.tasks.base`) built from the above;
* :mod:`.commands`: a trained classifier's report on a file, or its predictions (``entrenar classify``).

Loading a classifier (a ``*ForSequenceClassification`` folder, or a language model with a head) is
:mod:`entrenar.loading.classifier`.
"""

from entrenar.tasks.classification.calibration import calibrate
from entrenar.tasks.classification.commands import evaluate_file, predict_file
from entrenar.tasks.classification.data import (
    LabeledStream,
    LabeledText,
    class_weights,
    collate,
    pad_rows,
    read_labeled,
    read_texts,
)
from entrenar.tasks.classification.evaluation import (
    HIGHER_IS_BETTER,
    LOWER_IS_BETTER,
    METRICS,
    ClassificationEval,
    metric_direction,
    predict_logits,
    score,
    targets_array,
    thresholds_of,
)
from entrenar.tasks.classification.labels import LabelSpec, label_spec
from entrenar.tasks.classification.loss import loss_sum
from entrenar.tasks.classification.saving import save_result, update_classifier_file
from entrenar.tasks.classification.task import ClassificationTask

__all__ = [
    "HIGHER_IS_BETTER",
    "LOWER_IS_BETTER",
    "METRICS",
    "ClassificationEval",
    "ClassificationTask",
    "LabelSpec",
    "LabeledStream",
    "LabeledText",
    "calibrate",
    "class_weights",
    "collate",
    "evaluate_file",
    "label_spec",
    "loss_sum",
    "metric_direction",
    "pad_rows",
    "predict_file",
    "predict_logits",
    "read_labeled",
    "read_texts",
    "save_result",
    "score",
    "targets_array",
    "thresholds_of",
    "update_classifier_file",
]
