"""The bundled quickstart: a task small enough for a 2-core CPU, with a visible result.

`entrenar train` with no recipe teaches a small randomly initialised
Llama-architecture model two-digit addition ("47+38=" -> "85"). Everything is
generated into the run folder (a Hugging Face model folder with its tokenizer,
and JSONL data), so the run needs no download and exercises the same code path
as a real fine-tune. Held-out accuracy of greedy answers shows what training did.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from entrenar.config import Recipe, load_recipe
from entrenar.data.tokenizer import Tokenizer
from entrenar.generation.sampling import generate
from entrenar.models.config import ModelConfig
from entrenar.models.saving import save_model_folder
from entrenar.models.transformer import Transformer
from entrenar.tasks.causal_lm import CausalLMTask

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+=")
HELD_OUT = 500  # of the 10,000 sums, never trained on


def build_tokenizer() -> Tokenizer:
    """One token per character, BOS prepended, as a real Hugging Face tokenizer.json."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens(SPECIAL)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def model_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256, model_type="llama", bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def sums(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All pairs a+b with a, b < 100, shuffled and split into (train, held-out)."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    return pairs[HELD_OUT:], pairs[:HELD_OUT]


def _write_jsonl(path: Path, pairs: list[tuple[int, int]]) -> None:
    with open(path, "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")


def is_quickstart(recipe: Recipe, run_dir: Path) -> bool:
    """The bundled quickstart: before its first run (neither model path nor data; the recipe refuses data
    without a model path) or resumed from its own saved recipe."""
    path = recipe.model.path
    if path is None:
        return recipe.data.train is None and recipe.data.validation is None
    return Path(path).absolute() == (run_dir / "quickstart" / "base-model").absolute()


@functools.cache
def _scratch() -> Path:
    """A temporary folder for dry runs, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix="entrenar-quickstart-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def resolve(recipe: Recipe, run_dir: Path, dry_run: bool = False) -> Recipe:
    """Point the recipe at the quickstart's model and data under `run_dir/quickstart/` (nothing is written).

    A dry run writes nothing to the run folder: unless an earlier run generated the files there, it points at
    a temporary folder instead (one per seed, since the seed picks the model and the data)."""
    root = run_dir / "quickstart"
    if dry_run and not (root / "base-model" / "config.json").is_file():
        root = _scratch() / f"seed-{recipe.training.seed}" / "quickstart"
    model = dataclasses.replace(recipe.model, path=str(root / "base-model"))
    data = dataclasses.replace(recipe.data, train=str(root / "train.jsonl"), validation=str(root / "validation.jsonl"))
    return dataclasses.replace(recipe, model=model, data=data)


def fit_warmup(recipe: Recipe) -> tuple[Recipe, str | None]:
    """The quickstart shortened to fewer steps than its own warmup (``--set training.max_steps=5``) warms up
    for a tenth of the run instead, with a line saying so; a warmup the user set is theirs (the plan refuses it)."""
    warmup, steps = recipe.schedule.warmup_steps, recipe.training.max_steps
    if warmup <= steps or warmup != load_recipe(None).schedule.warmup_steps:
        return recipe, None
    fitted = steps // 10
    note = (f"quickstart: warmup shortened from {warmup} to {fitted} steps to fit training.max_steps={steps} "
            f"(--set schedule.warmup_steps=N to choose)")
    return dataclasses.replace(recipe, schedule=dataclasses.replace(recipe.schedule, warmup_steps=fitted)), note


def write_files(recipe: Recipe) -> None:
    """Generate the base model and the data a resolved quickstart recipe points at, once."""
    # resolve() named them
    assert recipe.model.path is not None and isinstance(recipe.data.train, str) and recipe.data.validation is not None
    model_dir = Path(recipe.model.path)
    if (model_dir / "config.json").is_file():
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(recipe.training.seed)
    model = Transformer(model_config(tokenizer.vocab_size))
    model.reset_parameters()
    train, held_out = sums(recipe.training.seed)
    _write_jsonl(Path(recipe.data.train), train)
    _write_jsonl(Path(recipe.data.validation), held_out)
    save_model_folder(model, tokenizer, model_dir)  # last, and whole: its config.json marks the files complete


def accuracy(model: Transformer, tokenizer: Tokenizer, validation_file: str | Path, limit: int = 200) -> float:
    """Share of held-out sums whose greedy answer is exactly right."""
    lines = Path(validation_file).read_text().splitlines()[:limit]
    right = 0
    for line in lines:
        record = json.loads(line)
        ids = generate(model, tokenizer.encode(record["prompt"]), max_new_tokens=4, stop_ids=tokenizer.eos_ids)
        right += tokenizer.decode(ids) == record["completion"]
    return right / max(len(lines), 1)


@dataclass
class QuickstartTask(CausalLMTask):
    """The quickstart's language modelling, with the held-out share of exact answers before and after."""

    accuracy_before: float | None = None

    @property
    def _validation_file(self) -> str:
        """The held-out sums (:func:`resolve` names them)."""
        assert self.recipe.data.validation is not None
        return self.recipe.data.validation

    def begin(self, model: Transformer, tokenizer: Tokenizer) -> None:
        self.accuracy_before = accuracy(model, tokenizer, self._validation_file)

    def finish(self, model: Transformer, tokenizer: Tokenizer, validation: list, run_dir: Path, output: Path,
               before: Any, after: Any) -> list[tuple[str, str]]:
        after_share = accuracy(model, tokenizer, self._validation_file)
        shown = f"{self.accuracy_before:.1%} -> " if self.accuracy_before is not None else ""
        return [*super().finish(model, tokenizer, validation, run_dir, output, before, after),
                ("held-out acc.", f"{shown}{after_share:.1%} of unseen sums answered exactly")]
