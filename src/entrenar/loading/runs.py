"""Run folders as models: what a run folder, its ``best/`` or a ``checkpoints/step-N`` stands for.

    source = resolve_model_and_adapter("outputs/my-run")      # a LoRA run: its base model + adapter/
    source = resolve_model_and_adapter("outputs/my-run/checkpoints/step-200")   # the base + that step's state
    model, tokenizer = entrenar.load("outputs/my-run/best")   # entrenar.load resolves the same way

Every command that takes a model or an adapter (eval, generate, chat, export, quantize) goes through
:func:`resolve_model_and_adapter`, so each accepts the same paths:

* ``RUN`` (a folder with ``recipe.yaml``): a LoRA run's ``adapter/`` on the recipe's base model, or a full
  fine-tune's ``model/``;
* ``RUN/best``: the same, from the output kept at the best evaluation;
* a QAT run: its ``quantized/`` integer model (with ``adapter/`` in LoRA-QAT), what the run trained;
* ``RUN/checkpoints/step-N``: the trainable state of that step (a LoRA run's adapter weights, on the
  recipe's base model; a full fine-tune's weights) on the recipe's base model;
* an adapter folder given as the model (``RUN/adapter``): its base is the run's model, or else the local
  folder its ``adapter_config.json`` names as ``base_model_name_or_path``;
* anything else: a model folder or GGUF file, as it is; a name that is not a local path and spells a Hugging
  Face Hub id (``org/name``, ``org/name@revision``, ``org/name/file.gguf``) is the cached snapshot of that model
  or adapter (:mod:`entrenar.io.hub`), fetched first when the Hub is reachable. A run's ``model.path`` and an
  adapter's ``base_model_name_or_path`` may be Hub ids too.

The run's recipe comes along (:attr:`ModelSource.recipe`), so ``entrenar eval`` can mask and end examples as
training did (``data.train_on``, ``data.add_eos``, ``data.seq_len``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from entrenar.adapters.lora import apply_lora, load_lora_state_dict, lora_config_of
from entrenar.config import Recipe, load_recipe
from entrenar.errors import AdapterError, EntrenarError, ModelError
from entrenar.io import hub
from entrenar.io.checkpoint_files import MODEL_FILE, SHARDS_DIR, is_sharded, read_model_tensors
from entrenar.io.run_dir import ADAPTER_DIR, BEST_DIR, METRICS_FILE, MODEL_DIR, QUANTIZED_DIR, RECIPE_FILE
from entrenar.models.hf import iter_safetensors, load_state_into

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

_STEP = re.compile(r"step-\d+")


@dataclass(frozen=True)
class ModelSource:
    """What to load: a model (folder or GGUF), an adapter on it, and a checkpoint's trainable state on top."""

    model: Path
    adapter: Path | None = None
    checkpoint: Path | None = None  # a checkpoints/step-N folder of the run
    recipe: Recipe | None = None  # the run's recipe, when a run's folder was named
    run_dir: Path | None = None

    @property
    def quantize_base(self) -> str | None:
        """The base quantization the run trained its adapter on (QLoRA: "nf4"), if any."""
        lora = self.recipe.lora if self.recipe is not None else None
        if lora is None or (self.adapter is None and self.checkpoint is None):
            return None
        return lora.quantize_base


def run_folder_of(path: str | Path) -> tuple[Path, str] | None:
    """(run folder, what ``path`` is in it) when ``path`` is a run, its ``best/``, a checkpoint, or an output.

    The kinds: "run", "best", "checkpoint", "adapter", "model" (``adapter/``, ``model/`` or ``quantized/``
    of the run, ``adapter/`` or ``model/`` of its ``best/``). Only these positions count, so a model folder that
    happens to sit beside some ``recipe.yaml`` is not mistaken for a run.
    """
    path = Path(path)
    if is_run_folder(path):
        return path, "run"
    parent = path.parent
    if path.name == BEST_DIR and is_run_folder(parent):
        return parent, "best"
    if _STEP.fullmatch(path.name) and parent.name == "checkpoints" and is_run_folder(parent.parent):
        return parent.parent, "checkpoint"
    if path.name == QUANTIZED_DIR and is_run_folder(parent):
        return parent, MODEL_DIR  # a plain (quantized) model folder, with the run's recipe
    if path.name in (ADAPTER_DIR, MODEL_DIR):
        if is_run_folder(parent):
            return parent, path.name
        if parent.name == BEST_DIR and is_run_folder(parent.parent):
            return parent.parent, path.name
    return None


