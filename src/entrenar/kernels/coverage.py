"""What the fused kernels do with a model family's flags, said in the plan (``--dry-run``) when kernels are on.

Every flag is either covered by the kernels or leaves the module it touches on its plain PyTorch forward; this
module only words which, so a reader of the plan knows nothing runs silently wrong.
"""

from __future__ import annotations

from entrenar.models.config import ModelConfig


def family_notes(config: ModelConfig) -> list[str]:
    """One note per family flag the kernels treat specially (empty for the Llama-style families)."""
    notes = []
    if config.sandwich_norms:
        notes.append("Gemma: the (1 + w) norms run the rms_norm kernel's offset form and the GELU-tanh gate the geglu "
                     "kernel; the sandwich blocks keep their own forward (no norm-inside-LoRA node)")
    if config.fused_qkv or config.fused_gate_up:
        notes.append("fused qkv_proj/gate_up_proj: each is one LoRA node, its output split for RoPE and SwiGLU")
    if config.partial_rotary_factor != 1.0:
        notes.append(f"partial rotary: the rope kernel turns the first {config.partial_rotary_factor:g} of each head")
    if config.post_norm:
        notes.append("post-norm blocks: the norm-in-projection node stays off (no norm feeds the projections); "
                     "the norms run the rms_norm kernel")
    if config.residual_multiplier != 1.0 or config.embedding_multiplier != 1.0:
        notes.append("embedding/residual multipliers: applied around the fused nodes")
    if config.is_mla:
        notes.append("multi-head latent attention runs its PyTorch path: the RoPE kernel and the norm-inside-LoRA "
                     "block fusion do not cover it (RMSNorm, SwiGLU, LoRA, MoE routing and the fused loss do)")
    if config.logits_scaling != 1.0:
        notes.append(f"logits divided by {config.logits_scaling:g} inside the fused loss")
    if config.no_rope_layers:
        notes.append("layers without RoPE (SmolLM3's no_rope_layers) skip the rotation")
    if config.rope_interleave and not config.is_mla:
        notes.append("interleaved RoPE pairs: q and k reordered to halves before the rope kernel")
    if config.post_block_norms:
        notes.append("norms after attention and MLP (GLM-4): the norm-in-projection node stays off; the norms run "
                     "the rms_norm kernel")
    if config.attention_sinks:
        notes.append("attention sinks run as PyTorch products (no SDPA or variable-length kernel takes them)")
    if config.expert_activation != "silu":
        notes.append("moe_routing: the clamped SwiGLU runs in PyTorch (the fused routed activation is SwiGLU's)")
    return notes
