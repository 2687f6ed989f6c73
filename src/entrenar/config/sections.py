"""The recipe's sections: frozen dataclasses whose fields each carry a default and a rule.

The rules run whenever a section is built, from a file or in Python, so a section in hand is valid. A field a
``--resume`` may change is marked ``resumable`` (``entrenar.config.RESUMABLE_KEYS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from entrenar.config.rules import (
    DATA_FORMATS,
    PREFERENCE_LOSSES,
    Reject,
    Rule,
    _activation_bits,
    _attach,
    _betas,
    _boolean,
    _checkpoint_layers,
    _choice,
    _class_weights,
    _device,
    _early_stopping,
    _epochs,
    _integer,
    _labels,
    _lr_scales,
    _mlflow,
    _model_config,
    _modules,
    _number,
    _offload_layers,
    _optional_number,
    _parameter_names,
    _qat_modules,
    _seconds_or_null,
    _show,
    _text,
    _threshold,
    _train_files,
    _wandb,
)
from entrenar.errors import ConfigError, EntrenarError
from entrenar.io.sqlite import check_query, is_sqlite

DEFAULT_MAX_STEPS = 1000  # training.max_steps when neither it nor training.epochs is set
MAX_SEQ_LEN = 2**22  # 4x the longest contexts models train at today; a row this long is 128 MiB of index tensors


def setting(default: Any, rule: Rule, *, resumable: int | None = None) -> Any:
    """A section field: its default, the rule its values must pass and, for a key a ``--resume`` may change, its
    place in ``RESUMABLE_KEYS`` (the order keys became resumable, which a refused resume lists)."""
    metadata = {"rule": rule} if resumable is None else {"rule": rule, "resumable": resumable}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class _BadValue(ConfigError):
    """A ConfigError about one dotted key; loaders prefix it with where the key was written."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class _Section:
    """Checks and normalizes every field when built, so an instance is always valid.

    ``section`` names the keys in errors (``'lora.r' must be ...``). A class built on a section for library
    callers (``LoraConfig``, ``QATConfig``) may add fields without a rule, which it checks itself, and raise its
    own kind of error through ``_refusal``.
    """

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):
            rule = f.metadata.get("rule")
            if rule is None:
                continue
            value = getattr(self, f.name)
            key = f"{self.section}.{f.name}"
            try:
                object.__setattr__(self, f.name, rule(value))
            except Reject as r:
                raise self._refusal(key, f"'{key}' must be {r.expected}, got {_show(value)}{r.hint}") from None

    def _refusal(self, key: str, message: str) -> EntrenarError:
        """The error for a value that broke its rule: a ConfigError the recipe loader places by ``key``."""
        return _BadValue(key, message)


@dataclass(frozen=True)
class ModelSection(_Section):
    """Which weights to load, in which dtype, on which device."""

    section: ClassVar[str] = "model"
    path: str | None = setting(None, _text(nullable=True))
    dtype: str = setting("auto", _choice("auto", "float32", "bfloat16", "float16"))
    device: str = setting("auto", _device)
    init: str = setting("pretrained", _choice("pretrained", "random"))  # random: built from `config` (EXPERIMENTS.md)
    config: dict[str, Any] | None = setting(None, _model_config)  # init random: a config.json-style mapping
    tokenizer: str | None = setting(None, _text(nullable=True))  # init random: a tokenizer.json; null: byte-level

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init == "random":
            if self.config is None:
                raise _BadValue("model.config", "'model.config' is required when 'model.init' is random (a "
                                                "mapping of config.json keys: model_type, hidden_size, ...)")
            if self.path is not None:
                raise _BadValue("model.path", f"'model.path' must be null when 'model.init' is random (the model is "
                                              f"built from model.config), got {_show(self.path)}")
        else:
            for key in ("config", "tokenizer"):
                if getattr(self, key) is not None:
                    raise _BadValue(f"model.{key}", f"'model.{key}' is for 'model.init: random'; a pretrained "
                                                    "model takes both from model.path")


