"""The tiny seeded Llama several test files build (4 layers, GQA 4:2, head_dim 16, vocab 300): weights drawn so
that norms, embeddings and projections are all far from trivial, in float32."""
from __future__ import annotations

import math

import pytest
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, max_position_embeddings=512)


def tiny_llama(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model
