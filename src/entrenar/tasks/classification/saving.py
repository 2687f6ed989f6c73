"""What a classification run writes: the adapter with the head, or the whole classifier folder; and the
calibration added to its classifier.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from entrenar.adapters.lora import LoraConfig, save_adapter
from entrenar.io import atomic
from entrenar.io.run_dir import ADAPTER_DIR, MODEL_DIR
from entrenar.loading.runs import base_model_name
from entrenar.models.classifier import CLASSIFIER_FILE, SequenceClassifier
from entrenar.models.saving import save_model_folder
from entrenar.quant.qat import master_weights

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer


def save_result(model: SequenceClassifier, tokenizer: Tokenizer, recipe: Any, out_dir: Path,
                lora_config: LoraConfig | None) -> Path:
    """The adapter with the head as PEFT saves it for SEQ_CLS (LoRA), or the whole classifier folder: the path
    written in ``out_dir``."""
    if lora_config is not None:
        out = out_dir / ADAPTER_DIR
        save_adapter(model, out, lora_config, base_model_name_or_path=base_model_name(recipe.model.path),
                     modules_to_save=["score"], task_type="SEQ_CLS")
        atomic.write_text(out / CLASSIFIER_FILE, model.saved_files()[CLASSIFIER_FILE])
        return out
    out = out_dir / MODEL_DIR
    with master_weights(model):
        save_model_folder(model, tokenizer, out)
    return out


def update_classifier_file(folder: Path, values: dict) -> None:
    """Add ``values`` to classifier.json in a saved model or adapter folder."""
    path = Path(folder) / CLASSIFIER_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    atomic.write_text(path, json.dumps({**data, **values}, indent=2) + "\n")
