"""A frozen embedding table in pinned CPU memory, gathered by the GPU: the rows of nn.Embedding, and clear refusals."""

from __future__ import annotations

import gc

import pytest
import torch
from kernel_checks import DEVICE, needs_cuda, needs_kernels
from torch import nn

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.errors import ConfigError
from entrenar.kernels.host_embedding import (
    HostEmbedding,
    HostHead,
    gather_rows,
    head_weight,
    move_table,
    offload_embeddings,
    prefetch_head,
)
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer


def _model(tied: bool = False, device: str = "cpu", lora: bool | list[str] = True, vocab: int = 96) -> Transformer:
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, tie_word_embeddings=tied)
    model = Transformer(config)
    model.reset_parameters()
    if lora:
        apply_lora(model, LoraConfig(r=2, alpha=4.0, **({"target_modules": lora} if isinstance(lora, list) else {})))
    return model.to(device=device, dtype=torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("width", [48, 4096 + 8], ids=["narrow", "wider-than-a-block"])
def test_kernel_gathers_the_rows_of_the_table(width):
    torch.manual_seed(0)
    table = torch.randn(300, width, dtype=torch.bfloat16)
    if DEVICE == "cuda":
        table = table.pin_memory()
    ids = torch.randint(0, 300, (3, 17), device=DEVICE)
    rows = gather_rows(table, ids)
    assert rows.device == ids.device and rows.shape == (3, 17, width)
    assert torch.equal(rows.cpu(), nn.functional.embedding(ids.cpu(), table))


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter only")
def test_an_id_outside_the_table_reads_nothing_outside_it():
    """The interpreter skips device assertions; the kernel's masked read is what is left to check there."""
    table = torch.randn(10, 8)
    rows = gather_rows(table, torch.tensor([3, 10, -1]))
    assert torch.equal(rows, table[[3, 0, 0]])


@needs_cuda
@needs_kernels
def test_an_id_outside_the_table_stops_the_kernel(tmp_path):
    """On the GPU the kernel's device-side assertion fires, as F.embedding's does (in a child process: it ends
    the CUDA context)."""
    import subprocess
    import sys

    script = tmp_path / "bad_id.py"
    script.write_text(
        "import torch\n"
        "from entrenar.kernels.host_embedding import gather_rows\n"
        "table = torch.randn(10, 8).pin_memory()\n"
        "gather_rows(table, torch.tensor([3, 10], device='cuda'))\n"
        "torch.cuda.synchronize()\n"
    )
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "token id outside the table" in done.stdout + done.stderr or "device-side assert" in done.stderr


@needs_kernels
def test_rows_of_a_table_with_a_row_stride_are_gathered():
    """A view of some columns of a wider table: rows start ``stride(0)`` elements apart, not ``width``."""
    table = torch.arange(80.0).view(8, 10)[:, :6]
    if DEVICE == "cuda":
        table = torch.arange(80.0).view(8, 10).pin_memory()[:, :6]
    ids = torch.tensor([3, 7, 0], device=DEVICE)
    assert torch.equal(gather_rows(table, ids).cpu(), nn.functional.embedding(ids.cpu(), table))


def test_a_table_that_trains_or_whose_rows_are_not_contiguous_is_refused():
    with pytest.raises(ConfigError, match="frozen table"):
        gather_rows(torch.randn(4, 2, requires_grad=True), torch.tensor([1]))
    with pytest.raises(ConfigError, match=r"contiguous rows, got shape \(2, 4\) and strides \(1, 2\)"):
        gather_rows(torch.randn(4, 2).T, torch.tensor([1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lora": False}, "trained in this run"),
        ({}, "on cpu; offloading moves them off a GPU"),
        ({"lora": ["q_proj", "lm_head"]}, "on cpu; offloading moves them off a GPU"),  # a LoRA head holds no .weight
    ],
    ids=["trained", "on-cpu", "lora-on-the-head"],
)
def test_offload_refuses_what_it_cannot_serve(kwargs, message):
    model = _model(**kwargs)
    with pytest.raises(ConfigError, match=r"model\.embed_tokens\.weight: .*" + message):
        offload_embeddings(model)
    assert type(model.model.embed_tokens) is nn.Embedding  # nothing changed


def test_a_table_shared_with_another_module_than_the_head_is_refused():
    model = _model(tied=True)
    model.extra = nn.Linear(32, 96, bias=False)
    model.extra.weight = model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match=r"model\.embed_tokens\.weight: .*tied to extra\.weight, whose products"):
        offload_embeddings(model)
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear  # nothing changed


def test_a_table_that_cannot_be_read_from_the_gpu_is_named():
    """A table moved or unfrozen after offloading: one message naming it, not a device-mismatch traceback."""
    model = _model()
    embedding = model.model.embed_tokens
    embedding.__class__ = HostEmbedding
    ids = torch.zeros(2, 3, dtype=torch.long, device="meta")  # stands in for ids on a GPU
    with pytest.raises(ConfigError, match=r"embed_tokens\.weight is on cpu \(not pinned\) and its ids on meta"):
        embedding(ids)
    embedding.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"\(trainable\)"):
        embedding(ids)


