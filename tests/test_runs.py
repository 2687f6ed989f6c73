"""Run folders wherever a model or adapter is accepted: a run, its best/, its checkpoints/step-N, its adapter/.

The reference for each is loading the same weights by hand: the base model plus the adapter folder the run
wrote, or the run's model/ folder.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import entrenar
from entrenar.config import load_recipe
from entrenar.errors import AdapterError, ModelError
from entrenar.loading.runs import resolve_model_and_adapter
from entrenar.train.loop import train

IDS = torch.tensor([[3, 7, 11, 2, 5]])


def make_run(ws, *overrides):
    text = """
model: {path: model, device: cpu}
data: {train: train.jsonl, seq_len: 32, validation_split: 0.2, train_on: completion, add_eos: false}
lora: {r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}
optimizer: {lr: 1.0e-2}
schedule: {warmup_steps: 1}
training: {max_steps: 4, batch_size: 2, eval_every: 2, save_every: 2, log_every: 1}
output: {dir: runs}
"""
    (ws / "recipe.yaml").write_text(text)  # beside model/: a project folder, not a run
    cwd = os.getcwd()
    os.chdir(ws)  # relative paths, as a user in their project folder writes them
    try:
        return train(load_recipe(ws / "recipe.yaml", list(overrides)), progress=False).run_dir.absolute()
    finally:
        os.chdir(cwd)


def run_cli(capsys, *argv):
    from entrenar.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def logits(path, **kwargs):
    model, _ = entrenar.load(path, device="cpu", dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(IDS)


@pytest.fixture
def runs(workspace):
    return {"lora": make_run(workspace), "ws": workspace}


def test_a_lora_run_stands_for_its_base_and_adapter(runs, tmp_path, monkeypatch):
    ws, run = runs["ws"], runs["lora"]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the recipe's relative model path is found from above the run
    assert resolve_model_and_adapter(ws / "model").recipe is None  # ws/recipe.yaml does not make ws a run
    source = resolve_model_and_adapter(run)
    assert (source.model, source.adapter, source.checkpoint) == (ws / "model", run / "adapter", None)
    assert source.recipe.data.train_on == "completion" and source.run_dir == run
    assert entrenar.read_model_config(run) == entrenar.read_model_config(ws / "model")  # inspect RUN
    expected = logits(ws / "model", adapter=run / "adapter")
    assert not torch.equal(expected, logits(ws / "model"))  # the adapter changes the model
    for path in (run, run / "adapter", run / "checkpoints" / "step-4"):
        torch.testing.assert_close(logits(path), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(ws / "model", adapter=run), expected, atol=0, rtol=0)
    best = run / "best"
    torch.testing.assert_close(logits(best), logits(ws / "model", adapter=best / "adapter"), atol=0, rtol=0)
    step2 = logits(run / "checkpoints" / "step-2")
    assert not torch.equal(step2, expected)  # an earlier step is another model

    with pytest.raises(AdapterError, match="already brings its adapter"):
        entrenar.load(run, adapter=run / "adapter")
    with pytest.raises(ModelError, match="step-3: no model.safetensors"):
        (run / "checkpoints" / "step-3").mkdir()
        entrenar.load(run / "checkpoints" / "step-3")


def test_eval_of_a_run_uses_its_recipe(runs, capsys):
    from entrenar.evaluation.loss import evaluate_file

    ws, run = runs["ws"], runs["lora"]
    model, tokenizer = entrenar.load(ws / "model", adapter=run / "adapter", device="cpu", dtype=torch.float32)
    as_trained = evaluate_file(model, tokenizer, ws / "train.jsonl", 32, 4, "completion", add_eos=False)
    all_tokens = evaluate_file(model, tokenizer, ws / "train.jsonl", 512, 4, "all", add_eos=True)
    assert as_trained.loss != pytest.approx(all_tokens.loss, rel=1e-3)

    code, out, err = run_cli(capsys, "eval", run, "--data", ws / "train.jsonl", "--device", "cpu")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"using the run's recipe ({run}/recipe.yaml): seq_len 32, train_on completion, " \
                                  "add_eos false"
    assert f"loss {as_trained.loss:.4f} " in out.splitlines()[1]
    code, out, _ = run_cli(capsys, "eval", ws / "model", "--adapter", run, "--data", ws / "train.jsonl",
                           "--train-on", "all", "--eos", "--seq-len", 512, "--device", "cpu")
    assert code == 0 and f"loss {all_tokens.loss:.4f} " in out  # flags override the recipe

    # The run's field names: a recipe that read {"q", "a"} records has eval read them too.
    recipe = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(recipe.replace("prompt_field: prompt", "prompt_field: q")
                                     .replace("completion_field: completion", "completion_field: a"))
    renamed = ws / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({"q": r["prompt"], "a": r["completion"]}) + "\n"
                               for r in map(json.loads, (ws / "train.jsonl").read_text().splitlines())))
    code, out, err = run_cli(capsys, "eval", run, "--data", renamed, "--device", "cpu")
    assert (code, err) == (0, "") and f"loss {as_trained.loss:.4f} " in out


def test_generate_and_export_take_a_checkpoint(runs, capsys, tmp_path):
    ws, run = runs["ws"], runs["lora"]
    step = run / "checkpoints" / "step-2"
    code, out, err = run_cli(capsys, "generate", step, "--prompt", "1+1=", "--max-new-tokens", 3, "--device", "cpu")
    assert (code, err) == (0, "")
    adapter = tmp_path / "adapter-step-2"
    code, out, err = run_cli(capsys, "export", step, "--output", adapter)
    assert (code, err) == (0, "")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    torch.testing.assert_close(logits(ws / "model", adapter=adapter), logits(step), atol=0, rtol=0)
    merged = tmp_path / "merged-step-2"
    code, out, err = run_cli(capsys, "export", step, "--output", merged, "--merge")
    assert (code, err) == (0, "")
    torch.testing.assert_close(logits(merged), logits(step), atol=1e-5, rtol=0)


def with_bpe_tokenizer(ws):
    """Replace the workspace's model by one with a byte-level BPE tokenizer, which GGUF files can hold."""
    import sys
    from pathlib import Path

    from entrenar.models.config import ModelConfig
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
    from tiny_chat_tokenizer import chat_tokenizer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2))
    model.reset_parameters()
    save_hf(model, ws / "model")
    chat_tokenizer().save(ws / "model")


