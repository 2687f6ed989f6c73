"""The loop on a CUDA device: bf16 autocast, fp16 with loss scaling, fused AdamW, compile, peak memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_loop import recipe_for

from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "settings",
    [
        ["training.precision=bf16", "model.dtype=bfloat16"],
        ["training.precision=fp16", "model.dtype=float32"],
        ["training.precision=bf16", "lora=null", "training.compile=true"],
        ["training.precision=bf16", "lora.quantize_base=nf4", "training.activation_checkpointing=true"],
        ["training.precision=bf16", "training.kernels=false", "training.compile=true"],
        ["model.dtype=bfloat16"],  # no autocast, kernels on (kernels: auto); the cases above run them under autocast
        ["model.dtype=bfloat16", "lora.quantize_base=nf4", "training.compile=true"],
        ["training.precision=bf16", "data.padding_free=true", "training.activation_checkpointing=1",
         "training.offload_activations=true"],
        ["model.dtype=bfloat16", "data.padding_free=true", "training.compile=true"],
        ["training.precision=bf16", "training.compile=true", "training.offload_activations=true"],
    ],
    ids=["lora-bf16", "lora-fp16-scaled", "full-bf16-compiled", "qlora-checkpointed", "plain-path-compiled",
         "kernels-bf16-weights", "kernels-qlora-compiled", "padding-free-offloaded", "padding-free-compiled",
         "compiled-offloaded"],
)
def test_training_on_cuda_learns_and_reports_memory(workspace, settings):
    result = train(recipe_for(workspace, "model.device=cuda", "training.max_steps=12", "optimizer.lr=5e-3",
                              *settings), progress=False)
    steps = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 12
    assert all(r["peak_mem_gb"] > 0 for r in steps)
    assert result.eval_after.loss < result.eval_before.loss


def test_adamw_is_fused_on_cuda(workspace):
    from entrenar.train.optim import build_optimizer, build_param_groups

    model = torch.nn.Linear(4, 4, device="cuda")
    optimizer = build_optimizer(build_param_groups(model, 0.0), "adamw", device=torch.device("cuda"))
    assert optimizer.defaults["fused"] is True


def test_padding_free_and_offload_on_cuda_give_the_padded_losses(workspace):
    """FlashAttention's varlen kernel over a padding-free row, with checkpointed inputs offloaded to the CPU,
    against padded packed rows with a document mask (SDPA): the same losses within bf16 noise."""
    common = ["model.device=cuda", "training.precision=bf16", "lora.dropout=0",
              "training.activation_checkpointing=true", "training.cuda_graphs=false"]
    padded = train(recipe_for(workspace, *common, f"output.dir={workspace / 'p'}"), progress=False)
    flat = train(recipe_for(workspace, *common, "data.padding_free=true", "training.offload_activations=true",
                            f"output.dir={workspace / 'f'}"), progress=False)

    def losses(run):
        return torch.tensor([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    torch.testing.assert_close(losses(flat), losses(padded), atol=3e-2, rtol=0)


def test_packed_rows_through_the_varlen_kernel_give_the_document_mask_losses(workspace, monkeypatch):
    """On CUDA in bf16 the loop hands packed rows to FlashAttention's varlen kernel as documents; with that
    off (monkeypatched) they go through SDPA with a dense document mask: the same losses within bf16 noise."""
    import entrenar.train.plan as plan

    common = ["model.device=cuda", "training.precision=bf16", "lora.dropout=0", "training.cuda_graphs=false"]
    varlen = train(recipe_for(workspace, *common, f"output.dir={workspace / 'v'}"), progress=False)
    monkeypatch.setattr(plan, "rows_by_document", lambda *a, **k: False)
    masked = train(recipe_for(workspace, *common, f"output.dir={workspace / 'm'}"), progress=False)

    def losses(run):
        return torch.tensor([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    torch.testing.assert_close(losses(varlen), losses(masked), atol=3e-2, rtol=0)


@pytest.mark.parametrize("settings", [["model.dtype=bfloat16", "training.adapter_math=bf16"],
                                      ["training.precision=bf16", "lora=null", "training.compile=true"],
                                      ["model.dtype=bfloat16", "lora.quantize_base=nf4",
                                       "training.activation_checkpointing=true", "training.offload_embeddings=true"],
                                      ["model.dtype=bfloat16", "lora.quantize_base=nf4",
                                       "training.activation_checkpointing=[0]", "training.offload_activations=true"],
                                      ["model.dtype=bfloat16", "lora.quantize_base=nf4",
                                       "training.activation_checkpointing=true", "training.offload_weights=true"]],
                         ids=["lora-kernels", "full-autocast-compiled", "qlora-checkpointed-embeddings-offloaded",
                              "qlora-activations-offloaded", "qlora-weights-streamed"])
def test_cuda_graphs_give_the_eager_losses(workspace, settings):
    """Micro-steps replayed from a CUDA graph (after 3 eager ones), gradients accumulated over 2 micro-batches:
    the losses of the eager run, and the replays really ran (the loss keeps falling after the capture)."""
    common = ["model.device=cuda", "lora.dropout=0", "training.grad_accum=2", "training.max_steps=8",
              "optimizer.lr=5e-3", *settings]
    eager = train(recipe_for(workspace, *common, "training.cuda_graphs=false", f"output.dir={workspace / 'e'}"),
                  progress=False)
    graphed = train(recipe_for(workspace, *common, "training.cuda_graphs=true", f"output.dir={workspace / 'g'}"),
                    progress=False)

    def losses(run):
        return torch.tensor([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    torch.testing.assert_close(losses(graphed), losses(eager), atol=2e-2, rtol=0)
    assert losses(graphed)[-1] < losses(graphed)[2]
    assert graphed.eval_after.loss < graphed.eval_before.loss


def test_offloaded_embeddings_give_the_losses_of_embeddings_on_the_gpu(workspace):
    common = ["model.device=cuda", "lora.dropout=0", "model.dtype=bfloat16", "training.max_steps=6"]
    kept = train(recipe_for(workspace, *common, f"output.dir={workspace / 'k'}"), progress=False)
    offloaded = train(recipe_for(workspace, *common, "training.offload_embeddings=true",
                                 f"output.dir={workspace / 'o'}"), progress=False)

    def losses(run):
        return torch.tensor([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    assert losses(offloaded)[0] == losses(kept)[0]  # the same rows, the same first forward, bit for bit
    torch.testing.assert_close(losses(offloaded), losses(kept), atol=1e-3, rtol=0)  # then attention's backward


def _tie(workspace):
    """The workspace's model with its output head tied to the embedding table (as Llama 3.2 and Gemma ship)."""
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.hf import load_hf, save_hf
    from entrenar.models.transformer import Transformer

    model, tokenizer = load_hf(workspace / "model"), Tokenizer.from_folder(workspace / "model")
    tied = Transformer(dataclasses.replace(model.config, tie_word_embeddings=True))
    tied.load_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, strict=False)
    save_hf(tied, workspace / "model")
    tokenizer.save(workspace / "model")