def is_run_folder(folder: Path) -> bool:
    """A folder ``entrenar train`` wrote: its recipe.yaml beside metrics.jsonl or checkpoints/ (a project
    folder that merely holds a recipe.yaml is not one)."""
    return (folder / RECIPE_FILE).is_file() and (
        (folder / METRICS_FILE).is_file() or (folder / "checkpoints").is_dir())


def read_run_recipe(run_dir: Path) -> Recipe:
    """The recipe a run saved (its resolved recipe.yaml)."""
    try:
        return load_recipe(run_dir / RECIPE_FILE)
    except EntrenarError as e:
        raise ModelError(f"{run_dir}: the run's {RECIPE_FILE} cannot be read: {e}") from None


def base_model_path(recipe: Recipe, run_dir: Path) -> Path:
    """The recipe's ``model.path``; a relative one is tried from here, then from each folder above the run
    (training ran from one of them), then as a Hub id. Where it brought an adapter that the run trained on (a PEFT
    folder, a LoRA run), the base that adapter sits on: the run's adapter replaces it."""
    path = _recipe_model_path(recipe, run_dir)
    source = resolve_model_and_adapter(path)
    return source.model if source.adapter is not None or source.checkpoint is not None else path


def _recipe_model_path(recipe: Recipe, run_dir: Path) -> Path:
    if recipe.model.init == "random" and recipe.lora is None:  # a checkpoint holds every weight: any folder of
        if (run_dir / MODEL_DIR / "config.json").is_file():    # the architecture is its base, the run's model/ one
            return run_dir / MODEL_DIR
        raise ModelError(f"{run_dir}: a checkpoint of a model trained from scratch (model.init random) loads onto "
                         f"the run's {MODEL_DIR}/ folder, written when the run ends; it is not there yet")
    if recipe.model.path is None:
        raise ModelError(f"{run_dir / RECIPE_FILE}: model.path is not set, so the run's base model is unknown")
    path = Path(recipe.model.path)
    if path.is_absolute() or path.exists():
        return path
    for folder in run_dir.absolute().parents:
        if (folder / path).exists():
            return folder / path
    try:
        hub_id = hub.parse_hub_id(recipe.model.path)
    except ModelError:
        hub_id = None
    if hub_id is not None:
        return hub.fetch(hub_id)
    raise ModelError(f"{run_dir / RECIPE_FILE}: the base model {path} (model.path) is not found from here or "
                     f"from any folder above the run")


def _adapter_base(adapter: Path) -> Path | None:
    """The base model an adapter's config names (``base_model_name_or_path``, at ``revision`` when set): a local
    path that exists, or the cached snapshot of a Hub id; None when it names neither."""
    try:
        config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
        name, revision = config.get("base_model_name_or_path"), config.get("revision")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(name, str) or not name:
        return None
    if Path(name).exists():
        return Path(name)
    try:
        hub_id = hub.parse_hub_id(name)
    except ModelError:
        return None
    if hub_id is None:
        return None
    return hub.resolve(name, revision if isinstance(revision, str) else None)


def _base_name(path: str | Path) -> str:
    """What a base model is called, to compare an adapter's base with a model: the folder's name (a Hub cache
    snapshot's repository name, ``models--org--name/snapshots/<rev>``), a Hub id's name, a GGUF file's stem."""
    p = Path(str(path).rstrip("/\\"))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1].lower()
    return (p.stem if p.suffix.lower() == ".gguf" else p.name).lower()


