"""What the fused kernels do with a model family's flags, said in the plan (``--dry-run``) when kernels are on.

Every flag is either covered by the kernels or leaves the module it touches on its plain PyTorch forward; this
module only words which, so a reader of the plan knows nothing runs silently wrong.
"""

from __future__ import annotations

from entrenar.models.config import ModelConfig


def family_notes(config: ModelConfig) -> list[str]:
    """One note per family flag the kernels treat specially (empty for the Llama-style families)."""
    notes = []
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
    return notes