@dataclass(frozen=True)
class DataSection(_Section):
    """Where the examples come from and how they become token sequences."""

    section: ClassVar[str] = "data"
    # a file or folder, or a list to mix: [{path: a.jsonl, weight: 2, format: alpaca}, b.jsonl] (sources())
    train: str | tuple[dict[str, Any], ...] | None = setting(None, _train_files)
    validation: str | None = setting(None, _text(nullable=True))
    validation_split: float = setting(0.0, _number(0.0, 0.5, high_open=True))
    # a record format (alpaca, sharegpt, messages, prompt_completion, text; auto: each record by its keys) or a
    # file format forcing the reader (jsonl, json, csv, parquet; otherwise from the extension): entrenar.data.formats
    format: str = setting("auto", _choice(*DATA_FORMATS))
    text_field: str = setting("text", _text())
    prompt_field: str = setting("prompt", _text())
    completion_field: str = setting("completion", _text())
    messages_field: str = setting("messages", _text())
    label_field: str = setting("label", _text())  # task.type classification: the label (name, id, list, number)
    train_on: str = setting("all", _choice("all", "completion"))
    # one input and one target at least; at most MAX_SEQ_LEN, and 8x the model's context (checked when it is loaded)
    seq_len: int = setting(512, _integer(2, MAX_SEQ_LEN))
    packing: bool = setting(True, _boolean)
    # each batch as one row of its real tokens (no padding computed); auto: on a CPU for causal-LM training (no
    # fixed shapes to keep there, so padding is only work) unless the documents are too small to attend one by
    # one (hidden size x mean example length under 8192, the quickstart's case)
    padding_free: str | bool = setting("auto", _choice("auto", True, False), resumable=22)
    add_eos: bool = setting(True, _boolean)
    on_error: str = setting("raise", _choice("raise", "skip"))
    shuffle: bool = setting(True, _boolean)
    # a SQLite train/validation file: the SELECT giving its rows
    query: str | None = setting(None, _text(nullable=True))
    # task.type preference: the fields of the preferred and dispreferred completions (TRL's names); the prompt is
    # prompt_field, KTO's completion and label completion_field and label_field
    chosen_field: str = setting("chosen", _text())
    rejected_field: str = setting("rejected", _text())
    # more SQLite files attached read-only to data.train's, by schema name: {outcomes: outcomes.db}
    attach: dict[str, str] | None = setting(None, _attach)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attach is not None and self.query is None:
            raise _BadValue("data.attach", "'data.attach' attaches SQLite files for 'data.query' to join; set "
                                           "data.query too")
        if self.query is not None:
            try:
                check_query(self.query)
            except ConfigError as e:
                raise _BadValue("data.query", str(e).replace("data.query", "'data.query'", 1)) from None
            if not any(is_sqlite(f) for f in [*(s[0] for s in self.sources()), self.validation] if f is not None):
                raise _BadValue("data.query", f"'data.query' reads a SQLite file (.db, .sqlite, .sqlite3), and "
                                              f"data.train is {_show(self.train)}")

    def sources(self) -> list[tuple[str, float, str]]:
        """The training files as ``(path, weight, data.format)``: one of weight 1, or the list to mix."""
        if self.train is None:
            return []
        if isinstance(self.train, str):
            return [(self.train, 1.0, self.format)]
        return [(f["path"], f["weight"], f["format"] or self.format) for f in self.train]


@dataclass(frozen=True)
class LoraSection(_Section):
    """Low-rank adapters; the recipe's ``lora: null`` means full fine-tuning instead. The one LoRA schema:
    ``entrenar.adapters.lora.LoraConfig`` is this section with PEFT's conventions for Python callers."""

    section: ClassVar[str] = "lora"
    r: int = setting(8, _integer(1))
    alpha: float = setting(16.0, _number(0.0, low_open=True))
    dropout: float = setting(0.0, _number(0.0, 1.0, high_open=True))
    target_modules: str | tuple[str, ...] = setting(("q_proj", "k_proj", "v_proj", "o_proj"), _modules)
    # MoE experts, e.g. [mlp.experts.gate_up_proj]
    target_parameters: tuple[str, ...] | None = setting(None, _parameter_names)
    use_rslora: bool = setting(False, _boolean)
    quantize_base: str | None = setting(None, _choice(None, "nf4"))


