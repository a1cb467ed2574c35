"""Trainer callbacks (issue 16): a NoiseTracker fed from the Hugging Face Trainer's and
Lightning's own gradient accumulation, through real ``Trainer.train()`` / ``fit()`` runs on tiny
models built from configs (no download): the first update's estimate equals the one computed by
hand from the same micro-batches, every loss and step is recorded, and training is unchanged."""

import pytest
import torch
from torch import nn

import batchwidgets as bw
from batchwidgets.engine.noise._estimate import estimate

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")
hf = pytest.importorskip("batchwidgets.integrations.transformers")
pl = pytest.importorskip("batchwidgets.integrations.lightning")

MICRO, STEPS, UPDATES = 4, 4, 6


def hand_estimate(model, micro_batches, loss_of):
    """(|G|^2, tr Sigma) of one update from its micro-batches, by hand: the two-batch-size
    estimator with |g_1|^2 and the squared norm of the mean gradient."""
    grads = []
    for batch in micro_batches:
        model.zero_grad()
        loss_of(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters()
                                if p.grad is not None]))
    mean = torch.stack(grads).mean(0)
    return estimate([float(grads[0] @ grads[0])], float(mean @ mean), MICRO, len(grads))


# ---- Hugging Face -------------------------------------------------------------------------------

def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 40, (n, 12), generator=generator)
        # the Trainer counts the items of an update before the model shifts the labels: with
        # the first label ignored, both count the 11 predicted tokens of each row
        self.labels = self.ids.clone()
        self.labels[:, 0] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class InOrder(transformers.Trainer):
    def _get_train_sampler(self, *args, **kwargs):  # the micro-batches the test recomputes
        return torch.utils.data.SequentialSampler(self.train_dataset)


def hf_train(tmp_path, callback, max_grad_norm=0.01):
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=STEPS, max_steps=UPDATES, report_to="none", use_cpu=True,
        learning_rate=1e-3, max_grad_norm=max_grad_norm, save_strategy="no", logging_steps=1000,
        dataloader_num_workers=0, seed=0)
    callbacks = [callback] if callback is not None else []
    InOrder(model=model, args=args, train_dataset=TokenData(MICRO * STEPS * UPDATES),
            callbacks=callbacks).train()
    return model