def adapter_base_mismatch(adapter: Path, model: Path) -> str | None:
    """A one-line note when ``adapter``'s adapter_config.json names a base model (``base_model_name_or_path``)
    other than ``model``, the one it is being applied to; None when it names none or the same one.

    The same one: the same folder, or the same name (a folder's name, a Hub id's, a Hub cache snapshot's; a GGUF
    file's stem starting with it, as ``SmolLM2-135M-Instruct.Q4_1.gguf`` for ``HuggingFaceTB/SmolLM2-135M-Instruct``).
    Shapes are not compared here: a base of other shapes is refused when the tensors are checked. Configs are not
    either: a base and its instruct tune share theirs, and an adapter of one means little on the other."""
    try:
        name = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get(
            "base_model_name_or_path")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(name, str) or not name.strip():
        return None
    named = Path(name)
    if named.exists() and named.resolve() == model.resolve():
        return None
    wanted, have = _base_name(name), _base_name(model)
    if wanted == have or (model.suffix.lower() == ".gguf" and have.startswith(wanted)):
        return None
    return (f"{adapter}: this adapter was trained on {name} (adapter_config.json, base_model_name_or_path) and is "
            f"applied to {model}; the shapes fit, but an adapter means little on another base (ignore this if "
            f"{model.name} is a copy of {name})")


def _in_run(run_dir: Path, kind: str, path: Path) -> tuple[Path, Path | None, Path | None]:
    """(model, adapter, checkpoint) that ``path`` of the given kind stands for in the run."""
    recipe = read_run_recipe(run_dir)
    if kind == "checkpoint":
        if recipe.qat is not None:
            raise ModelError(f"{path}: a QAT run's checkpoint holds fake-quantization state; use the run's "
                             f"{'adapter' if recipe.lora else 'model'} or its quantized/ folder")
        return base_model_path(recipe, run_dir), None, path
    folder = path if kind in ("run", "best") else path.parent
    if recipe.qat is not None and kind in ("run", "best"):  # what QAT trained is the integer model
        quantized = run_dir / QUANTIZED_DIR
        # qat.quantize_lora: the adapter is merged into the integer weights (Q(W + BA) is what trained)
        adapter = run_dir / ADAPTER_DIR if recipe.lora is not None and not recipe.qat.quantize_lora else None
        if kind == "best" or not quantized.is_dir():
            pair = f"{quantized}" + (f" with the adapter {adapter}" if adapter else "")
            raise ModelError(f"{path}: a QAT run's model is its {QUANTIZED_DIR}/ folder, written when the run "
                             f"ends; load {pair}")
        return quantized, adapter, None
    if kind == "model" or (kind in ("run", "best") and recipe.lora is None):
        model = folder / MODEL_DIR if kind != "model" else path
        if not model.is_dir():
            raise ModelError(f"{path}: the run has no {model.name}/ yet (interrupted?); name one of its "
                             f"checkpoints instead: {run_dir / 'checkpoints'}/step-N")
        return model, None, None
    adapter = folder / ADAPTER_DIR if kind != "adapter" else path
    if not adapter.is_dir():
        raise ModelError(f"{path}: the run has no {adapter.name}/ yet (interrupted?); name one of its "
                         f"checkpoints instead: {run_dir / 'checkpoints'}/step-N")
    return base_model_path(recipe, run_dir), adapter, None


def brings_adapter(path: str | None) -> bool:
    """Whether a recipe's ``model.path`` brings an adapter that training continues (a PEFT folder, a LoRA run or
    checkpoint): the starting policy is then base and adapter, not the base (a preference run's reference)."""
    if path is None:
        return False
    try:
        return resolve_model_and_adapter(path).adapter is not None
    except EntrenarError:  # loading the model says what is wrong, where it is said
        return False


def base_model_name(path: str | Path | None) -> str:
    """What an adapter trained from ``path`` (a recipe's ``model.path``) records as its base
    (``base_model_name_or_path``): ``path`` itself, or, where it brings an adapter (a PEFT folder, a LoRA run or
    checkpoint) that is trained on, the base that adapter names, as it names it (a Hub id stays one)."""
    if path is None:  # a model drawn at random (model.init)
        return str(path)
    source = resolve_model_and_adapter(path)
    if source.adapter is None:
        return str(path)
    try:
        name = json.loads((source.adapter / "adapter_config.json").read_text(encoding="utf-8"))
        name = name.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError, RecursionError):
        name = None
    return name if isinstance(name, str) and name else str(source.model)