@dataclass(frozen=True)
class QatSection(_Section):
    """Quantization-aware training (fake-quantized linear layers); ``qat: null`` (the default) is off.
    With ``lora`` set too it is LoRA-QAT: a frozen fake-quantized base under full-precision adapters. The one QAT
    schema: ``entrenar.quant.qat.QATConfig`` is this section plus what only Python callers set."""

    section: ClassVar[str] = "qat"
    bits: int = setting(4, _integer(2, 8))
    granularity: str = setting("channel", _choice("tensor", "channel", "group"))
    group_size: int = setting(128, _integer(1))
    backward: str = setting("ste", _choice("ste", "clipped_ste", "lsq", "ewgs"))
    activations: bool | int = setting(False, _activation_bits)
    # lsq: the learning rate of the learned step sizes (their own optimizer group, no weight decay, the lr
    # schedule's shape); null: optimizer.lr. Under LoRA the steps train too (LoRA-QAT: 1e-3 against 1e-4)
    scale_lr: float | None = setting(None, _optional_number(0.0, low_open=True))
    # the layers fake-quantized: all-linear (every linear layer but lm_head), lora (the adapted ones), or names
    target_modules: str | tuple[str, ...] = setting("all-linear", _qat_modules)
    # LoRA-QAT: fake-quantize W + BA as one weight, so the merged integer export is what was trained
    quantize_lora: bool = setting(False, _boolean)


@dataclass(frozen=True)
class MoeSection(_Section):
    """Router losses, balancing and diagnostics of mixture-of-experts models (ignored by dense models when left
    at the defaults)."""

    section: ClassVar[str] = "moe"
    aux_loss: float = setting(0.0, _number(0.0))  # weight of the Switch load-balancing loss (0: off)
    z_loss: float = setting(0.0, _number(0.0))  # weight of the ST-MoE router z-loss (0: off)
    bias_update_rate: float = setting(0.0, _number(0.0))  # aux-loss-free balancing: per-expert bias step (0: off)
    router_lr_scale: float = setting(1.0, _number(0.0, low_open=True))  # router learning rate multiplier
    freeze_router: bool = setting(False, _boolean)  # full fine-tuning: keep the router weights as loaded
    experts: str = setting("auto", _choice("auto", "loop", "grouped"))  # auto: one grouped product on CUDA
    dead_after: int = setting(100, _integer(1))  # an expert with no tokens for this many steps counts as dead
    collapse_entropy: float = setting(0.3, _number(0.0, 1.0))  # warn when a layer's normalised entropy falls below
    collapse_share: float = setting(0.5, _number(0.0, 1.0))  # warn when one expert takes more than this share


@dataclass(frozen=True)
class OptimizerSection(_Section):
    """The optimizer and its per-group learning-rate scales."""

    section: ClassVar[str] = "optimizer"
    name: str = setting("adamw", _choice("adamw", "sgd"))
    lr: float = setting(2e-4, _number(0.0, low_open=True))
    weight_decay: float = setting(0.0, _number(0.0))
    betas: tuple[float, float] = setting((0.9, 0.999), _betas)
    eps: float = setting(1e-8, _number(0.0, low_open=True))
    momentum: float = setting(0.9, _number(0.0, 1.0, high_open=True))
    fused: str | bool = setting("auto", _choice("auto", True, False))
    lr_scale: dict[str, float] = setting({}, _lr_scales)


@dataclass(frozen=True)
class ScheduleSection(_Section):
    """The learning-rate schedule: linear warmup, then the named shape."""

    section: ClassVar[str] = "schedule"
    name: str = setting("cosine", _choice("cosine", "linear", "constant"))
    warmup_steps: int = setting(0, _integer(0))
    min_lr_ratio: float = setting(0.1, _number(0.0, 1.0))
    # a resume that changes training.max_steps: continue (the lr goes on from where it is, decaying to the floor at
    # the new end: no jump), rewarm (a new warmup, then decay over the rest) or rescale (the schedule recomputed
    # over the new length, as Hugging Face Trainer does: the lr jumps back up the curve)
    on_extend: str = setting("continue", _choice("continue", "rewarm", "rescale"), resumable=23)


