"""The decode step replayed from a CUDA graph (entrenar.generation.graphed) against the eager decode and the
full-sequence forward, on a tiny random Llama on a GPU: greedy tokens and log-probabilities of a batch of prompts of
different lengths, with LoRA adapters unmerged, stop tokens, seeded sampling, a QLoRA model (NF4 base, fused
kernels), weights changed between calls, and weight streaming (which stays eager, saying why)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.errors import ConfigError
from entrenar.generation.batched import Generated, SamplingConfig, generate_batch
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import quantize_model_nf4
from entrenar.quant.nf4.streaming import stream_weights
from entrenar.tasks.rl.logprobs import completion_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs replay on a CUDA device")

CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                     num_kv_heads=2, model_type="llama")
PROMPTS = [[5, 9, 17, 3, 44], [7], [11, 12, 13, 14, 15, 16, 2, 8, 9]]
NEW = 12
GREEDY = SamplingConfig(max_new_tokens=NEW, temperature=0.0)


def _model(dtype: torch.dtype = torch.float32, nf4: bool = False, head_std: float = 1.0) -> Transformer:
    """A random Llama with unmerged LoRA adapters whose B is not zero; ``head_std`` 1: logits far apart (fp32
    greedy tokens that rounding cannot swap)."""
    torch.manual_seed(0)
    model = Transformer(CONFIG).cuda().to(dtype)
    model.reset_parameters()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, head_std)
    if nf4:
        quantize_model_nf4(model.model.layers)
    apply_lora(model, LoraConfig(r=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj")))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.1)
    return model


def _both(model: Transformer, cfg: SamplingConfig, seed: int | None = None, **kwargs) -> tuple[Generated, Generated]:
    """The graphed and the eager generation of PROMPTS (the same generator seed for each)."""
    def run(graphs: bool) -> Generated:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return generate_batch(model, PROMPTS, dataclasses.replace(cfg, cuda_graphs=graphs), generator=generator,
                              **kwargs)

    graphed, eager = run(True), run(False)
    assert graphed.decode == "cuda graph" and eager.decode == "eager (cuda_graphs: false)"
    return graphed, eager


def _full_forward(model: Transformer, out: Generated, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        return completion_logprobs(model, ids, mask, out.completion_ids.shape[1], temperature=temperature)


def _assert_same(graphed: Generated, eager: Generated, atol: float = 1e-4) -> None:
    assert torch.equal(graphed.completion_ids, eager.completion_ids)
    assert torch.equal(graphed.completion_mask, eager.completion_mask)
    assert torch.equal(graphed.stopped, eager.stopped)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=1e-4, atol=atol)


def test_graphed_greedy_equals_eager_and_full_forward_with_lora():
    model = _model()
    graphed, eager = _both(model, GREEDY, num_generations=2)
    _assert_same(graphed, eager)
    assert graphed.completion_ids.shape == (6, NEW)
    torch.testing.assert_close(graphed.logprobs, _full_forward(model, graphed), rtol=1e-4, atol=1e-4)
    for row in range(graphed.completion_ids.shape[0]):  # each row alone, unpadded: its argmax tokens
        real = graphed.prompt_ids[row][graphed.prompt_mask[row].bool()]
        ids = torch.cat([real, graphed.completion_ids[row]])[None]
        with torch.no_grad():
            logits = model(ids)[0, len(real) - 1:-1]
        assert logits.argmax(-1).tolist() == graphed.completion_ids[row].tolist()


def test_graphed_stop_tokens_and_seeded_sampling_equal_eager():
    model = _model()
    free = generate_batch(model, PROMPTS, GREEDY)
    stop = int(free.completion_ids[0, 3])
    graphed, eager = _both(model, GREEDY, stop_ids=[stop])
    _assert_same(graphed, eager)
    first = free.completion_ids[0].tolist().index(stop)
    assert bool(graphed.stopped[0]) and int(graphed.completion_mask[0].sum()) == first + 1
    torch.testing.assert_close(graphed.logprobs, _full_forward(model, graphed), rtol=1e-4, atol=1e-4)
    sampled = SamplingConfig(max_new_tokens=NEW, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)
    graphed, eager = _both(model, sampled, seed=3, num_generations=3, stop_ids=[stop])
    _assert_same(graphed, eager)  # the sampler (and its CPU generator) runs outside the graph
    torch.testing.assert_close(graphed.logprobs, _full_forward(model, graphed, 0.9) * graphed.completion_mask,
                               rtol=1e-4, atol=1e-4)


def test_each_call_replays_the_weights_it_was_given():
    """A graph lives for one call: adapters trained between calls (and another batch shape) are seen."""
    model = _model()
    first, _ = _both(model, GREEDY)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(torch.randn_like(p) * 0.2)
    graphed = generate_batch(model, PROMPTS[:2], GREEDY)
    eager = generate_batch(model, PROMPTS[:2], SamplingConfig(max_new_tokens=NEW, temperature=0.0,
                                                              cuda_graphs=False))
    assert graphed.decode == "cuda graph"
    _assert_same(graphed, eager)
    assert not torch.allclose(first.logprobs[:2], graphed.logprobs)  # not the weights of the first capture


def test_qlora_nf4_base_with_kernels_replays():
    model = _model(torch.bfloat16, nf4=True, head_std=0.1)
    apply_kernels(model)
    graphed, eager = _both(model, GREEDY, num_generations=2)
    # bf16 rounds the static cache's products (over more, masked, columns) differently from the eager ones, so a
    # near tie may go either way: each path is held to the full forward on its own tokens.
    for out in (graphed, eager):
        torch.testing.assert_close(out.logprobs, _full_forward(model, out), rtol=0, atol=0.05)


def test_weight_streaming_stays_eager_and_says_why():
    model = _model(torch.bfloat16, nf4=True, head_std=0.1)
    stream = stream_weights(model, torch.device("cuda"))
    assert stream is not None
    try:
        out = generate_batch(model, PROMPTS, GREEDY)
        assert out.decode.startswith("eager (module 'model.layers.0' has forward hooks")
        with pytest.raises(ConfigError, match="cuda_graphs: true, but the decode step cannot replay"):
            generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, cuda_graphs=True))
    finally:
        stream.remove()
    assert generate_batch(model, PROMPTS, GREEDY).decode == "cuda graph"


def test_generate_one_prompt_graphed_equals_eager():
    """``entrenar generate`` and ``chat``'s sampler (generation.sampling.generate): the same tokens, streamed as
    they come, the stop token ending it; sampled with a seed, the same draws."""
    from entrenar.generation.sampling import generate

    model = _model()
    prompt = PROMPTS[2]
    streamed: list[int] = []
    graphed = generate(model, prompt, max_new_tokens=NEW, cuda_graphs=True, on_token=streamed.append)
    eager = generate(model, prompt, max_new_tokens=NEW, cuda_graphs=False)
    assert graphed == eager == streamed and len(graphed) == NEW
    assert generate(model, prompt, max_new_tokens=NEW, stop_ids=[graphed[4]]) == graphed[:graphed.index(graphed[4])]
    sampled = [generate(model, prompt, max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=5, cuda_graphs=graphs)
               for graphs in (True, False)]
    assert sampled[0] == sampled[1]
