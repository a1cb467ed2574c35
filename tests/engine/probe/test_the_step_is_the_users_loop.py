"""Issue 38: find_batch's step is the user's loop. The default step keeps the model's output and
loss as a loop's variables do (the answer runs in that loop, written as step(batch_size) and
probed under the same budget); a user's error says what find_batch called, at which batch size,
on fake or real tensors, with the user's error as its cause; what was assumed is said."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchwidgets as bw

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

KIB = 2**10
VOCAB, TOKENS = 1000, 32  # logits of 128 KB a sample: the step's largest tensor, as in an LM


def lm() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=16,
                                     n_layer=1, n_head=2)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config)


def tokens(batch_size: int) -> dict:
    ids = torch.randint(0, VOCAB, (batch_size, TOKENS),
                        generator=torch.Generator().manual_seed(batch_size))
    return {"input_ids": ids, "labels": ids}


def pairs(batch_size: int) -> tuple:
    ids = tokens(batch_size)["input_ids"]
    return ids, ids


def token_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


class Loop:
    """A training loop written as step(batch_size): each call runs one iteration of
    ``body(batch_size)``, a generator whose frame holds the loop's variables as a loop does
    (its output until the next forward has returned); a new size starts a new loop."""

    def __init__(self, body) -> None:
        self.body, self.running = body, None

    def __call__(self, batch_size: int) -> None:
        if self.running is None or self.running[0] != batch_size:
            self.running = None  # the last loop ends before the next begins
            self.running = (batch_size, self.body(batch_size))
        next(self.running[1])


def hugging_face_manual_loop(model, optimizer):
    """The loop of Hugging Face's "Training in native PyTorch" guide."""
    def body(batch_size):
        while True:
            batch = None  # `for batch in loader` rebinds it to the next one on the host first
            batch = tokens(batch_size)
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            yield
    return body


def plain_loop(model, optimizer):
    """out = model(x); loss = loss_fn(out, y); ..."""
    def body(batch_size):
        while True:
            x = y = None  # as a loader's loop: see hugging_face_manual_loop
            x, y = pairs(batch_size)
            out = model(x)
            loss = token_loss(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            yield
    return body


def logging_and_clipping_loop(model, optimizer):
    """The plain loop that logs loss.item() and clips the gradients' norm."""
    def body(batch_size):
        history = []
        while True:
            x = y = None  # as a loader's loop: see hugging_face_manual_loop
            x, y = pairs(batch_size)
            out = model(x)
            loss = token_loss(out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            history.append(loss.item())
            yield
    return body


LOOPS = {"Hugging Face manual loop": (hugging_face_manual_loop, tokens, None),
         "out = model(x) loop": (plain_loop, pairs, token_loss),
         "loss.item() and clip_grad_norm_": (logging_and_clipping_loop, pairs, token_loss)}
BUDGET = 3 * 1024 * KIB


@pytest.mark.parametrize("name", LOOPS)
def test_the_default_answer_runs_in_the_users_loop_under_the_same_budget(name):
    body, make, loss_fn = LOOPS[name]
    model = lm()
    optimizer = torch.optim.AdamW(model.parameters())
    in_the_loop = bw.find_batch(model, step=Loop(body(model, optimizer)), optimizer=optimizer,
                                budget=BUDGET).max_batch_size
    default = bw.find_batch(model, make, loss_fn=loss_fn, optimizer=optimizer, budget=BUDGET)
    assert default.max_batch_size == in_the_loop  # the loop the step models, exactly
    dropped = bw.find_batch(model, make, loss_fn=loss_fn, optimizer=optimizer, budget=BUDGET,
                            keep_output=False)
    assert dropped.max_batch_size > in_the_loop  # the step of old: runs out in the loop
    assert (default.loop, dropped.loop) == ("keeps output", "frees output")
    # the report predicts the other loop's answer, and says which loop it modelled
    assert default.other_loop.max_batch_size == dropped.max_batch_size
    assert (f"the loop keeps the output and loss until the next forward; keep_output=False: "
            f"{dropped.max_batch_size}") in default.summary()
    assert "keep_output=True" in dict(default.rows())["loop"]


def test_a_plan_for_a_gpu_that_is_not_here_models_the_same_loop():
    model = lm()
    optimizer = torch.optim.AdamW(model.parameters())
    kept = bw.find_batch(model, tokens, optimizer=optimizer, target="CPU", budget=BUDGET)
    freed = bw.find_batch(model, tokens, optimizer=optimizer, target="CPU", budget=BUDGET,
                          keep_output=False)
    local = bw.find_batch(model, tokens, optimizer=optimizer, budget=BUDGET)
    assert kept.trace == "fake"
    assert kept.max_batch_size < freed.max_batch_size
    assert kept.max_batch_size == local.max_batch_size  # the CPU processes' plan: the meter's
    frontier = bw.find_batch(model, lambda n, length: tokens(n), optimizer=optimizer,
                             budget=BUDGET, seq_len=[TOKENS])
    assert frontier.frontier == {TOKENS: local.max_batch_size}


def test_the_kept_output_is_never_below_the_dropped_output_loops_peak():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: one step a trial before

    def make(n):
        return torch.randn(n, 64), torch.randint(0, 512, (n,))

    kept = bw.find_batch(model, make, loss_fn=F.cross_entropy, optimizer=optimizer,
                         budget=2048 * KIB)
    freed = bw.find_batch(model, make, loss_fn=F.cross_entropy, optimizer=optimizer,
                          budget=2048 * KIB, keep_output=False)
    assert kept.max_batch_size < freed.max_batch_size
    for size in (1, 2, 16, kept.max_batch_size, freed.max_batch_size):  # the per-op models
        assert kept.predict_peak_bytes(size) > freed.predict_peak_bytes(size)


# -- what was assumed ----------------------------------------------------------------------------

def test_the_summary_says_the_optimizer_dtype_device_and_loss_it_assumed():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8)
    assumed = bw.find_batch(model, x, budget=64 * KIB)
    assert assumed.assumed == ("optimizer AdamW (pass optimizer=)",
                               "float32 without autocast (amp=)",
                               "device cpu (the model's)",
                               "loss the mean of the output (loss_fn=)")
    assert "assumed optimizer AdamW (pass optimizer=), float32 without autocast" in \
        assumed.summary()
    assert dict(assumed.rows())["assumed"].startswith("optimizer AdamW")
    given = bw.find_batch(model, lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,))),
                          loss_fn=F.cross_entropy, device="cpu",
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=64 * KIB)
    assert given.assumed == ("float32 without autocast (amp=)",)
    assert "AdamW" not in given.summary()


