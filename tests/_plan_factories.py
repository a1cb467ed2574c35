"""Factories ``python -m batchwidgets plan --factory`` builds in tests/test_plan_cli.py, and the
Llama-shaped meta model the plans for N GPUs are made of (tests/engine/probe/test_cluster_plans.py,
tests/engine/probe/test_plans_agree.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10))


def cnn_with_batches():
    def make_batch(batch_size: int):
        return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))
    return small_cnn(), make_batch, torch.nn.functional.cross_entropy


def meta_llama(hidden: int, layers: int, intermediate: int, vocab: int, heads: int = 4,
               kv_heads: int = 2, **config) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of this shape on the meta device (nothing materialised)."""
    import transformers
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, vocab_size=vocab, **config)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def llama_tokens(vocab: int, length: int) -> Callable[[int], dict]:
    """make_batch of a language model: ``length`` tokens of ``vocab``, the labels the ids."""
    def make_batch(batch_size: int) -> dict:
        ids = torch.randint(0, vocab, (batch_size, length))
        return {"input_ids": ids, "labels": ids}
    return make_batch


def needs_weights() -> torch.nn.Module:
    """A factory that reads real numbers: on the meta device it raises."""
    model = small_cnn()
    model[0].weight.sum().item()
    return model