def resolve_model_and_adapter(model: str | Path, adapter: str | Path | None = None) -> ModelSource:
    """What ``model`` (and ``adapter``) stand for; see the module docstring. Checks paths, reads no weights
    (a Hub id not yet cached is downloaded)."""
    model = hub.resolve(model)
    found = run_folder_of(model)
    recipe_run: Path | None = found[0] if found else None
    if found is not None and found[1] != "model":  # a run's model/ is a plain model folder, with the run's recipe
        model_path, run_adapter, checkpoint = _in_run(found[0], found[1], model)
    elif (model / "adapter_config.json").is_file() and not (model / "config.json").is_file():
        base = _adapter_base(model)
        if base is None:
            raise ModelError(f"{model}: is an adapter folder, and its adapter_config.json names no local base "
                             "model or Hub id; pass the base model as MODEL and this folder as --adapter")
        model_path, run_adapter, checkpoint = base, model, None
    else:
        model_path, run_adapter, checkpoint = model, None, None

    if adapter is not None:
        if run_adapter is not None or checkpoint is not None:
            raise AdapterError(f"--adapter {adapter}: {model} already brings its adapter (a LoRA run or "
                               "checkpoint); pass the base model as MODEL, or leave --adapter out")
        adapter = hub.resolve(adapter)
        found_adapter = run_folder_of(adapter)
        if found_adapter is not None:
            run_dir, kind = found_adapter
            recipe_run = run_dir
            if kind == "model" or read_run_recipe(run_dir).lora is None:
                raise AdapterError(f"{adapter}: is a full fine-tune's run, not an adapter; pass it as MODEL")
            _, run_adapter, checkpoint = _in_run(run_dir, kind, adapter)
        else:
            run_adapter = adapter
    recipe = read_run_recipe(recipe_run) if recipe_run is not None else None
    if checkpoint is not None:
        _check_checkpoint(checkpoint)
    return ModelSource(model=model_path, adapter=run_adapter, checkpoint=checkpoint, recipe=recipe,
                       run_dir=recipe_run)


def _check_checkpoint(checkpoint: Path) -> None:
    if not (checkpoint / MODEL_FILE).is_file() and not is_sharded(checkpoint):
        raise ModelError(f"{checkpoint}: no {MODEL_FILE} (an incomplete checkpoint?)")


def apply_checkpoint(model: torch.nn.Module, source: ModelSource) -> None:
    """Put a checkpoint's trainable state on ``model`` (loaded from ``source.model``): a LoRA run's adapter
    (wrapping the layers its recipe names), or a full fine-tune's weights. Every name and shape is checked."""
    assert source.checkpoint is not None and source.recipe is not None and source.run_dir is not None
    named: Iterator[tuple[str, str, torch.Tensor]]
    if is_sharded(source.checkpoint):  # an FSDP run's: the shards joined in this process
        file = source.checkpoint / SHARDS_DIR
        named = ((file.name, name, tensor) for name, tensor in read_model_tensors(source.checkpoint).items())
    else:
        file = source.checkpoint / MODEL_FILE
        named = iter_safetensors([file])
    if source.recipe.lora is None:
        load_state_into(model, named, str(source.checkpoint))
        return
    state = {name: tensor for _, name, tensor in named}
    try:
        lora = lora_config_of(source.recipe.lora)
        assert lora is not None  # of a lora section
        apply_lora(model, lora)
    except AdapterError as e:
        raise AdapterError(f"{source.run_dir / RECIPE_FILE}: lora.target_modules: {e}") from None
    load_lora_state_dict(model, state, str(file))


__all__ = ["ModelSource", "apply_checkpoint", "base_model_name", "base_model_path", "brings_adapter", "read_run_recipe",
           "resolve_model_and_adapter", "run_folder_of"]
