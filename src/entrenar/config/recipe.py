"""A whole recipe: its sections together, read from YAML with ``--set`` overrides, saved, compared.

Errors name the file, the line, the dotted key and what is allowed, because a typo found after an hour of
training costs that hour.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from entrenar.config.overrides import apply_override
from entrenar.config.rules import _show, _unknown
from entrenar.config.sections import (
    _SECTIONS,
    DataSection,
    LoraSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    OutputSection,
    QatSection,
    RewardSection,
    ScheduleSection,
    TaskSection,
    TrainingSection,
    _BadValue,
    _Section,
)
from entrenar.config.yaml_source import Where, key_lines, load_yaml, read_yaml_text
from entrenar.errors import ConfigError
from entrenar.io import atomic

QUICKSTART = "recipes/quickstart.yaml"  # package data of `entrenar`


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and not prefix:  # sections only; lr_scale stays whole
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[prefix + key] = value
    return flat


# Training settings that only mean something on a GPU, and what each does: a recipe that names the CPU refuses them
# here; the run plan refuses them on whatever device model.device resolves to, in the same words.
GPU_ONLY = {"offload_activations": "moves activations from GPU to CPU memory",
            "offload_embeddings": "moves the embedding table from GPU to CPU memory",
            "offload_weights": "moves the NF4 base weights from GPU to CPU memory",
            "cuda_graphs": "replays GPU launches"}


@dataclass(frozen=True)
class Recipe:
    """A whole run. ``lora=None`` means full fine-tuning; ``qat=None`` no quantization-aware training."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSection | None = None
    qat: QatSection | None = None
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    output: OutputSection = field(default_factory=OutputSection)
    task: TaskSection = field(default_factory=TaskSection)
    moe: MoeSection = field(default_factory=MoeSection)
    reward: RewardSection = field(default_factory=RewardSection)  # task.type grpo

    def __post_init__(self) -> None:
        # The few checks that span sections. model.path and data.train both null is the bundled quickstart.
        if self.model.path is None and self.model.init != "random" and (
                self.data.train is not None or self.data.validation is not None):
            given = "data.train" if self.data.train is not None else "data.validation"
            raise _BadValue(  # reported where the data was named
                given,
                f"'model.path' is required (a model folder or .gguf file) when '{given}' is set; only a recipe "
                "with neither model.path nor data runs the bundled quickstart",
            )
        if (self.model.path is not None or self.model.init == "random") and self.data.train is None:
            raise _BadValue(
                "data.train",
                "'data.train' is required (a data file or folder) when model.path is set"
                + (" or model.init is random" if self.model.init == "random" else ""),
            )
        if self.task.type == "preference" and self.task.reference == "adapters_off" and self.lora is None:
            raise _BadValue("task.reference", "'task.reference' adapters_off needs LoRA or QLoRA (a lora section): "
                                              "a full fine-tune has no adapters to switch off (use copy or "
                                              "precomputed)")
        self._check_share_prompt()
        self._check_grpo()
        if self.data.validation is not None and self.data.validation_split > 0:
            raise _BadValue(
                "data.validation_split",
                f"'data.validation_split' must be 0 when 'data.validation' names a file, "
                f"got {self.data.validation_split:g}",
            )
        if self.qat is not None and self.lora is not None and self.lora.quantize_base is not None:
            raise _BadValue(
                "lora.quantize_base",
                f"'lora.quantize_base' must be null when 'qat' is set, got {_show(self.lora.quantize_base)} "
                "(QAT fake-quantizes full-precision weights; LoRA-QAT is 'qat' with a plain 'lora' section). An "
                "NF4 base is quantized and frozen already: QLoRA trains the adapters against the very base they "
                "ship with, which is what QAT buys, and rounding it again to an integer grid would quantize twice "
                "and export a re-quantization. For an integer model train LoRA-QAT on the 16-bit base (memory: "
                "entrenar inspect MODEL --qat BITS); for the least memory, QLoRA without qat",
            )
        if self.qat is not None:
            self._check_qat()
        if self.model.device == "cpu":  # settings that only mean something on a GPU, asked for explicitly
            for key, what in GPU_ONLY.items():
                if getattr(self.training, key) not in (False, 0, "auto"):  # true, or a layer count
                    raise _BadValue(f"training.{key}", f"'training.{key}' {what}; model.device is 'cpu'")
        if self.training.offload_embeddings is True and self.lora is None:
            raise _BadValue(
                "training.offload_embeddings",
                "'training.offload_embeddings' keeps a frozen embedding table in CPU memory, and full fine-tuning "
                "trains it (add a 'lora' section, or turn it off)",
            )
        if self.training.offload_weights is True and (self.lora is None or self.lora.quantize_base != "nf4"):
            raise _BadValue(
                "training.offload_weights",
                "'training.offload_weights' streams NF4 base weights from CPU memory (QLoRA); this recipe has "
                "no NF4 base (set lora.quantize_base: nf4, or turn it off)",
            )
        if self.training.cuda_graphs is True and self.data.padding_free is True:
            raise _BadValue(
                "training.cuda_graphs",
                "'training.cuda_graphs' needs batches of one layout, and 'data.padding_free' changes it with every "
                "batch (turn one of them off)",
            )
        if self.training.precision == "fp16" and self.model.device == "cpu":
            raise _BadValue(
                "training.precision",
                "'training.precision' fp16 needs a CUDA device but model.device is 'cpu' "
                "(use bf16 or fp32 on CPU)",
            )

    def _check_share_prompt(self) -> None:
        """``task.share_prompt: true`` needs preference pairs laid out padding-free."""
        if self.task.share_prompt is not True:
            return
        if self.task.type != "preference" or self.task.loss == "kto":
            what = "task.loss kto has unpaired examples" if self.task.type == "preference" else \
                f"task.type is {self.task.type}"
            raise _BadValue("task.share_prompt", f"'task.share_prompt' true computes the prompt of a preference "
                                                 f"pair once for both completions; {what} (set it to auto or false)")
        if self.data.padding_free is False:
            raise _BadValue("task.share_prompt", "'task.share_prompt' true lays each pair out padding-free "
                                                 "([prompt, chosen, rejected] in one row), and 'data.padding_free' "
                                                 "is false (turn one of them off, or set share_prompt: auto)")

    def _check_grpo(self) -> None:
        """GRPO needs reward functions, and a KL term needs the reference (adapters off: a lora section)."""
        if self.task.type != "grpo":
            if self.reward.functions:
                raise _BadValue("reward.functions", "'reward.functions' score GRPO's completions; task.type is "
                                                    f"{self.task.type} (set task.type: grpo, or remove it)")
            return
        if not self.reward.functions:
            raise _BadValue("reward.functions", "'reward.functions' is required for task.type grpo (module:function "
                                                "or a built-in: exact_answer, format, length)")
        if self.task.kl_beta > 0 and self.lora is None:
            raise _BadValue("task.kl_beta", "'task.kl_beta' > 0 needs a reference: train with LoRA (the reference is "
                                            "the model with its adapters off), or set task.kl_beta: 0")

    def _check_qat(self) -> None:
        """The qat keys that depend on other sections: learned steps need lsq, the LoRA keys a lora section."""
        qat, lora = self.qat, self.lora
        assert qat is not None
        if qat.scale_lr is not None and qat.backward != "lsq":
            raise _BadValue("qat.scale_lr", f"'qat.scale_lr' is the learning rate of LSQ's learned step sizes, and "
                                            f"qat.backward is {qat.backward} (set backward: lsq, or scale_lr: null)")
        if qat.target_modules == "lora" and lora is None:
            raise _BadValue("qat.target_modules", "'qat.target_modules' lora selects the layers LoRA adapts, and "
                                                  "the recipe has no lora section")
        if qat.quantize_lora and lora is None:
            raise _BadValue("qat.quantize_lora", "'qat.quantize_lora' quantizes the adapters with their base, and "
                                                 "the recipe has no lora section")
        if qat.quantize_lora and lora is not None and lora.dropout > 0:
            raise _BadValue("qat.quantize_lora", f"'qat.quantize_lora' quantizes W + BA as one weight, which adapter "
                                                 f"dropout has no form of (lora.dropout is {lora.dropout:g}; set 0)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (YAML/JSON-ready), every key present."""
        out: dict[str, Any] = {}
        for f in fields(self):
            section = getattr(self, f.name)
            out[f.name] = None if section is None else {
                g.name: _plain(getattr(section, g.name)) for g in fields(section)
            }
        return out

    def to_yaml(self) -> str:
        """The full recipe as YAML, in section order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Recipe:
        """Validate a dict shaped like a recipe file (missing keys take defaults).

        ``source`` names the origin in error messages.
        """
        return _build(d, Where(source), default_name="run")


RESUMABLE_KEYS: tuple[str, ...] = tuple(key for _, key in sorted(
    (f.metadata["resumable"], f"{name}.{f.name}")
    for name, cls in _SECTIONS.items() for f in fields(cls) if "resumable" in f.metadata
))
"""The dotted keys a ``--resume`` may change (a run's length, logging, saving, speed levers): the sections' fields
marked ``resumable``, in the order they became resumable."""


def load_recipe(path: str | Path | None, overrides: Iterable[str] = ()) -> Recipe:
    """Read a recipe file (``None``: the bundled quickstart) and apply ``--set`` overrides.

    Each override is ``dotted.key=value``; the value is parsed as YAML and checked
    like a value in the file. ``output.name`` defaults to the file's stem.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    if path is None:
        text = importlib.resources.files("entrenar").joinpath(QUICKSTART).read_text(encoding="utf-8")
        source, stem = f"entrenar/{QUICKSTART}", "quickstart"
    else:
        path = Path(path)
        source, stem = str(path), path.stem
        if not path.exists():
            raise ConfigError(f"recipe file not found: {path}")
        if not path.is_file():
            raise ConfigError(f"recipe path is not a file: {path}")
        text = read_yaml_text(path, "recipe")
    raw, where = _parse(text, source)
    for item in overrides:
        apply_override(raw, item, where)
    return _build(raw, where, default_name=stem)


def save_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the resolved recipe as YAML (atomically), so a resume can compare against it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Resolved recipe: every default and --set override applied. Written by entrenar.\n"
    atomic.write_text(path, header + recipe.to_yaml())


def recipe_changes(old: Recipe, new: Recipe) -> list[str]:
    """Dotted keys whose values differ, as ``"key: old -> new"`` lines (empty if equal)."""
    a, b = _flatten(old.to_dict()), _flatten(new.to_dict())
    keys = dict.fromkeys([*a, *b])  # ordered union
    return [f"{k}: {_show(a.get(k))} -> {_show(b.get(k))}" for k in keys if a.get(k) != b.get(k)]


def _parse(text: str, source: str) -> tuple[dict[str, Any], Where]:
    """YAML text -> (top-level dict, line of every key)."""
    raw, node = load_yaml(text, source)
    if raw is None:
        raise ConfigError(f"{source}: the recipe is empty (expected sections: {', '.join(_SECTIONS)})")
    if not isinstance(raw, dict):
        assert node is not None  # a document that is not empty has a node
        raise ConfigError(
            f"{source} line {node.start_mark.line + 1}: the top level must be a mapping of sections "
            f"({', '.join(_SECTIONS)}), got {_show(raw)}"
        )
    return raw, Where(source, key_lines(node, source, depth=3))  # section.key.lr_scale-pattern at most


def _build(raw: Any, where: Where, default_name: str) -> Recipe:
    """Raw recipe dict -> Recipe; every error names where its key was written."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.source}: a recipe must be a mapping of sections, got {_show(raw)}")
    for name in raw:
        if name not in _SECTIONS:
            raise _unknown(where(str(name)), str(name), name, list(_SECTIONS))
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        value = raw.get(name)
        if name in ("lora", "qat") and value is None:
            sections[name] = None
            continue
        if name == "output" and value is None:
            value = {}
        if name == "output" and isinstance(value, dict) and value.get("name") is None:
            value = {**value, "name": default_name}
        sections[name] = _build_section(cls, value, where)
    try:
        return Recipe(**sections)
    except _BadValue as e:
        raise ConfigError(f"{where(e.key)}: {e}") from None


def _build_section(cls: type[_Section], value: Any, where: Where) -> _Section:
    """One raw section (a dict, or None for all defaults) -> its dataclass."""
    name = cls.section
    allowed = [f.name for f in fields(cls)]
    if value is None:  # an empty section header: all defaults
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where(name)}: '{name}' must be a mapping of keys ({', '.join(allowed)}), got {_show(value)}"
        )
    for key in value:
        if key not in allowed:
            dotted = f"{name}.{key}"
            raise _unknown(where(dotted), dotted, key, allowed)
    try:
        return cls(**value)
    except _BadValue as e:
        raise ConfigError(f"{where(e.key)}: {e}") from None
