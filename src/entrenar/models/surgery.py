"""Find linear layers by name and swap modules in place.

This is the one module-replacement mechanism shared by LoRA, NF4 and QAT: the
model itself knows nothing of them. Name matching follows PEFT's
``target_modules`` so that adapter configs mean the same thing here and there:

* a list of names: a module matches if its full name equals an entry or ends
  with ``"." + entry`` (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``);
* a string: a regular expression that must match the full name;
* ``"all-linear"``: every linear layer except the output head.

A module counts as a linear layer if it is an ``nn.Linear`` or its class sets
``linear_like = True`` (quantized and fake-quant linears that do not subclass
``nn.Linear``, and adapter wrappers). Linear layers are leaves: the search does
not descend into them, so a wrapper's inner layers are never targets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from torch import nn

from entrenar.errors import AdapterError, ModelError

ALL_LINEAR = "all-linear"
OUTPUT_HEAD_NAME = "lm_head"
CLASSIFIER_HEAD_NAME = "score"  # trained whole (PEFT's modules_to_save), never adapted

Patterns = str | Sequence[str]


def is_linear(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and for modules whose class declares ``linear_like = True``."""
    return isinstance(module, nn.Linear) or getattr(type(module), "linear_like", False) is True


def named_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for every linear layer, in module order, without entering them."""

    def walk(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if is_linear(child):
                yield name, child
            else:
                yield from walk(name, child)

    seen: set[int] = set()
    for name, module in walk("", model):
        if id(module) not in seen:  # a module registered twice is one layer
            seen.add(id(module))
            yield name, module


def _output_head_names(model: nn.Module, linears: dict[str, nn.Module]) -> set[str]:
    """Names of the output head: ``lm_head`` (``score`` on a classifier) and whatever HF's
    ``get_output_embeddings()`` returns."""
    heads = {name for name in linears if name.rsplit(".", 1)[-1] in (OUTPUT_HEAD_NAME, CLASSIFIER_HEAD_NAME)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None:
        heads |= {name for name, module in linears.items() if module is head}
    return heads


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise AdapterError(f"target_modules {pattern!r} is not a valid regular expression: {err}") from None


def _sample(names: Sequence[str], k: int = 6) -> str:
    shown = ", ".join(names[:k])
    more = f", ... ({len(names)} in all)" if len(names) > k else ""
    return shown + more if names else "(none)"


def find_linears(model: nn.Module, patterns: Patterns, *, strict: bool = True) -> list[str]:
    """Names of the linear layers that ``patterns`` select, in module order.

    With ``strict`` (the default) every entry of a pattern list must match some
    linear layer, so a typo such as ``"v_prj"`` is an error rather than a
    silently smaller adapter; without it only the whole list must match
    something (PEFT's rule, used when loading adapters others made).
    A pattern that matches a module which is not a linear layer is an error.
    """
    linears = dict(named_linears(model))
    linear_names = list(linears)

    if isinstance(patterns, str) and patterns.lower() == ALL_LINEAR:
        heads = _output_head_names(model, linears)
        found = [name for name in linear_names if name not in heads]
        if not found:
            raise AdapterError(
                f"target_modules 'all-linear' found no linear layer besides the output head in {type(model).__name__}"
            )
        return found

    all_names = [name for name, _ in model.named_modules() if name]
    if isinstance(patterns, str):
        regex = _compile(patterns)
        hits = [name for name in all_names if regex.fullmatch(name)]
    else:
        patterns = list(patterns)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise AdapterError(
                f"target_modules must be 'all-linear', a regex string or a non-empty list of names, got {patterns!r}"
            )
        hits = [name for name in all_names if any(_matches(name, p) for p in patterns)]

    not_linear = [name for name in hits if name not in linears and not _inside_linear(name, linears)]
    if not_linear:
        module = model.get_submodule(not_linear[0])
        raise AdapterError(
            f"target_modules {patterns!r} match {not_linear[0]!r}, a {type(module).__name__} and not a linear layer; "
            f"the model's linear layers include: {_sample(linear_names)}"
        )
    hit_set = set(hits)
    found = [name for name in linear_names if name in hit_set]
    if not found:
        raise AdapterError(
            f"target_modules {patterns!r} match no linear layer of {type(model).__name__}; "
            f"its linear layers include: {_sample(linear_names)}"
        )
    if strict and not isinstance(patterns, str):
        unmatched = [p for p in patterns if not any(_matches(name, p) for name in found)]
        if unmatched:
            raise AdapterError(
                f"target_modules {unmatched!r} (of {patterns!r}) match no linear layer; "
                f"the model's linear layers include: {_sample(linear_names)}"
            )
    return found


def _inside_linear(name: str, linears: dict[str, nn.Module]) -> bool:
    """True if ``name`` is a submodule of a linear layer (e.g. a LoRA wrapper's ``base_layer``)."""
    return any(name.startswith(linear + ".") for linear in linears)


def replace_module(model: nn.Module, name: str, new_module: nn.Module) -> nn.Module:
    """Put ``new_module`` where the submodule ``name`` is and return the module it replaced."""
    if not name:
        raise ModelError("replace_module needs a submodule name; the root module cannot be replaced in place")
    parent_name, _, child_name = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        raise ModelError(f"{type(model).__name__} has no module {parent_name!r} (while replacing {name!r})") from None
    old = parent._modules.get(child_name)
    if old is None:
        raise ModelError(f"{type(model).__name__} has no module {name!r} to replace")
    parent._modules[child_name] = new_module
    return old