@dataclass(frozen=True)
class TrainingSection(_Section):
    """Step counts, batch shape, precision, and how often to log, evaluate and save."""

    section: ClassVar[str] = "training"
    # the run's length in optimizer steps (1000 when neither this nor epochs is set)
    max_steps: int = setting(None, _integer(1, nullable=True), resumable=1)
    # or in passes over the training examples, resolved into steps once the data is read (RunPlan.steps)
    epochs: float | None = setting(None, _epochs, resumable=23)
    batch_size: int = setting(4, _integer(1))
    grad_accum: int = setting(1, _integer(1))
    max_grad_norm: float = setting(1.0, _number(0.0))
    precision: str = setting("fp32", _choice("fp32", "bf16", "fp16"))
    activation_checkpointing: bool | int | tuple[int, ...] = setting(False, _checkpoint_layers)
    # what layers keep for backward waits in pinned CPU memory (a checkpointed layer: its input) (CUDA): every
    # layer but the last (true), or the first N
    offload_activations: bool | int = setting(False, _offload_layers)
    # the frozen input-embedding table stays in pinned CPU memory, read by the GPU (LoRA/QLoRA on CUDA); auto: on
    # for a causal-LM LoRA/QLoRA run on one CUDA device with every layer checkpointed and untied embeddings
    offload_embeddings: str | bool = setting("auto", _choice("auto", True, False), resumable=20)
    # QLoRA: the blocks' NF4 base weights stay in pinned CPU memory, each block's copied to the GPU as it runs
    # (one CUDA device, quantize_base: nf4); auto: on when every layer is checkpointed, without compile
    offload_weights: str | bool = setting("auto", _choice("auto", True, False), resumable=21)
    compile: bool = setting(False, _boolean, resumable=9)
    # forward and backward of each micro-batch replayed from a CUDA graph (fixed shapes; not padding-free);
    # auto: on a single CUDA device (or under ddp with flat gradients) for LoRA/QLoRA on packed causal-LM batches
    # of a dense model (or an MoE one whose experts run grouped, in bf16 or NF4), without compile or fp16
    cuda_graphs: str | bool = setting("auto", _choice("auto", True, False), resumable=17)
    # read each step's loss and norm while the GPU runs the next step's forward and backward (a non-finite
    # update is dropped on the device); auto: on CUDA (one process, or ddp with flat gradients) with a fused
    # optimizer and no fp16 scaler
    overlap_steps: str | bool = setting("auto", _choice("auto", True, False), resumable=18)
    # auto: on CUDA when Triton imports, and on a CPU (PyTorch paths)
    kernels: str | bool = setting("auto", _choice("auto", True, False), resumable=8)
    # LoRA adapter products in the fused layer: fp32 as PEFT runs them, or bf16 on the tensor cores (the adapter
    # weights and the optimizer stay fp32)
    adapter_math: str = setting("fp32", _choice("fp32", "bf16"))
    seed: int = setting(0, _integer(0, 2**32 - 1))  # numpy's seed range
    # the same bits on every rerun and resume on a GPU too: PyTorch's deterministic algorithms (an op without one
    # is refused, naming it) and a fixed cuBLAS workspace; a CPU run is deterministic either way
    deterministic: bool = setting(False, _boolean, resumable=19)
    eval_every: int = setting(0, _integer(0), resumable=2)
    eval_batches: int | None = setting(None, _integer(1, nullable=True), resumable=6)
    log_every: int = setting(10, _integer(1), resumable=3)
    save_every: int = setting(0, _integer(0), resumable=4)
    keep_last: int = setting(3, _integer(1), resumable=5)
    cpu_threads: int | None = setting(None, _integer(1, nullable=True), resumable=7)  # None: torch's default
    # a step whose loss or gradient norm is NaN/inf: stop the run, or skip its update (at most max_skipped_steps
    # in a row)
    nonfinite: str = setting("stop", _choice("stop", "skip"), resumable=10)
    max_skipped_steps: int = setting(5, _integer(1), resumable=11)
    early_stopping: dict[str, Any] | None = setting(None, _early_stopping, resumable=12)  # None: off
    # many processes (entrenar train --nproc-per-node N): ddp, fsdp, or auto (ddp when a replica fits one device)
    parallel: str = setting("auto", _choice("auto", "ddp", "fsdp"), resumable=13)
    # rows per optimizer step over all processes; None: batch_size x grad_accum x processes (accumulation derived)
    global_batch_size: int | None = setting(None, _integer(1, nullable=True), resumable=14)
    # a collective waits this long for a dead or hung rank
    dist_timeout_s: float = setting(300.0, _number(1.0), resumable=15)
    # steps between replica checks (and at the end); 0: never
    replica_check_every: int = setting(50, _integer(0), resumable=16)
    # a rank of a job entrenar launched that stays this long in one phase of a step is stopped and named (then
    # restarted with --max-restarts); null: only dist_timeout_s. Loading, evaluation, checkpoints and the first
    # steps get stall_startup_s (distributed/watchdog.py)
    stall_timeout_s: float | None = setting(30.0, _seconds_or_null, resumable=24)
    stall_startup_s: float = setting(1800.0, _number(1.0), resumable=24)
    # parallel: fsdp: issue the next block's all-gathers (parameters, and a QLoRA base's NF4 codes) while this
    # block computes, forward and backward; false: each block gathers when it is called (the same numbers)
    fsdp_prefetch: bool = setting(True, _boolean)
    # long context: each layer's MLP runs on this many tokens at a time and again tile by tile in backward, so its
    # [tokens, intermediate] activations never exist whole (models/tiled.py; every dense layer, its norms around
    # the MLP included; MoE layers keep theirs whole); 0: off. One more MLP forward a step: for sequences that do
    # not fit otherwise (docs/PERFORMANCE.md, longest context)
    tiled_mlp: int = setting(0, _integer(0), resumable=25)
    # context parallelism: each padding-free row split over this many processes (consecutive ranks, one host's
    # GPUs), attention by all-to-all over heads; the rest of the world is data parallel (distributed/
    # context_parallel.py)
    context_parallel: int = setting(1, _integer(1))
    # the variable-length attention of packed and padding-free rows on CUDA: FlashAttention-2 (torch's varlen_attn),
    # or FlashAttention-4 on a Hopper GPU (the optional extra: pip install 'entrenar[fa4]'; FA2 where FA4 cannot
    # take a call: sinks, soft-capped scores); auto: fa2 (FA4 not yet measured through entrenar train)
    attention_kernel: str = setting("auto", _choice("auto", "fa2", "fa4"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs is not None and self.max_steps is not None:
            raise _BadValue("training.epochs", f"'training.epochs' ({self.epochs:g}) and 'training.max_steps' "
                                               f"({self.max_steps}) are both set; a run's length is one of them "
                                               "(set the other to null)")
        if self.epochs is None and self.max_steps is None:
            object.__setattr__(self, "max_steps", DEFAULT_MAX_STEPS)


@dataclass(frozen=True)
class OutputSection(_Section):
    """Where the run writes checkpoints, metrics and its resolved recipe."""

    section: ClassVar[str] = "output"
    name: str = setting("run", _text())
    dir: str = setting(None, _text(nullable=True))  # None given: runs/<name>, set in __post_init__
    tensorboard: bool = setting(False, _boolean)  # also write TensorBoard event files (the `tensorboard` extra)
    # also log to MLflow / Weights & Biases (the `mlflow`, `wandb` extras; entrenar.train.trackers): null or a mapping
    mlflow: dict[str, str | None] | None = setting(None, _mlflow)  # {tracking_uri, experiment, run_name}
    wandb: dict[str, str | None] | None = setting(None, _wandb)  # {project, entity, run_name, mode, dir}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dir is None:
            object.__setattr__(self, "dir", f"runs/{self.name}")


@dataclass(frozen=True)
class TaskSection(_Section):
    """What the run learns: next tokens (causal_lm), a label per text (classification) or preferences between
    completions (preference: DPO, IPO, SimPO, ORPO, KTO; entrenar.tasks)."""

    section: ClassVar[str] = "task"
    type: str = setting("causal_lm", _choice("causal_lm", "classification", "preference", "grpo"))
    problem_type: str = setting("single_label", _choice("single_label", "multi_label", "regression"))
    # names in class-id order; null: num_labels or from the data
    labels: tuple[str, ...] | None = setting(None, _labels)
    num_labels: int | None = setting(None, _integer(1, nullable=True))
    pooling: str = setting("last", _choice("last", "mean"))
    class_weights: str | tuple[float, ...] = setting("none", _class_weights)
    label_smoothing: float = setting(0.0, _number(0.0, 1.0, high_open=True))
    threshold: str | float | tuple[float, ...] = setting("tune", _threshold)  # multi_label decision threshold(s)
    metric: str | None = setting(None, _text(nullable=True))  # best checkpoint; null: macro_f1 (rmse for regression)
    # preference: the loss, and its settings with TRL's defaults (label_smoothing above: conservative DPO / SimPO's)
    loss: str = setting("dpo", _choice(*PREFERENCE_LOSSES))
    beta: float = setting(0.1, _number(0.0, low_open=True))  # DPO/IPO/KTO's beta (IPO's tau), SimPO's, ORPO's lambda
    simpo_gamma: float = setting(0.5, _number(0.0))  # SimPO's target reward margin
    desirable_weight: float = setting(1.0, _number(0.0, low_open=True))  # KTO's weights of the two kinds
    undesirable_weight: float = setting(1.0, _number(0.0, low_open=True))
    # the reference model: auto (adapters_off under LoRA/QLoRA, else copy), the base with the adapters switched off,
    # a frozen copy, or log-probabilities computed once before training and kept in the run folder
    reference: str = setting("auto", _choice("auto", "adapters_off", "copy", "precomputed"))
    # pairs (not KTO): each prompt computed once for both completions ([prompt, chosen, rejected], rejected not
    # seeing chosen); auto: wherever the rows are padding-free (data.padding_free), true: always
    share_prompt: str | bool = setting("auto", _choice("auto", True, False))
    # grpo (TRL's GRPOConfig names and defaults; docs/RL.md): completions per prompt and how they are sampled
    num_generations: int = setting(8, _integer(2))
    max_new_tokens: int = setting(64, _integer(1))
    temperature: float = setting(1.0, _number(0.0, low_open=True))
    top_p: float = setting(1.0, _number(0.0, 1.0, low_open=True))
    top_k: int = setting(0, _integer(0))  # 0: off
    min_p: float = setting(0.0, _number(0.0, 1.0, high_open=True))
    # the objective: loss normalisation, token or sequence (GSPO) ratio, clipping, KL to the reference (adapters
    # off) with kl_beta (not `beta`, the preference losses' key), advantages scaled by the group's std or not
    loss_type: str = setting("dapo", _choice("grpo", "bnpo", "dapo", "dr_grpo"))
    importance_sampling_level: str = setting("token", _choice("token", "sequence"))
    epsilon: float = setting(0.2, _number(0.0))
    epsilon_high: float | None = setting(None, _optional_number(0.0))  # null: epsilon
    kl_beta: float = setting(0.0, _number(0.0))
    scale_rewards: str = setting("group", _choice("group", "batch", "none"))
    samples_every: int = setting(10, _integer(0))  # steps between sample tables (samples.jsonl); 0: never
    num_iterations: int = setting(1, _integer(1))  # optimizer steps on each generation batch (TRL's name)
    # the sampler's decode step replayed from a CUDA graph on a static KV cache (entrenar.generation.graphed);
    # auto: on a CUDA device unless the model cannot replay (FSDP, weight streaming, a host embedding table, ...)
    decode_cuda_graphs: str | bool = setting("auto", _choice("auto", True, False))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.labels is not None and self.num_labels is not None and self.num_labels != len(self.labels):
            raise _BadValue("task.num_labels", f"'task.num_labels' is {self.num_labels} but 'task.labels' names "
                                               f"{len(self.labels)}")
        self._check_preference()
        self._check_grpo()

    def _check_grpo(self) -> None:
        """GRPO's settings under another task type would be silently ignored: refused, naming the key."""
        if self.type == "grpo":
            return
        grpo = fields(self)[[f.name for f in fields(self)].index("num_generations"):]
        changed = [f.name for f in grpo if getattr(self, f.name) != f.default]
        if changed:
            raise _BadValue(f"task.{changed[0]}", f"'task.{changed[0]}' is a GRPO setting; task.type is "
                                                  f"{self.type} (set task.type: grpo, or remove it)")

    def _check_preference(self) -> None:
        """Settings a preference loss would silently ignore are refused, naming the loss that ignores them."""
        defaults = {f.name: f.default for f in fields(self)}
        only = {"simpo_gamma": ("simpo",), "desirable_weight": ("kto",), "undesirable_weight": ("kto",),
                "label_smoothing": ("dpo", "simpo") if self.type == "preference" else None}
        keys = ("loss", "beta", "simpo_gamma", "desirable_weight", "undesirable_weight", "reference")
        if self.type != "preference":
            changed = [k for k in keys if getattr(self, k) != defaults[k]]
            if changed:
                raise _BadValue(f"task.{changed[0]}", f"'task.{changed[0]}' is a preference setting; task.type is "
                                                      f"{self.type} (set task.type: preference, or remove it)")
            return
        for key, losses in only.items():
            if losses is not None and self.loss not in losses and getattr(self, key) != defaults[key]:
                raise _BadValue(f"task.{key}", f"'task.{key}' applies to task.loss {' or '.join(losses)}; "
                                               f"task.loss {self.loss} does not use it (remove it)")
        if self.label_smoothing >= 0.5:
            raise _BadValue("task.label_smoothing", "'task.label_smoothing' must be in [0, 0.5) for a preference loss "
                                                    f"(the chance a label is flipped), got {self.label_smoothing:g}")
        if self.loss == "kto" and self.reference == "precomputed":
            raise _BadValue("task.reference", "'task.reference' precomputed cannot serve task.loss kto: its KL "
                                              "estimate pairs each prompt with another example's completion of the "
                                              "same micro-batch, which changes with the order (use copy)")
        if self.loss in ("simpo", "orpo") and self.reference != "auto":
            raise _BadValue("task.reference", f"'task.reference' is {self.reference} but task.loss {self.loss} is "
                                              "reference-free (no reference model); remove task.reference")


def _reward_functions(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise Reject("a list of reward functions (module:function or a built-in)", f" (write [{value}])")
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v.strip() for v in value):
        return tuple(value)
    raise Reject("a list of reward functions: module:function or a built-in (exact_answer, format, length)")


def _reward_weights(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    raise Reject("null or a list of numbers, one per reward function")


@dataclass(frozen=True)
class RewardSection(_Section):
    """task.type grpo: the reward functions (TRL's signature, entrenar.tasks.rl.rewards), their weights and the
    built-ins' options."""

    section: ClassVar[str] = "reward"
    functions: tuple[str, ...] = setting((), _reward_functions)
    weights: tuple[float, ...] | None = setting(None, _reward_weights)  # null: 1 each
    answer_field: str = setting("answer", _text())  # exact_answer: the data column holding the expected answer
    answer_marker: str = setting("=", _text())  # exact_answer: the answer is the completion's text after the last
    format_regex: str | None = setting(None, _text(nullable=True))  # format: the completion must match it in full
    target_length: int | None = setting(None, _integer(1, nullable=True))  # length: characters

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise _BadValue("reward.weights", f"'reward.weights' has {len(self.weights)} numbers for "
                                              f"{len(self.functions)} reward.functions (one each)")


_SECTIONS: dict[str, type[_Section]] = {
    cls.section: cls
    for cls in (
        ModelSection,
        DataSection,
        LoraSection,
        QatSection,
        OptimizerSection,
        ScheduleSection,
        TrainingSection,
        OutputSection,
        TaskSection,
        MoeSection,
        RewardSection,
    )
}
