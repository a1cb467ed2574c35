"""What ``python -m batchwidgets plan`` plans: the model built on the meta device from a Hugging
Face config (a ``config.json``, or a config class with ``key=value`` overrides) or from a factory
``module:function``, its batches, and its optimizer. Nothing here runs a step: ``_plan_cli.py``
hands what it builds to ``find_batch(..., target=...)``.

A mistake is a ``FlagError``: one line naming the flag and the fix (the command line prints it
and exits with code 2).

Usage:
    >>> built = build(config=["LlamaConfig", "hidden_size=64", "num_hidden_layers=2",
    ...                       "num_attention_heads=4", "num_key_value_heads=2",
    ...                       "intermediate_size=128", "vocab_size=1000"])   # doctest: +SKIP
    >>> built.model.lm_head.weight.device                                    # doctest: +SKIP
    device(type='meta')
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .engine._util import first_line


class FlagError(ValueError):
    """A flag's value that cannot be planned: one line naming the flag and the fix."""


@dataclass(frozen=True)
class Built:
    """The model (on the meta device), ``make_batch`` and the optimizer the plan traces; what
    it is, in words, for the output's first lines."""

    model: torch.nn.Module
    make_batch: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    loss_fn: Callable | None
    described: str
    # make_batch(batch_size, seq_len), the frontier over --seq-len: always (a config's), where
    # --seq-len is given (None: a factory's own make_batch), never (False: synthetic batches)
    takes_seq_len: bool | None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adamw8bit", "adam8bit")


# -- the model --------------------------------------------------------------------------------

def _value(text: str) -> Any:
    """``key=value``'s value: JSON (numbers, true/false, null, lists), Python's True/False/None,
    else the text itself."""
    python = {"True": True, "False": False, "None": None}
    if text in python:
        return python[text]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _overrides(words: Sequence[str]) -> dict[str, Any]:
    found = {}
    for word in words:
        key, equals, text = word.partition("=")
        if not equals or not key:
            raise FlagError(f"--config should be followed by key=value overrides, but got "
                            f"{word!r}; write e.g. --config LlamaConfig hidden_size=4096.")
        found[key] = _value(text)
    return found


def load_config(words: Sequence[str]) -> Any:
    """The config of ``--config PATH|CLASS [key=value ...]``; never asks the Hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a path or a class: nothing to download
    try:
        import transformers
    except ImportError:
        raise FlagError("--config needs transformers; pip install transformers, or plan a "
                        "model of your own with --factory module:function.") from None
    first, overrides = words[0], _overrides(words[1:])
    path = Path(first)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FlagError(f"--config should be a config.json file, a folder holding one, or a "
                            f"transformers config class, but got {first!r}: no such file.")
        try:
            data = json.loads(path.read_text())
            kind_name = data.pop("model_type")
            kind = type(transformers.AutoConfig.for_model(kind_name))
        except (ValueError, KeyError) as error:
            raise FlagError(f"--config should be a Hugging Face config.json with a model_type, "
                            f"but {str(path)!r} is not one ({error}).") from None
        named = path.name
    else:
        kind, data = getattr(transformers, first, None), {}
        if not (isinstance(kind, type) and issubclass(kind, transformers.PretrainedConfig)):
            close = difflib.get_close_matches(first, [n for n in dir(transformers)
                                                      if n.endswith("Config")], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise FlagError(f"--config should be a config.json path or a transformers config "
                            f"class such as LlamaConfig, but got {first!r}; {hint}"
                            f"a path must exist.")
        named = first
    known = kind().to_dict()
    for key in overrides:
        if key not in known and not hasattr(kind(), key):
            close = difflib.get_close_matches(key, list(known), n=1)
            raise FlagError(f"--config {named} has no field {key!r}"
                            f"{f'; did you mean {close[0]}' if close else ''}; its fields are "
                            f"those of {kind.__name__}().to_dict().")
    # one constructor call: fields derived from others (head_dim from hidden_size and the
    # heads) follow the overrides, as they would not if set after it
    try:
        return kind(**{**data, **overrides})
    except Exception as error:  # a value of the wrong type or out of range, however it is said
        raise FlagError(f"--config {named} refuses its values: {_said(error)}; fix the "
                        f"key=value overrides (or the file).") from None


def _said(error: BaseException) -> str:
    """An error of transformers' in one line (a validation error says its cause on the next),
    without its trailing period."""
    said = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    said = said or type(error).__name__
    return (said if len(said) <= 240 else said[:239] + "…").rstrip(".")


_TOKEN_HEADS = ("ForCausalLM", "ForMaskedLM", "LMHeadModel", "ForConditionalGeneration")


def _model_class(config: Any) -> Any:
    """The class to build: the config's ``architectures[0]``, else a language-model head
    (masked for an encoder such as BERT, causal otherwise), else the bare model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for name in config.architectures or ():
        if isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    kind = config.model_type
    if kind in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", 0):
        return transformers.AutoModelForMaskedLM
    if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _token_batch(vocab: int, labels: str, classes: int, batch_size: int, seq_len: int) -> dict:
    """Token ids, and labels: the tokens again for a language model's head, a class each for a
    classifier; none for a bare model (its loss: the output's mean)."""
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    if labels == "tokens":
        return {"input_ids": ids, "labels": ids}
    if labels == "class":
        return {"input_ids": ids, "labels": torch.randint(0, classes, (batch_size,))}
    return {"input_ids": ids}