def test_a_tied_table_in_cpu_memory_gives_the_losses_of_one_on_the_gpu(workspace):
    """Tied to the output head, the table in pinned CPU memory is copied in ahead of each loss on a side stream
    (HostHead) and the step is replayed from a CUDA graph: the losses of the table kept on the GPU."""
    _tie(workspace)
    common = ["model.device=cuda", "lora.dropout=0", "model.dtype=bfloat16", "training.max_steps=8",
              "training.activation_checkpointing=true", "training.cuda_graphs=true", "training.kernels=true"]
    kept = train(recipe_for(workspace, *common, f"output.dir={workspace / 'k'}"), progress=False)
    offloaded = train(recipe_for(workspace, *common, "training.offload_embeddings=true",
                                 f"output.dir={workspace / 'o'}"), progress=False)

    def losses(run):
        return torch.tensor([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    assert losses(offloaded)[0] == losses(kept)[0]
    torch.testing.assert_close(losses(offloaded), losses(kept), atol=1e-3, rtol=0)
    assert offloaded.eval_after.loss == pytest.approx(kept.eval_after.loss, abs=1e-3)


def test_overlapped_steps_on_cuda_give_the_losses_of_steps_read_at_once(workspace, monkeypatch):
    """Pinned-memory reads behind CUDA events: the metrics of the run that reads each step at once."""
    from entrenar.train import stepping
    from entrenar.train.overlap import DeferredRead

    reads = []

    class Counted(DeferredRead):
        def __init__(self, values):
            reads.append(values.device.type)
            super().__init__(values)

    common = ["model.device=cuda", "lora.dropout=0", "training.precision=bf16", "training.max_steps=8",
              "training.cuda_graphs=false"]
    at_once = train(recipe_for(workspace, *common, "training.overlap_steps=false", f"output.dir={workspace / 'a'}"),
                    progress=False)
    monkeypatch.setattr(stepping, "DeferredRead", Counted)
    overlapped = train(recipe_for(workspace, *common, f"output.dir={workspace / 'o'}"), progress=False)  # auto: on
    assert reads == ["cuda"] * 3  # steps 2, 5 and 7 (1 precedes the optimizer's state; 3, 4, 6, 8 save or evaluate)

    def fields(run):
        return torch.tensor([[r["loss"], r["grad_norm"], r["tokens"]]
                             for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])

    torch.testing.assert_close(fields(overlapped), fields(at_once), atol=1e-3, rtol=1e-3)


def test_streamed_nf4_weights_train_as_resident_ones(workspace, monkeypatch):
    """training.offload_weights moves the NF4 base to pinned CPU memory and streams it block by block: the same
    losses, step for step, as the run that keeps it on the GPU."""
    common = ["model.device=cuda", "lora.dropout=0", "training.max_steps=6", "optimizer.lr=5e-3",
              "model.dtype=bfloat16", "lora.quantize_base=nf4", "training.activation_checkpointing=true",
              "training.cuda_graphs=false"]
    import entrenar.train.prepare as prepare

    streams = []
    real = prepare.stream_weights
    monkeypatch.setattr(prepare, "stream_weights", lambda *a: streams.append(real(*a)) or streams[-1])
    runs = [train(recipe_for(workspace, *common, f"training.offload_weights={on}", f"output.dir={workspace / on}"),
                  progress=False) for on in ("false", "true")]
    assert len(streams) == 1 and streams[0].blocks[0].host.is_pinned()  # the second run streamed, the first not
    resident, streamed = ([r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]
                          for run in runs)
    assert streamed == resident
