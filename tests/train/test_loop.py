"""The training loop end to end on a tiny model: exact resume, accumulation, dry run, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import crash_after_step
from entrenar.config import load_recipe
from entrenar.errors import AdapterError, CheckpointError, ConfigError, DataError
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def recipe_for(ws, *overrides):
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}}
optimizer: {{lr: 1.0e-2}}
schedule: {{warmup_steps: 2}}
training: {{max_steps: 8, batch_size: 2, eval_every: 4, save_every: 3, keep_last: 2, log_every: 1}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_interrupted_run_resumes_with_identical_losses(workspace, monkeypatch, method):
    overrides = {"full": ["lora=null"], "qlora": ["lora.quantize_base=nf4"], "lora": []}[method]
    straight = train(recipe_for(workspace, *overrides, f"output.dir={workspace / 'straight'}"), progress=False)
    expected = losses(straight.run_dir)
    assert len(expected) == 8 and len(set(expected)) == 8

    # Crash right after step 7 is logged; the last checkpoint is step 6 (save_every 3).
    recipe = recipe_for(workspace, *overrides)
    crash_after_step(monkeypatch, recipe, 7)
    assert len(losses(workspace / "run")) == 7

    resumed = train(recipe, resume=True, progress=False)
    assert losses(resumed.run_dir) == expected  # bit for bit
    assert resumed.output.name == ("model" if method == "full" else "adapter")


def test_accumulation_normalises_by_the_tokens_of_the_whole_step(workspace):
    one = train(recipe_for(workspace, "training.batch_size=4", "lora.dropout=0", "output.dir=" + str(workspace / "a")),
                progress=False)
    two = train(recipe_for(workspace, "training.batch_size=2", "training.grad_accum=2", "lora.dropout=0",
                           "output.dir=" + str(workspace / "b")), progress=False)
    torch.testing.assert_close(torch.tensor(losses(two.run_dir)), torch.tensor(losses(one.run_dir)),
                               atol=1e-5, rtol=0)


def test_run_leaves_metrics_checkpoints_adapter_and_improves(workspace):
    result = train(recipe_for(workspace, "training.max_steps=12"), progress=False)
    run = result.run_dir
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"} <= set(steps[0])
    assert steps[0]["lr"] == pytest.approx(1e-2 / 3)  # warmup: (step+1)/(warmup+1)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 4, 8, 12]
    assert result.eval_after.loss < result.eval_before.loss
    assert len(list((run / "checkpoints").glob("step-*"))) <= 3  # keep_last 2, plus the best
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert (run / "loss_curve.png").stat().st_size > 1000
    assert "held-out loss" in result.summary


def test_dry_run_builds_everything_and_writes_nothing(workspace):
    result = train(recipe_for(workspace), dry_run=True, progress=False)
    assert result.dry_run and "trainable" in result.summary and "memory estimate" in result.summary
    assert not (workspace / "run").exists()


def test_refusals_name_the_problem(workspace):
    train(recipe_for(workspace, "training.max_steps=3"), progress=False)
    with pytest.raises(CheckpointError, match="already holds a run with checkpoints; pass --resume"):
        train(recipe_for(workspace, "training.max_steps=3"), progress=False)
    with pytest.raises(CheckpointError, match=r"optimizer\.lr: 0\.01 -> 0\.5"):
        train(recipe_for(workspace, "optimizer.lr=0.5"), resume=True, progress=False)
    with pytest.raises(AdapterError, match="q_prj"):
        train(recipe_for(workspace, "lora.target_modules=[q_prj]", f"output.dir={workspace / 'x'}"), progress=False)
    (workspace / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        train(recipe_for(workspace, f"data.train={workspace / 'empty.jsonl'}", f"output.dir={workspace / 'y'}"),
              progress=False)
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        train(recipe_for(workspace, f"output.dir={workspace / 'z'}"), resume=True, progress=False)


def test_a_warmup_longer_than_the_run_is_refused_before_anything_is_built(workspace):
    from entrenar.errors import ConfigError

    with pytest.raises(ConfigError,
                       match=r"schedule\.warmup_steps \(20\) is longer than the run \(training\.max_steps=8\)"):
        train(recipe_for(workspace, "schedule.warmup_steps=20"), progress=False)
    assert not (workspace / "run").exists()


def test_best_output_is_usable_and_pruning_drops_the_stale_best(workspace):
    import entrenar
    from entrenar.train.checkpoint import best_checkpoint

    result = train(recipe_for(workspace, "training.max_steps=12", "training.eval_every=2", "training.save_every=0",
                              "training.keep_last=1"), progress=False)
    run = result.run_dir
    best = best_checkpoint(run)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r and r["step"] > 0]
    best_step = min(evals, key=lambda r: r["eval_loss"])["step"]
    assert best.name == f"step-{best_step}"
    # keep_last 1: the latest and the current best, nothing older (an earlier best must not linger).
    assert {p.name for p in (run / "checkpoints").glob("step-*")} == {"step-12", best.name}
    model, _ = entrenar.load(workspace / "model", adapter=run / "best" / "adapter", device="cpu")
    assert model is not None


def test_full_fine_tune_keeps_the_base_generation_config(workspace):
    from entrenar.data.tokenizer import Tokenizer

    (workspace / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "top_p": 0.9}))
    result = train(recipe_for(workspace, "lora=null", "training.max_steps=2"), progress=False)
    saved = json.loads((result.output / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, 4] and saved["top_p"] == 0.9
    assert Tokenizer.from_folder(result.output).eos_ids == [2, 4]


def test_resume_refuses_a_damaged_trainer_state_and_a_shorter_run(workspace):
    train(recipe_for(workspace, "training.max_steps=4"), progress=False)
    with pytest.raises(CheckpointError, match=r"step-4 is at step 4, past training\.max_steps=3"):
        train(recipe_for(workspace, "training.max_steps=3"), resume=True, progress=False)
    state_file = workspace / "run" / "checkpoints" / "step-4" / "trainer.json"
    state = json.loads(state_file.read_text())
    del state["data"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"trainer\.json: 'data' \(the data stream position\) is missing"):
        train(recipe_for(workspace, "training.max_steps=6"), resume=True, progress=False)


def test_skipped_records_are_reported_and_an_empty_validation_set_is_named(workspace):
    lines = (workspace / "train.jsonl").read_text().splitlines()
    lines.insert(3, "{not json")
    (workspace / "bad.jsonl").write_text("\n".join(lines) + "\n")
    report = train(recipe_for(workspace, f"data.train={workspace / 'bad.jsonl'}", "data.on_error=skip"),
                   dry_run=True, progress=False).summary
    assert "1 malformed record(s) skipped (1 invalid JSON); first: " in report and "bad.jsonl line 4" in report
    (workspace / "long.jsonl").write_text(json.dumps({"prompt": "1" * 40, "completion": "2"}) + "\n")
    with pytest.raises(DataError, match=r"data\.validation \(.*long\.jsonl\): no examples left"):
        train(recipe_for(workspace, f"data.validation={workspace / 'long.jsonl'}", "data.validation_split=0"),
              dry_run=True, progress=False)


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_kernels_and_the_fused_loss_give_the_plain_losses(workspace, precision, tolerance):
    """training.kernels swaps in fused forwards and the fused output-projection loss (PyTorch paths on a CPU);
    under bf16 autocast the losses agree within bf16 noise."""
    common = ["lora.dropout=0", f"training.precision={precision}"]
    plain = train(recipe_for(workspace, "training.kernels=false", *common, f"output.dir={workspace / 'p'}"),
                  progress=False)
    fused = train(recipe_for(workspace, "training.kernels=true", *common, f"output.dir={workspace / 'f'}"),
                  progress=False)
    torch.testing.assert_close(torch.tensor(losses(fused.run_dir)), torch.tensor(losses(plain.run_dir)),
                               atol=tolerance, rtol=0)


def test_kernels_auto_takes_the_pytorch_paths_on_a_cpu(workspace, monkeypatch):
    """training.kernels: auto applies the kernels on a CPU too (their PyTorch paths: the fused LoRA node, the
    chunked loss); false leaves the model as it is."""
    import entrenar.train.prepare as prepare

    applied = []
    monkeypatch.setattr(prepare, "apply_kernels", lambda model, **kwargs: applied.append(model))
    train(recipe_for(workspace), dry_run=True, progress=False)
    assert len(applied) == 1
    train(recipe_for(workspace, "training.kernels=false"), dry_run=True, progress=False)
    assert len(applied) == 1


def test_bf16_adapter_math_trains_within_bf16_noise_of_fp32_and_needs_the_kernels(workspace):
    common = ["lora.dropout=0", "model.dtype=bfloat16", "training.kernels=true"]
    fp32 = train(recipe_for(workspace, *common, f"output.dir={workspace / 'a'}"), progress=False)
    bf16 = train(recipe_for(workspace, *common, "training.adapter_math=bf16", f"output.dir={workspace / 'b'}"),
                 progress=False)
    a, b = torch.tensor(losses(fp32.run_dir)), torch.tensor(losses(bf16.run_dir))
    assert not torch.equal(a, b)  # the setting reached the adapter products
    torch.testing.assert_close(b, a, atol=3e-2, rtol=0)
    with pytest.raises(ConfigError, match=r"training\.adapter_math: bf16 .* has no kernels"):
        train(recipe_for(workspace, "training.kernels=false", "training.adapter_math=bf16"), dry_run=True,
              progress=False)


def test_the_quickstart_resumes_from_anywhere_by_its_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    short = ["training.max_steps=4", "training.eval_every=0", "training.save_every=2", "schedule.warmup_steps=1"]
    first = train(load_recipe(None, short), progress=False)
    assert torch.get_num_threads() == threads  # training.cpu_threads does not leak into the caller
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = tmp_path / "runs" / "quickstart"
    recipe = load_recipe(run / "recipe.yaml", ["training.max_steps=6", "training.cpu_threads=2"])
    resumed = train(recipe, resume=run, progress=False)
    assert resumed.run_dir == run and "held-out acc." in resumed.summary and "held-out acc." in first.summary
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == list(range(1, 7))


@pytest.mark.parametrize("packing", [True, False])
def test_padding_free_batches_give_the_padded_losses(workspace, packing):
    """data.padding_free drops the padding and changes nothing else: the losses are the padded run's (whose rows
    attend document by document on a CPU; dropout off: its masks are drawn per position, and the layouts have
    different positions)."""
    common = ["lora.dropout=0", f"data.packing={str(packing).lower()}", "training.activation_checkpointing=1"]
    padded = train(recipe_for(workspace, *common, "data.padding_free=false", f"output.dir={workspace / 'p'}"),
                   progress=False)
    flat = train(recipe_for(workspace, "data.padding_free=true", *common, f"output.dir={workspace / 'f'}"),
                 progress=False)
    torch.testing.assert_close(torch.tensor(losses(flat.run_dir)), torch.tensor(losses(padded.run_dir)),
                               atol=1e-5, rtol=0)
    tokens = [r["tokens"] for r in read_metrics(flat.run_dir / "metrics.jsonl") if "loss" in r]
    assert tokens == [r["tokens"] for r in read_metrics(padded.run_dir / "metrics.jsonl") if "loss" in r]


def test_a_run_from_before_the_auto_defaults_resumes_under_them(workspace):
    """A run whose saved recipe says data.padding_free: false and training.offload_embeddings: false (what every
    recipe saved before they became auto said) resumes under the new defaults: neither changes the data."""
    short = ["training.max_steps=4", "training.eval_every=0", "training.save_every=2", "lora.dropout=0"]
    first = train(recipe_for(workspace, *short, "data.padding_free=false", "training.offload_embeddings=false"),
                  progress=False)
    resumed = train(recipe_for(workspace, "training.max_steps=6", "training.eval_every=0", "training.save_every=2",
                               "lora.dropout=0"), resume=first.run_dir, progress=False)
    assert [r["step"] for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "loss" in r] == list(range(1, 7))


def test_the_default_cpu_run_lays_every_batch_out_padding_free(workspace, monkeypatch):
    import entrenar.models.padding_free as padding_free
    import entrenar.train.trainer as trainer

    flat = []
    real = trainer.padding_free
    monkeypatch.setattr(trainer, "padding_free", lambda batch: flat.append(1) or real(batch))
    monkeypatch.setattr(padding_free, "CPU_DOCUMENTS_MIN_WORK", 1)  # the workspace's model and sums are tiny
    train(recipe_for(workspace, "training.max_steps=2", "training.eval_every=0", "training.save_every=0"),
          progress=False)
    assert len(flat) == 2  # every batch of the default CPU run went padding-free


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_packed_rows_attend_document_by_document_on_a_cpu_with_the_mask_losses(workspace, monkeypatch, precision,
                                                                               tolerance):
    """On a CPU the loop hands packed rows over as documents (each attends on its own: explicit products in
    bf16, PyTorch's flash kernel in fp32); with that off they go through SDPA under a dense document mask:
    the same losses (bf16: within its noise)."""
    import entrenar.models.attention_dispatch as attention_dispatch
    import entrenar.models.padding_free as padding_free
    import entrenar.train.plan as plan

    monkeypatch.setattr(padding_free, "CPU_DOCUMENTS_MIN_WORK", 1)  # the workspace's model and sums are tiny
    seen = []
    real = attention_dispatch.documents_attention
    monkeypatch.setattr(attention_dispatch, "documents_attention", lambda *a, **k: seen.append(1) or real(*a, **k))
    common = ["lora.dropout=0", f"training.precision={precision}", "data.packing=true", "data.padding_free=false"]
    documents = train(recipe_for(workspace, *common, f"output.dir={workspace / 'd'}"), progress=False)
    assert seen, "packed rows did not reach the per-document attention"
    monkeypatch.setattr(plan, "rows_by_document", lambda *a, **k: False)
    seen.clear()
    masked = train(recipe_for(workspace, *common, f"output.dir={workspace / 'm'}"), progress=False)
    assert not seen
    torch.testing.assert_close(torch.tensor(losses(documents.run_dir)), torch.tensor(losses(masked.run_dir)),
                               atol=tolerance, rtol=0)


def test_checkpointing_and_offload_settings_are_checked(workspace):
    with pytest.raises(ConfigError,
                       match=r"training\.activation_checkpointing: cannot checkpoint 5 layers of a 2-layer"):
        train(recipe_for(workspace, "training.activation_checkpointing=5"), dry_run=True, progress=False)
    with pytest.raises(ConfigError, match=r"training\.activation_checkpointing: layer indices \[2\]"):
        train(recipe_for(workspace, "training.activation_checkpointing=[0, 2]"), dry_run=True, progress=False)
    with pytest.raises(ConfigError, match=r"training\.offload_activations.*model\.device is 'cpu'"):
        recipe_for(workspace, "training.offload_activations=true", "training.activation_checkpointing=true")


def test_offload_embeddings_settings_are_checked(workspace):
    with pytest.raises(ConfigError, match=r"training\.offload_embeddings.*full fine-tuning trains it"):
        recipe_for(workspace, "training.offload_embeddings=true", "model.device=cuda", "lora=null")
    with pytest.raises(ConfigError, match=r"training\.offload_embeddings.*model\.device is 'cpu'"):
        recipe_for(workspace, "training.offload_embeddings=true")
    if not torch.cuda.is_available():  # model.device auto resolves to the CPU here
        with pytest.raises(ConfigError, match=r"training\.offload_embeddings: .* this run is on cpu"):
            train(recipe_for(workspace, "training.offload_embeddings=true", "model.device=auto"), dry_run=True,
                  progress=False)


def test_offload_weights_settings_are_checked(workspace):
    with pytest.raises(ConfigError, match=r"training\.offload_weights.*no NF4 base"):
        recipe_for(workspace, "training.offload_weights=true", "model.device=cuda")
    with pytest.raises(ConfigError, match=r"training\.offload_weights.*model\.device is 'cpu'"):
        recipe_for(workspace, "training.offload_weights=true", "lora.quantize_base=nf4")
    if not torch.cuda.is_available():  # model.device auto resolves to the CPU here
        with pytest.raises(ConfigError, match=r"training\.offload_weights: .* this run is single on cpu"):
            train(recipe_for(workspace, "training.offload_weights=true", "lora.quantize_base=nf4",
                             "model.device=auto"), dry_run=True, progress=False)


def test_cuda_graph_settings_are_checked(workspace):
    with pytest.raises(ConfigError, match=r"training\.cuda_graphs.*model\.device is 'cpu'"):
        recipe_for(workspace, "training.cuda_graphs=true")
    with pytest.raises(ConfigError, match=r"training\.cuda_graphs.*data\.padding_free"):
        recipe_for(workspace, "training.cuda_graphs=true", "model.device=cuda", "data.padding_free=true")
    if not torch.cuda.is_available():  # model.device auto resolves to the CPU here
        with pytest.raises(ConfigError, match=r"training\.cuda_graphs: .* this run is on cpu"):
            train(recipe_for(workspace, "training.cuda_graphs=true", "model.device=auto"), dry_run=True,
                  progress=False)


def test_the_quickstart_shortened_below_its_warmup_fits_the_warmup_and_says_so(tmp_path, capsys):
    """``entrenar train --set training.max_steps=5`` on the quickstart: its 30 warmup steps become a tenth of
    the run, in one line, instead of a refusal; a warmup the user set is still refused."""
    from entrenar.config import load_recipe
    from entrenar.errors import ConfigError

    recipe = load_recipe(None, ["training.max_steps=5", f"output.dir={tmp_path / 'run'}"])
    result = train(recipe, dry_run=True, verbose=True)
    out = capsys.readouterr().out
    assert "quickstart: warmup shortened from 30 to 0 steps to fit training.max_steps=5" in out
    assert "warmup_steps: 0" in out and result.summary
    with pytest.raises(ConfigError, match=r"warmup_steps \(7\) is longer than the run .* --set schedule\."):
        train(load_recipe(None, ["training.max_steps=5", "schedule.warmup_steps=7",
                                 f"output.dir={tmp_path / 'run'}"]), dry_run=True, progress=False)


def test_train_in_python_is_quiet_unless_verbose_and_a_log_gets_whole_lines(workspace, capsys, monkeypatch):
    """``train()`` draws no bar unless ``verbose=True`` (even at a terminal); verbose where stderr is no terminal
    (a log file, CI), progress comes as newline-ended step lines, never a bar's ``\\r``."""
    from entrenar.train import loop

    few = ("training.max_steps=2", "schedule.warmup_steps=1", "training.eval_every=0", "training.save_every=0")
    monkeypatch.setattr(loop, "interactive", lambda stream=None: True, raising=False)  # as at a terminal
    capsys.readouterr()
    train(recipe_for(workspace, *few, f"output.dir={workspace / 'quiet'}"))
    assert capsys.readouterr() == ("", "")
    monkeypatch.undo()  # capsys: not a terminal
    train(recipe_for(workspace, *few, f"output.dir={workspace / 'log'}"), verbose=True)
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [line.split("  ")[0] for line in out.splitlines() if line.startswith("step ") and "/" in line] == \
        ["step 1/2", "step 2/2"]