def test_a_full_fine_tune_and_its_checkpoints_export_to_gguf(workspace, capsys, tmp_path):
    with_bpe_tokenizer(workspace)
    run = make_run(workspace, "lora=null")
    source = resolve_model_and_adapter(run)
    assert (source.model, source.adapter) == (run / "model", None)
    expected = logits(run / "model")
    torch.testing.assert_close(logits(run), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(run / "checkpoints" / "step-4"), expected, atol=0, rtol=0)
    with pytest.raises(AdapterError, match="is a full fine-tune's run, not an adapter"):
        entrenar.load(workspace / "model", adapter=run)

    gguf = tmp_path / "full.gguf"
    code, out, err = run_cli(capsys, "export", run, "--output", gguf, "--gguf", "f32")
    assert (code, err) == (0, "") and out.startswith(f"wrote {gguf}\n")
    assert "   verified: within the thresholds\n" in out  # export's read-back check (test_export_verify.py)
    torch.testing.assert_close(logits(gguf), expected, atol=1e-6, rtol=0)
    folder = tmp_path / "full"
    assert run_cli(capsys, "export", run / "checkpoints" / "step-2", "--output", folder)[0] == 0
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"  # as it trained, not fp16
    torch.testing.assert_close(logits(folder), logits(run / "checkpoints" / "step-2"), atol=0, rtol=0)


def test_quantize_data_of_a_run_scores_as_eval_does(workspace, capsys, tmp_path):
    """``quantize --data`` on a full fine-tune's run reports, before quantizing, the perplexity ``entrenar eval``
    reports for the same run and data (the run's train_on, add_eos and seq_len, not 512 tokens of everything)."""
    run = make_run(workspace, "lora=null")
    data = workspace / "train.jsonl"
    code, out, err = run_cli(capsys, "eval", run, "--data", data, "--device", "cpu")
    assert (code, err) == (0, "")
    eval_loss, eval_ppl = out.splitlines()[1].split()[1:4:2]

    code, out, err = run_cli(capsys, "quantize", run, "--method", "int8", "--data", data, "--device", "cpu",
                             "--output", tmp_path / "q")
    assert (code, err) == (0, "")
    assert f"using the run's recipe ({run}/recipe.yaml): seq_len 32, train_on completion, add_eos false" in out
    line = next(x for x in out.splitlines() if x.startswith("perplexity "))
    assert line.split()[1] == eval_ppl and line.split("; loss ")[1].split()[0] == eval_loss

    # Flags override the recipe exactly as eval's do.
    code, out, _ = run_cli(capsys, "eval", run, "--data", data, "--train-on", "all", "--eos", "--device", "cpu")
    eval_ppl = out.splitlines()[1].split()[3]
    code, out, _ = run_cli(capsys, "quantize", run, "--method", "int8", "--data", data, "--train-on", "all",
                           "--eos", "--device", "cpu", "--output", tmp_path / "q", "--overwrite")
    assert code == 0 and next(x for x in out.splitlines() if x.startswith("perplexity ")).split()[1] == eval_ppl
