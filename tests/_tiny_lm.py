"""A tiny GPT-2 from a config (no download) trained by a Hugging Face ``Trainer`` or a Lightning
``Trainer``, built alike in the test process and in the processes
tests/integrations/test_fit_trainer.py starts (``python _tiny_lm.py hf|lightning OUT [train]``
prints what the run set, as JSON after MARK)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import batchwidgets as bw

MARK = "batchwidgets-test: "  # the line with the results (the trainers print lines of their own)
BUDGET = 24 * 2**20  # on the CPU: about 30 sequences of 32 tokens fit
SEQUENCES, LENGTH, VOCAB = 64, 32, 256


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=0, eos_token_id=0))


def tokens() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_trainer(out: str, per_device: int = 64, max_steps: int = 2) -> object:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(out, per_device_train_batch_size=per_device, max_steps=max_steps,
                             report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    return Trainer(gpt2(), args, train_dataset=tokens())


def lightning_module(batch_size: int = 64) -> object:
    import lightning.pytorch as pl

    class TinyLM(pl.LightningModule):
        """GPT-2 in a LightningModule whose train_dataloader reads ``self.batch_size``; it notes
        the size of each batch the fit loop trains on (from on_train_start: not the probe's)."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.model = gpt2()
            self._seen: list[int] = []

        def on_train_start(self) -> None:
            self._seen = []

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            self._seen.append(batch["input_ids"].shape[0])
            loss = self.model(**batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(tokens(), batch_size=self.batch_size)

    return TinyLM()


def lightning_fit(callback: object, module: object, max_steps: int = 2) -> object:
    import lightning.pytorch as pl

    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1,
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


def run_hf(out: str, train: bool) -> dict:
    trainer = hf_trainer(out)
    args = trainer.args
    started = time.perf_counter()
    fit = bw.fit_trainer(trainer, budget=BUDGET)
    elapsed = time.perf_counter() - started
    batch = next(iter(trainer.get_train_dataloader()))
    found = {"per_device": args.per_device_train_batch_size,
             "steps": args.gradient_accumulation_steps, "world_size": args.world_size,
             "global": fit.global_batch_size, "max_per_device": fit.max_per_device,
             "loader_batch": batch["input_ids"].shape[0], "learning_rate": args.learning_rate,
             "remembered": fit.remembered is not None, "fit_s": elapsed,
             "loop": fit.probe.loop}
    if train:
        model = trainer.model
        with bw.track_tensor_memory(BUDGET, baseline=[*model.parameters(),
                                                      *model.buffers()]) as tracker:
            trainer.train()
        found.update(train_peak_bytes=tracker.peak_bytes, global_step=trainer.state.global_step)
    return found


def run_lightning(train: bool) -> dict:
    from batchwidgets.integrations.lightning import BatchSizeCallback

    callback = BatchSizeCallback(global_batch_size=64, budget=BUDGET)
    module = lightning_module()
    started = time.perf_counter()
    trainer = lightning_fit(callback, module, max_steps=2 if train else 1)
    report = callback.report
    return {"per_device": module.batch_size, "steps": trainer.accumulate_grad_batches,
            "global": report.global_batch_size, "world_size": trainer.world_size,
            "max_per_device": report.max_per_device, "seen": module._seen,
            "global_step": trainer.global_step, "remembered": report.remembered is not None,
            "fit_s": time.perf_counter() - started}


if __name__ == "__main__":
    kind, out = sys.argv[1], sys.argv[2]
    train = sys.argv[3:] == ["train"]
    found = run_hf(out, train) if kind == "hf" else run_lightning(train)
    # one write, under PIPE_BUF, after what this process printed: the ranks of a torchrun job
    # share the pipe, and a rank's buffered output flushed in pieces could otherwise split the
    # line or run into it (the newline first ends another rank's unfinished line)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\n{MARK}{json.dumps(found)}\n".encode())