def from_config(words: Sequence[str]) -> tuple[torch.nn.Module, Callable, str]:
    config = load_config(words)
    cls = _model_class(config)
    try:
        with torch.device("meta"):
            model = (cls.from_config(config) if hasattr(cls, "from_config") and cls.__name__
                     .startswith("Auto") else cls(config))
    except (TypeError, ValueError, AssertionError) as error:  # values that do not go together
        raise FlagError(f"--config {words[0]}: {cls.__name__} cannot be built from these values: "
                        f"{_said(error)}; fix the key=value overrides (or the file).") from None
    name = type(model).__name__
    labels = ("tokens" if name.endswith(_TOKEN_HEADS) else "class"
              if name.endswith("ForSequenceClassification") else "")
    make_batch = functools.partial(_token_batch, config.vocab_size, labels,
                                   getattr(config, "num_labels", 2))
    return model, make_batch, name


def _import(spec: str) -> Callable:
    module_name, colon, function = spec.partition(":")
    if not colon or not module_name or not function:
        raise FlagError(f"--factory should be module:function (or path/to/file.py:function), "
                        f"but got {spec!r}.")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or not path.is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # the current folder, as python -m finds a module
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise FlagError(f"--factory {spec}: cannot import {module_name!r} ({error}); run from "
                        f"the folder that holds it, or give its path: path/to/file.py:"
                        f"{function}.") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise FlagError(f"--factory {spec}: {module_name} has no function {function!r}.")
    return found


def from_factory(spec: str) -> tuple[torch.nn.Module, Callable | None, Callable | None, str]:
    """``factory()`` called on the meta device: a model, ``(model, make_batch)`` or ``(model,
    make_batch, loss_fn)``."""
    factory = _import(spec)
    try:
        with torch.device("meta"):
            made = factory()
    except Exception as error:  # the factory's own: one line, as every flag's mistake
        raise FlagError(f"--factory {spec} raised {first_line(error)}; fix the "
                        f"factory (called with no arguments, under torch.device('meta'), so "
                        f"nothing is materialised).") from None
    parts = tuple(made) if isinstance(made, (tuple, list)) else (made,)
    if not isinstance(parts[0], torch.nn.Module) or len(parts) > 3:
        raise FlagError(f"--factory {spec} should return a torch.nn.Module, (model, make_batch) "
                        f"or (model, make_batch, loss_fn), but it returned "
                        f"{type(made).__name__}.")
    model, make_batch, loss_fn = (*parts, None, None)[:3]
    return model, make_batch, loss_fn, type(model).__name__