# -- the user's errors, said in our words ----------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def vectors(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def raised(call) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 (each test checks the type)
        call()
    return info.value


def assert_said(error: BaseException, line: str, user_type: type, user_message: str,
                who: str = "find_batch") -> None:
    assert isinstance(error, user_type)  # code that catches the user's type still does
    assert str(error).splitlines()[0] == line
    assert isinstance(error.__cause__, user_type)
    assert user_message in str(error.__cause__)
    files = [frame.filename for frame in traceback.extract_tb(error.__cause__.__traceback__)]
    assert not [f for f in files if f"{'batchwidgets'}/engine" in f or "_python_dispatch" in f
                or "fake_tensor" in f], files  # no frames of our dispatch modes
    ours = [frame.name for frame in traceback.extract_tb(error.__traceback__)
            if "batchwidgets" in frame.filename]
    assert ours == [who]  # raised from the public function, its search's frames left out


def test_a_loss_that_is_not_a_scalar_says_so_and_how_to_reduce_it():
    model = mlp()
    error = raised(lambda: bw.find_batch(
        model, vectors, loss_fn=nn.CrossEntropyLoss(reduction="none"),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=64 * KIB))
    assert_said(error, "find_batch called loss.backward() on float32[2] from loss_fn at batch "
                       "size 2 (real tensors), and it raised RuntimeError: grad can be "
                       "implicitly created only for scalar outputs; loss_fn should return one "
                       "number, but it returned float32[2]: reduce it (e.g. reduction='mean', "
                       "or loss.mean())", RuntimeError, "only for scalar outputs")