@pytest.mark.parametrize("max_grad_norm", [0.01, 0.0])
def test_transformers_callback_feeds_the_tracker_from_the_trainers_accumulation(
        tmp_path, max_grad_norm):
    callback = hf.NoiseCallback(
        bw.NoiseTracker(warmup_updates=1, overhead_target=None), panel=False)
    trained = hf_train(tmp_path, callback, max_grad_norm)
    report = callback.tracker.report
    assert report.n_losses_seen == STEPS * UPDATES
    assert report.n_updates == UPDATES
    assert (report.micro_batch_size, report.n_micro) == (MICRO, STEPS)
    assert len(report.data_stall_shares) == UPDATES
    assert all(0 <= share <= 1 for share in report.data_stall_shares)
    # the first update, by hand from the same micro-batches and the initial weights
    data = TokenData(MICRO * STEPS)
    batches = [{k: v[j * MICRO:(j + 1) * MICRO] for k, v in
                {"input_ids": data.ids, "labels": data.labels}.items()} for j in range(STEPS)]
    g2, trace = hand_estimate(tiny_gpt2(), batches, lambda m, b: m(**b).loss)
    assert report.history[0][2] == pytest.approx(g2, rel=1e-4)
    assert report.history[0][3] == pytest.approx(trace, rel=1e-4)
    # and the per-micro-batch losses are the model's own
    first = tiny_gpt2()
    assert report.losses[0] == pytest.approx(first(**batches[0]).loss.item(), rel=1e-5)
    # training itself is unchanged
    plain = hf_train(tmp_path, None, max_grad_norm)
    for p, q in zip(trained.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_a_transformers_run_stopped_by_ctrl_c_leaves_no_second_hook_for_the_next(tmp_path):
    # The Trainer calls no callback when Ctrl-C stops it: the next train() must not add its
    # hooks beside the old ones (each loss was recorded twice, and a hook stayed for good).
    class Press(transformers.TrainerCallback):
        def __init__(self):
            self.substeps = 0

        def on_substep_end(self, args, state, control, **kwargs):
            self.substeps += 1
            if self.substeps == STEPS + 1:  # the second update's second micro-batch
                raise KeyboardInterrupt

    model = tiny_gpt2()
    callback = hf.NoiseCallback(bw.NoiseTracker(warmup_updates=1, overhead_target=None),
                                panel=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=STEPS, max_steps=UPDATES, report_to="none", use_cpu=True,
        max_grad_norm=0.01, save_strategy="no", dataloader_num_workers=0, seed=0)
    data = TokenData(MICRO * STEPS * UPDATES)
    with pytest.raises(KeyboardInterrupt):
        InOrder(model=model, args=args, train_dataset=data, callbacks=[callback, Press()]).train()
    seen = callback.tracker.report.n_losses_seen
    InOrder(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert not model._forward_hooks
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    # each of the second run's losses once, and the stopped update's two micro-batches' losses
    # (recorded then, counted with the next update)
    assert callback.tracker.report.n_losses_seen - seen == STEPS * UPDATES + 2


def test_transformers_callback_without_accumulation_says_it_cannot_measure(tmp_path):
    callback = hf.NoiseCallback(panel=False)
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=MICRO, max_steps=3,
        report_to="none", use_cpu=True, save_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=TokenData(12),
                         callbacks=[callback]).train()
    report = callback.tracker.report
    assert report.n_losses_seen == 3
    assert not report.measurable
    with pytest.raises(TypeError, match="tracker should be"):
        hf.NoiseCallback(tracker="tracker")


# ---- Lightning ----------------------------------------------------------------------------------

X = torch.randn(MICRO * STEPS * UPDATES + 2 * MICRO, 5, generator=torch.Generator().manual_seed(3))
Y = X @ torch.tensor([1.0, -2.0, 0.5, 0.0, 1.0]) + torch.randn(len(X), generator=torch.Generator()
                                                               .manual_seed(4))


def lightning_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


class Regression(lightning.pytorch.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = lightning_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def lightning_fit(callback, n_examples):
    module = Regression()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:n_examples],
                                                                        Y[:n_examples]),
                                         batch_size=MICRO)
    trainer = lightning.pytorch.Trainer(
        accumulate_grad_batches=STEPS, max_epochs=1, gradient_clip_val=0.05,
        callbacks=[callback] if callback is not None else [], accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(module, loader)
    return module


def test_lightning_callback_feeds_the_tracker_from_accumulate_grad_batches():
    callback = pl.NoiseCallback(
        bw.NoiseTracker(warmup_updates=1, overhead_target=None), panel=False)
    n_examples = MICRO * STEPS * UPDATES + 2 * MICRO  # the last update has 2 micro-batches
    trained = lightning_fit(callback, n_examples)
    report = callback.tracker.report
    assert report.n_losses_seen == STEPS * UPDATES + 2
    assert report.n_updates == UPDATES + 1
    assert (report.micro_batch_size, report.n_micro) == (MICRO, STEPS)
    assert len(report.data_stall_shares) == UPDATES + 1
    batches = [(X[j * MICRO:(j + 1) * MICRO], Y[j * MICRO:(j + 1) * MICRO]) for j in range(STEPS)]
    g2, trace = hand_estimate(lightning_net(), batches, lambda m, b: nn.functional.mse_loss(
        m(b[0]).squeeze(1), b[1]))
    assert report.history[0][2] == pytest.approx(g2, rel=1e-4)
    assert report.history[0][3] == pytest.approx(trace, rel=1e-4)
    assert report.losses[0] == pytest.approx(nn.functional.mse_loss(
        lightning_net()(batches[0][0]).squeeze(1), batches[0][1]).item(), rel=1e-5)
    plain = lightning_fit(None, n_examples)
    for p, q in zip(trained.parameters(), plain.parameters()):
        assert torch.equal(p, q)


class Indexed(lightning.pytorch.LightningModule):
    """Records the sample indices of every batch; at batch 2 switches the live loader the
    Trainer runs, as a panel's click would."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.seen = nn.Linear(4, 1), []

    def training_step(self, batch, index):
        x, ids = batch
        self.seen.append(ids.tolist())
        if index == 2:
            self.trainer.train_dataloader.set(num_workers=1)
        return self.net(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightnings_trainer_runs_a_live_loader_as_is_and_a_switch_lands_mid_epoch():
    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40))
    live = bw.live_loader(data, batch_size=8, shuffle=True,
                          generator=torch.Generator().manual_seed(0))
    module = Indexed()
    lightning.pytorch.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu").fit(module, live)
    plain = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                        generator=torch.Generator().manual_seed(0))
    assert module.seen == [batch[1].tolist() for _ in range(2) for batch in plain]
    (switch,) = live.report.switches
    assert (switch.epoch, switch.batch) == (0, 3)
    live.close()