def _synthetic(shape: tuple[int, ...], classes: int | None) -> Callable:
    from .engine._batches import SyntheticBatches
    return SyntheticBatches(shape, classes)


# -- what trains, and how -----------------------------------------------------------------------

def _frozen_base(model: torch.nn.Module) -> None:
    base = getattr(model, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is model:
        raise FlagError("--frozen-base needs a model with a base model under its head (a "
                        "Hugging Face model); freeze the weights in your factory instead.")
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):  # the head trains, tied to the embedding or not
        for parameter in head.parameters():
            parameter.requires_grad_(True)


def _lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    try:
        import peft
    except ImportError:
        raise FlagError(f"--lora {rank} needs peft, which is not installed; pip install peft, "
                        f"or plan the frozen base alone with --frozen-base.") from None
    with torch.device("meta"):
        return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules="all-linear"))


def _checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise FlagError("--checkpointing needs a model with gradient_checkpointing_enable() (a "
                        "Hugging Face model); checkpoint in your factory instead.")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def optimizer_for(name: str, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer`` names, on the parameters that train."""
    if not parameters:
        raise FlagError("--frozen-base (or --lora) left no parameter that trains; plan the "
                        "whole model without it.")
    if name == "adamw":
        return torch.optim.AdamW(parameters)
    if name == "adam":
        return torch.optim.Adam(parameters)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
    if name == "adafactor":
        try:
            from transformers import Adafactor
        except ImportError:
            raise FlagError("--optimizer adafactor needs transformers (transformers.Adafactor); "
                            "pip install transformers.") from None
        return Adafactor(parameters, lr=1e-3, relative_step=False, scale_parameter=False)
    try:
        import bitsandbytes
    except ImportError:
        raise FlagError(f"--optimizer {name} needs bitsandbytes, which is not installed; pip "
                        f"install bitsandbytes, or use --optimizer adamw.") from None
    kind = bitsandbytes.optim.AdamW8bit if name == "adamw8bit" else bitsandbytes.optim.Adam8bit
    return kind(parameters)


def build(*, config: Sequence[str] | None = None, factory: str | None = None,
          input_shape: tuple[int, ...] | None = None, num_classes: int | None = None,
          dtype: str = "float32", optimizer: str = "adamw", checkpointing: bool = False,
          frozen_base: bool = False, lora: int | None = None) -> Built:
    """The model on the meta device, its batches, loss and optimizer, as the flags say."""
    if (config is None) == (factory is None):
        raise FlagError("give --config (a config.json, or a config class with key=value "
                        "overrides) or --factory module:function, one of the two.")
    loss_fn = None
    if config is not None:
        if input_shape is not None:
            raise FlagError("--input-shape goes with --factory; a --config model reads token "
                            "ids of --seq-len tokens.")
        model, make_batch, described = from_config(config)
        takes_seq_len = True
    else:
        model, make_batch, loss_fn, described = from_factory(factory)
        takes_seq_len = None
        if make_batch is None:
            if input_shape is None:
                raise FlagError(f"--factory {factory} returned a model alone: give "
                                f"--input-shape (e.g. 3,224,224) for synthetic batches, or "
                                f"return (model, make_batch) from it.")
            make_batch = _synthetic(input_shape, num_classes)
            if num_classes is not None and loss_fn is None:
                loss_fn = torch.nn.functional.cross_entropy
            takes_seq_len = False
    model = model.to(DTYPES[dtype]).train()
    if frozen_base:
        _frozen_base(model)
    if lora is not None:
        model = _lora(model, lora)
    if checkpointing:
        _checkpointing(model)
    trains = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in model.parameters())
    size = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
    described = f"{described}, {size} parameters ({dtype}) on the meta device"
    return Built(model, make_batch, optimizer_for(optimizer, trains), loss_fn, described,
                 takes_seq_len)