def test_a_three_tuple_batch_says_its_last_element_was_the_target():
    model = mlp()

    def with_index(n):
        x, y = vectors(n)
        return x, y, torch.arange(n)

    error = raised(lambda: bw.find_batch(model, with_index, loss_fn=F.cross_entropy,
                                         budget=64 * KIB))
    assert_said(error, "find_batch called model(batch[0], batch[1]) with float32[2, 16], "
                       "int64[2] at batch size 2 (real tensors), and it raised TypeError: "
                       "Sequential.forward() takes 2 positional arguments but 3 were given; the "
                       "batch is a 3-tuple: all but its last element go to the model and the "
                       "last is the target (loss_fn(output, batch[-1])); make the batch "
                       "(inputs, target), or a dict fed as model(**batch)", TypeError,
                "positional arguments")


class Cached(nn.Module):
    """A model whose second positional argument is a cache, as a language model's is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x, cache=None):
        return self.linear(x) if cache is None else cache.update(self.linear(x))


def test_a_three_tuple_batch_says_so_whatever_the_error_of_its_middle_element():
    def with_mask(n):
        x, y = vectors(n)
        return x, torch.ones(n), y

    error = raised(lambda: bw.find_batch(Cached(), with_mask, loss_fn=F.cross_entropy,
                                         budget=64 * KIB))
    assert isinstance(error, AttributeError)
    assert "the batch is a 3-tuple" in str(error).splitlines()[0]


def test_a_wrong_input_shape_says_the_shape_given_on_fake_tensors_for_a_meta_model():
    with torch.device("meta"):
        model = mlp()

    def narrow(n):
        return torch.randn(n, 8), torch.randint(0, 4, (n,))

    error = raised(lambda: bw.find_batch(model, narrow, loss_fn=F.cross_entropy, target="T4"))
    assert_said(error, "find_batch called model(batch[0]) with float32[2, 8] at batch size 2 "
                       "(fake tensors: shapes only, nothing computed), and it raised "
                       "RuntimeError: a and b must have same reduction dim, but got [2, 8] X "
                       "[16, 8].", RuntimeError, "same reduction dim")


def test_a_float64_model_given_float32_batches_says_to_give_them_one_dtype():
    model = mlp().double()
    error = raised(lambda: bw.find_batch(model, vectors, loss_fn=F.cross_entropy,
                                         budget=64 * KIB))
    assert str(error).splitlines()[0].endswith(
        "the batch is float32 and the model's weights float64: give them one dtype (the "
        "batch's tensors .to(torch.float64), or model.to(torch.float32))")
    first = str(error).splitlines()[0]
    size = first.split("at batch size ")[1].split()[0]  # the fake search does not see dtypes
    assert first.startswith(f"find_batch called model(batch[0]) with float32[{size}, 16] at "
                            f"batch size {size} (real tensors), and it raised RuntimeError: ")
    assert isinstance(error, RuntimeError)
    assert isinstance(error.__cause__, RuntimeError)


class TwoFieldError(Exception):
    """A user's exception that cannot be rebuilt from one message."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code


def test_an_exception_of_several_arguments_is_still_of_the_users_type_and_keeps_its_data():
    class Picky(nn.Module):
        def forward(self, x):
            raise TwoFieldError(7, "picky")

    error = raised(lambda: bw.find_batch(Picky(), vectors, loss_fn=F.cross_entropy,
                                         optimizer=torch.optim.SGD([nn.Parameter(
                                             torch.zeros(1))]), budget=64 * KIB))
    assert isinstance(error, TwoFieldError)
    assert error.code == 7
    assert str(error).startswith("find_batch called model(batch[0]) with float32[2, 16] at "
                                 "batch size 2 (real tensors), and it raised TwoFieldError: ")
    assert type(error.__cause__) is TwoFieldError


def test_measure_noise_and_critical_batch_say_what_they_called():
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    model = mlp()

    def broken(output, target):
        raise ValueError("the user's loss")

    for who, call in (
            ("measure_noise", lambda: bw.measure_noise(model, data, broken, method="loop")),
            ("critical_batch", lambda: bw.critical_batch(
                model, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                loss_fn=broken, noise=False))):
        error = raised(call)
        size = 1 if who == "measure_noise" else 64  # one example; the evaluation's batch
        assert_said(error, f"{who} called loss_fn(output, target) (broken) with output "
                           f"float32[{size}, 4], target int64[{size}] at batch size {size} (real "
                           f"tensors), and it raised ValueError: the user's loss", ValueError,
                    "the user's loss", who=who)