@needs_cuda
@needs_kernels
def test_offloaded_model_gives_the_same_logits_and_gradients_and_frees_the_table():
    model = _model(device="cuda")
    ids = torch.randint(0, 96, (2, 7), device="cuda")
    expected = model(ids)
    adapter = model.model.layers[0].self_attn.q_proj.lora_A.weight
    expected_grads = torch.autograd.grad(expected.float().square().mean(), [adapter])
    before = torch.cuda.memory_allocated()
    freed = offload_embeddings(model)
    assert freed == 96 * 32 * 2 and torch.cuda.memory_allocated() == before - freed
    weight = model.model.embed_tokens.weight
    assert weight.device.type == "cpu" and weight.is_pinned() and not weight.requires_grad
    logits = model(ids)
    assert torch.equal(logits, expected)
    grads = torch.autograd.grad(logits.float().square().mean(), [adapter])
    assert torch.equal(grads[0], expected_grads[0])


@needs_cuda
@needs_kernels
def test_the_gather_records_in_a_cuda_graph():
    table = torch.randn(50, 64, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, 50, (4, 9), device="cuda")
    gather_rows(table, ids)  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = gather_rows(table, ids)
    ids.copy_(torch.randint(0, 50, (4, 9), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), nn.functional.embedding(ids.cpu(), table))


def test_a_model_computes_where_its_layers_are_not_where_its_offloaded_table_is():
    from entrenar.models.transformer import compute_device

    model = _model(device="meta")  # stands in for a GPU: any device that is not the CPU
    assert compute_device(model) == torch.device("meta")
    model.model.embed_tokens.weight = nn.Parameter(torch.zeros(96, 32, dtype=torch.bfloat16), requires_grad=False)
    assert next(model.parameters()).device.type == "cpu"
    assert compute_device(model) == torch.device("meta")
    assert compute_device(_model()) == torch.device("cpu")


def _lora_grads(model, ids):
    logits = model(ids)
    params = [p for p in model.parameters() if p.requires_grad]
    return logits, torch.autograd.grad(logits.float().square().mean(), params)


