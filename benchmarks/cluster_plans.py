"""Plans for N GPUs (issue 25): a Llama-3-8B-shaped model on the meta device, trained in full
with fp32 AdamW at 2048 tokens, planned for 8xA100-80GB under every strategy from one fake trace.

    python benchmarks/cluster_plans.py   # the table in results/cluster_plans_cpu.md
"""

from __future__ import annotations

import time
import warnings

import torch
import transformers

import batchwidgets as bw

warnings.simplefilter("ignore")
config = transformers.LlamaConfig(vocab_size=128_256, hidden_size=4096, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=14_336, max_position_embeddings=2048)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)


def make_batch(batch_size: int) -> dict:
    ids = torch.randint(0, config.vocab_size, (batch_size, 2048))
    return {"input_ids": ids, "labels": ids}


started = time.perf_counter()
report = bw.find_batch(model, make_batch, target="8xA100-80GB", parallel="compare")
seconds = time.perf_counter() - started
print(report.summary())
print("| parallel | batch per rank | global batch | weights | gradients | optimizer | buffers |")
print("|---|--:|--:|--:|--:|--:|--:|")
for row in report.parallel_plans:
    print(f"| {row.parallel} | {row.max_batch_size} | {row.global_batch_size} | "
          f"{row.parameters_bytes / 1e9:.1f} GB | {row.gradients_bytes / 1e9:.1f} GB | "
          f"{row.optimizer_bytes / 1e9:.1f} GB | {row.communication_bytes / 1e9:.1f} GB |")
print(f"plan: {seconds:.1f} s")