def test_a_tied_table_moves_once_and_stays_tied_under_both_names():
    """move_table (what offload_embeddings does once it has checked, here with a copy for the pinned move): the
    embedding and the head read one parameter, both names still in the state dict with the same values, and the
    model computes what it did."""
    model = _model(tied=True)
    ids = torch.randint(0, 96, (2, 7))
    expected, expected_grads = _lora_grads(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    move_table(model, lambda t: t.clone())
    embedding, head = model.model.embed_tokens, model.lm_head
    assert type(embedding) is HostEmbedding and type(head) is HostHead
    assert head.weight is embedding.weight and not head.weight.requires_grad
    named = [n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding.weight]
    assert named == ["model.embed_tokens.weight", "lm_head.weight"]
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    logits, grads = _lora_grads(model, ids)
    assert torch.equal(logits, expected)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    # where the table is already on the hidden states' device there is nothing to copy or wait for
    prefetch_head(head, torch.device("cpu"))
    assert head._prefetched is None and head_weight(head, torch.device("cpu")) is embedding.weight
    untied = _model()
    assert head_weight(untied.lm_head, torch.device("cpu")) is untied.lm_head.weight


def test_the_chunked_losses_read_a_tied_table_in_cpu_memory_through_the_head():
    """The causal LM's fused loss and the preference and GRPO log-probabilities take a HostHead as the plain
    head whose weight they read (a LoRA'd head stays read through the model's logits)."""
    from entrenar.kernels.host_embedding import is_plain_head
    from entrenar.tasks.preference.logprobs import plain_head as preference_head
    from entrenar.tasks.rl.logprobs import plain_head as rl_head

    model = _model(tied=True)
    move_table(model, lambda t: t.clone())
    assert is_plain_head(model.lm_head)
    assert preference_head(model) is model.lm_head and rl_head(model) is model.lm_head
    lora_head = _model(lora=["q_proj", "lm_head"])
    assert not is_plain_head(lora_head.lm_head) and preference_head(lora_head) is None


@needs_cuda
@needs_kernels
def test_a_tied_table_in_cpu_memory_gives_the_same_logits_and_gradients_and_frees_it():
    vocab = 16384  # a 1 MiB table: a kept copy stands out from the few KiB a test session's allocator may add
    model = _model(tied=True, device="cuda", vocab=vocab)
    ids = torch.randint(0, vocab, (2, 7), device="cuda")
    expected, expected_grads = _lora_grads(model, ids)
    before = torch.cuda.memory_allocated()
    freed = offload_embeddings(model)
    assert freed == vocab * 32 * 2 and torch.cuda.memory_allocated() == before - freed
    head = model.lm_head
    assert type(head) is HostHead and head.weight.is_pinned() and head.weight is model.model.embed_tokens.weight
    logits, grads = _lora_grads(model, ids)
    assert torch.equal(logits, expected)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    del logits, grads
    gc.collect()
    # no copy of the table kept after its use (exactly 0 more in a process of its own on an H200, 2026-11-27;
    # 7 KiB more inside a pytest session that had run the file's other GPU tests)
    assert torch.cuda.memory_allocated() - (before - freed) < freed // 8


def _host_head(vocab: int = 65536, width: int = 512) -> HostHead:
    """A head over a pinned 64 MiB table: large enough that reading it before its copy has landed would show."""
    head = nn.Linear(width, vocab, bias=False, dtype=torch.bfloat16)
    head.weight = nn.Parameter(head.weight.detach().pin_memory(), requires_grad=False)
    head.__class__ = HostHead
    return head


@needs_cuda
def test_a_prefetched_table_is_read_in_stream_order_and_records_in_a_cuda_graph():
    head = _host_head()
    x = torch.randn(5, 512, dtype=torch.bfloat16, device="cuda")
    cuda = torch.device("cuda", torch.cuda.current_device())
    expected = x @ head.weight.to("cuda").T
    torch.cuda.synchronize()
    prefetch_head(head, cuda)
    assert head._prefetched is not None
    assert torch.equal(x @ head_weight(head, cuda).T, expected) and head._prefetched is None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch_head(head, cuda)
        out = x @ head_weight(head, cuda).T
    with torch.no_grad():
        head.weight.mul_(2)  # the captured copy reads the pinned table again at each replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, 2 * expected)


@needs_cuda
def test_a_prefetched_copy_nobody_read_is_dropped_not_reused():
    """A forward that failed between the prefetch and the loss (or a capture that failed there) leaves a copy:
    the next prefetch drops it (after its copy, if it ran) and copies anew, and a copy made during a capture is
    never read outside it."""
    head = _host_head()
    x = torch.randn(5, 512, dtype=torch.bfloat16, device="cuda")
    cuda = torch.device("cuda", torch.cuda.current_device())
    prefetch_head(head, cuda)
    stale = head._prefetched[0]
    with torch.no_grad():
        head.weight.mul_(3)
    prefetch_head(head, cuda)
    assert head._prefetched[0] is not stale
    assert torch.equal(x @ head_weight(head, cuda).T, x @ head.weight.to("cuda").T)
    head._prefetched = (torch.zeros_like(stale), torch.cuda.Event(), True)  # as a failed capture leaves it
    assert torch.equal(head_weight(head, cuda), head.weight.to("cuda"))
    assert head._prefetched is None
