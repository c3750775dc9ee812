"""Build a Hugging Face ``transformers`` model from a ``config.json`` with no download (optional extra).

Also the Hugging Face defaults of SPEC section 1 for any ``transformers`` model, however it was
built (``--hf-config`` or a model file that imports the class): keyword inputs named after the
model's ``main_input_name`` (``input_ids``, plus ``decoder_input_ids`` for encoder-decoders;
``pixel_values`` shaped from ``config.image_size``/``num_channels`` for vision models).

[Note: mixture-of-experts routing]
``transformers``' ``eager`` experts loop picks each expert's tokens with ``nonzero()``, a
data-dependent shape that fake tensors cannot trace. ``grouped_mm`` sorts the ``tokens * top_k``
routed rows by expert and runs one grouped matmul, so every tensor's shape (and so the memory)
is the same whatever the router decides. A ``--hf-config`` model that asks for ``eager`` is
planned with ``grouped_mm`` and the plan says so (``LoadedModel.notes``); a model file that
builds an ``eager`` MoE model gets a ``BadInput`` naming the switch.

[Note: training loss of Hugging Face heads]
A ``--hf-config`` model whose head computes a loss when given ``labels`` is fed them (SPEC 7),
so the step analysed, verified and benched is the one training runs: the model's own loss
(``ModelOutput.loss``, which ``load.default_loss`` takes first). The head is recognised by its
class in ``transformers``' auto mappings, and the labels follow what its loss reads:
- causal LM and masked LM: token ids shaped like ``input_ids`` (causal LMs shift them and
  compute cross-entropy with the logits upcast to float32: the peak around the loss grows
  with vocabulary x tokens);
- seq2seq LM: token ids shaped like ``decoder_input_ids``;
- sequence and image classification: one class id per sample (``num_labels`` classes), or
  float targets for ``regression`` (``num_labels == 1``) and ``multi_label_classification``.
Values are drawn at random: memory and time depend only on shapes (ignored positions,
-100, cost the same). A model file's ``example_inputs`` and ``loss_fn`` still decide.

[Note: packed-sequence detection on fake tensors]
Without an attention mask or a cache (a training step), ``transformers``' causal-mask builder
asks ``masking_utils.find_packed_sequence_indices`` whether the position ids hold several
packed sequences; on real tensors it reads them, finds one sequence and lets SDPA run causal
with no mask. A fake tensor counts as "tracing" there, so the check is skipped and a
``[batch, 1, seq, seq]`` mask is built and kept: planning and ``verify`` (fake tensors) held
memory that training does not (an HF Llama's DDP step at 2 x 256 measured 6.7% under its
prediction). While the planner traces, ``hf_masks_as_trained`` answers that check from how the
position ids were made: a view of one ``arange`` with step 1 (shifted by a number, as
``arange(n) + past_seen_tokens``) along its last dimension, which is what the model makes
itself when given none, is one sequence, as its values would say. Other fake
position ids go to transformers' own check (the mask is built, as it would be for packed data).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.reading import read_input_bytes

MAX_CONFIG_BYTES = 16 * 2**20
"""A model's config.json is a few kB (with its vocabulary maps, tens of kB)."""
STATIC_EXPERTS = "grouped_mm"

ROUTING_NOTE = (
    "mixture-of-experts routing: the config asks for the 'eager' experts loop, whose per-expert "
    "token selection (nonzero) has data-dependent shapes that cannot be traced without a GPU; "
    "planned with experts_implementation='grouped_mm' instead, where every token goes to its "
    "top-k experts and memory does not depend on how the router balances them. Train with "
    "experts_implementation='grouped_mm' (or expect eager's per-expert temporaries to differ).")


def _import_transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError as e:
        raise BadInput(f"{what} needs the optional Hugging Face extra, which is not installed: "
                       "pip install 'fsdp-plan[hf]' (installs transformers).") from e
    return transformers


def read_hf_config(config_path: str) -> dict[str, Any]:
    """The config file as a dict, checked to look like a ``transformers`` config."""
    if not os.path.exists(config_path):
        raise BadInput(f"Hugging Face config {config_path!r} does not exist; pass the path of a "
                       "model's config.json (nothing is downloaded).")
    if os.path.isdir(config_path):
        inside = os.path.join(config_path, "config.json")
        hint = f" (did you mean {inside!r}?)" if os.path.isfile(inside) else ""
        raise BadInput(f"Hugging Face config {config_path!r} is a folder; pass its config.json{hint}.")
    data = read_input_bytes(config_path, f"Hugging Face config {config_path!r}",
                            MAX_CONFIG_BYTES, hint="Pass the path of a model's config.json.",
                            too_large="a model's config.json is a few kB")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadInput(f"Hugging Face config {config_path!r} cannot be read: {e}.") from e
    except json.JSONDecodeError as e:
        raise BadInput(f"Hugging Face config {config_path!r} is not valid JSON: {e.msg} at line "
                       f"{e.lineno} column {e.colno}.") from e
    except ValueError as e:  # an integer past Python's int-from-text limit (4,300 digits)
        raise BadInput(f"Hugging Face config {config_path!r} holds a number too long to read "
                       f"({str(e).split(';')[0]}); a config's sizes are a few digits long. Fix "
                       "the value.") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise BadInput(f"Hugging Face config {config_path!r} has no 'model_type' string; it must "
                       "be a transformers config.json (as saved by config.save_pretrained).")
    if raw.get("auto_map"):
        raise BadInput(f"Hugging Face config {config_path!r} needs custom model code (auto_map), "
                       "which fsdp-plan never downloads or runs from a config; write a model file "
                       "that imports the class and defines build_model(**kwargs) instead.")
    return raw


def hf_factory(config_path: str) -> Callable[..., nn.Module]:
    """A factory that builds the config's architecture (``architectures[0]``) from the config alone.

    Keyword arguments override config fields (``--model-arg num_hidden_layers=4``). The factory
    records what it assumed in its ``fsdp_plan_notes`` attribute (see [Note: mixture-of-experts routing]).
    """
    raw = read_hf_config(config_path)
    transformers = _import_transformers("--hf-config")
    notes: list[str] = []

    def build(**overrides: Any) -> nn.Module:
        fields = {**raw, **overrides}
        model_type = fields.pop("model_type")
        archs = fields.get("architectures") or []
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as e:
            raise BadInput(f"transformers {transformers.__version__} does not know model_type "
                           f"{model_type!r} from {config_path!r}: {e} Upgrade transformers or "
                           "check the config.") from e
        arch = archs[0] if archs else None
        if arch is not None:
            cls = getattr(transformers, str(arch), None)
            if cls is None or not hasattr(cls, "config_class"):
                raise BadInput(f"Hugging Face config {config_path!r} names architecture {arch!r}, "
                               f"which transformers {transformers.__version__} does not provide; "
                               "fix 'architectures' or write a model file that builds it.")
            # Built as the class's constructor builds it: float32 parameters, whatever the
            # config's torch_dtype says (mixed precision is the plan's --param-dtype).
            model = cls(config)
        else:
            auto = (transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False)
                    else transformers.AutoModelForCausalLM)
            try:
                model = auto.from_config(config)
            except ValueError:
                model = transformers.AutoModel.from_config(config)
        notes.clear()
        if use_static_experts(model):
            notes.append(ROUTING_NOTE)
        return model

    build.fsdp_plan_notes = notes  # type: ignore[attr-defined]
    return build


def use_static_experts(model: nn.Module) -> bool:
    """Switch an ``eager`` mixture-of-experts model to ``grouped_mm``; True when it switched."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager":
        return False
    can_set = getattr(model, "_can_set_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if not callable(can_set) or not callable(setter) or not can_set():
        return False
    setter(STATIC_EXPERTS)
    return True


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` ``PreTrainedModel`` (checked without importing transformers)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return base is not None and isinstance(model, base)


def _learned_position_limit(model: nn.Module, config: Any) -> int | None:
    """The longest sequence a model with a learned position table takes (GPT-2, BERT), else None.

    Rotary and relative positions (Llama, T5) have no hard limit, so only a real
    ``nn.Embedding`` with ``max_position_embeddings`` rows counts.
    """
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    vocab = getattr(config, "vocab_size", None)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings == limit and limit != vocab:
            return limit
    return None


def _vocab_size(model: nn.Module, config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes keyword ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


_HEADS = (  # (head kind, transformers' auto mapping of the classes with that head)
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("masked", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)


def loss_head(model: nn.Module) -> str | None:
    """``seq2seq``, ``causal``, ``masked`` or ``classification`` when ``model``'s head computes
    a loss from ``labels`` ([Note: training loss of Hugging Face heads]), else None."""
    if not _accepts(model, "labels"):
        return None
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # pragma: no cover - transformers without the auto module
        return None
    name = type(model).__name__
    for kind, mapping in _HEADS:
        for value in getattr(modeling_auto, mapping, {}).values():
            if name == value or (isinstance(value, (tuple, list)) and name in value):
                return kind
    return None


def _class_labels(config: Any) -> Callable[[int], torch.Tensor]:
    """Classification labels for a batch, as the head's ``problem_type`` reads them."""
    num_labels = int(getattr(config, "num_labels", 2) or 2)
    problem = getattr(config, "problem_type", None)
    if problem == "multi_label_classification":
        return lambda batch: torch.rand(batch, num_labels)
    if problem == "regression" or num_labels == 1:
        return lambda batch: torch.randn(batch) if num_labels == 1 else torch.randn(batch,
                                                                                  num_labels)
    return lambda batch: torch.randint(0, num_labels, (batch,))


def hf_default_inputs(model: nn.Module, where: str, *, labels: bool = False
                      ) -> Callable[[int, int], tuple[tuple, dict]]:
    """``make_inputs(batch_size, seq_len)`` for a ``transformers`` model, as keyword inputs;
    with ``labels`` (``--hf-config``) a head that computes a loss also gets its ``labels``."""
    config = model.config
    head = loss_head(model) if labels else None
    name = getattr(model, "main_input_name", "input_ids")
    cls = type(model).__name__
    if name == "pixel_values":
        size = getattr(config, "image_size", None)
        channels = getattr(config, "num_channels", None)
        if isinstance(size, int):
            height = width = size
        elif isinstance(size, (list, tuple)) and len(size) == 2:
            height, width = (int(s) for s in size)
        else:
            height = width = None
        if not isinstance(channels, int) or height is None:
            raise BadInput(f"{cls} from {where!r} takes pixel_values but its config has no "
                           "image_size/num_channels to shape them; write a model file with "
                           "example_inputs(batch_size, seq_len) returning {'pixel_values': ...}.")

        classes = _class_labels(config) if head == "classification" else None

        def make_pixels(batch_size: int, seq_len: int) -> tuple[tuple, dict]:
            del seq_len  # an image's size comes from the config, not --seq-len
            kwargs = {"pixel_values": torch.randn(batch_size, channels, height, width)}
            if classes is not None:
                kwargs["labels"] = classes(batch_size)
            return (), kwargs
        return make_pixels
    if name != "input_ids":
        raise BadInput(f"{cls} from {where!r} takes {name!r} as its main input; fsdp-plan makes "
                       "default inputs only for token ids (input_ids) and images (pixel_values). "
                       "Write a model file that builds it and defines example_inputs(batch_size, "
                       f"seq_len) returning {{{name!r}: tensor}}.")
    vocab = _vocab_size(model, config)
    if not vocab:
        raise BadInput(f"{cls} from {where!r} has no vocab_size to draw token ids from; define "
                       "example_inputs(batch_size, seq_len) in a model file.")
    limit = _learned_position_limit(model, config)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    classes = _class_labels(config) if head == "classification" else None
    # A training step keeps no KV cache; with one, a checkpointed block saves a different
    # number of tensors when it is recomputed (the cache has grown) and checkpointing fails.
    no_cache = {"use_cache": False} if _accepts(model, "use_cache") else {}

    def make_tokens(batch_size: int, seq_len: int) -> tuple[tuple, dict]:
        if limit is not None and seq_len > limit:
            raise BadInput(f"{cls} from {where!r} has learned positions for at most {limit} "
                           f"tokens, so --seq-len {seq_len} cannot run; pass --seq-len {limit} "
                           "or less (or raise max_position_embeddings with --model-arg).")
        kwargs = {"input_ids": torch.randint(0, vocab, (batch_size, seq_len))}
        if encoder_decoder:
            # Teacher forcing: the decoder reads a sequence as long as the encoder's.
            kwargs["decoder_input_ids"] = torch.randint(0, vocab, (batch_size, seq_len))
        if head in ("seq2seq", "causal", "masked"):
            kwargs["labels"] = torch.randint(0, vocab, (batch_size, seq_len))
        elif classes is not None:
            kwargs["labels"] = classes(batch_size)
        return (), {**kwargs, **no_cache}
    return make_tokens


_SHIFTS = ("add", "sub")


class _Aranges:
    """Records the storages of 1-D runs of consecutive integers as they are made (a dispatch
    mode, entered around the traced step): ``aten.arange`` with step 1, and such a run shifted
    by a number (``arange(n) + past_seen_tokens``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.storages: dict[int, Any] = {}
        outer = self

        class Mode(TorchDispatchMode):
            # as transformer_masks.MaskOrigins: compiled blocks (verify --compile) run under
            # it, their higher-order ops passing through unchanged
            supports_higher_order_operators = True

            @classmethod
            def ignore_compile_internals(cls) -> bool:
                return True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if not isinstance(out, torch.Tensor) or out.dim() != 1:
                    return out
                packet = getattr(func, "_overloadpacket", None)  # None: a higher-order op
                name = packet.__name__ if packet is not None else ""
                made = name == "arange" and kwargs.get("step", args[2] if len(args) > 2 else 1) == 1
                shifted = name in _SHIFTS and len(args) >= 2 and outer.run(args[0]) and (
                    isinstance(args[1], (int, float))
                    or isinstance(args[1], torch.Tensor) and args[1].dim() == 0)
                if made or shifted:
                    outer.remember(out)
                return out
        self.mode = Mode()

    def remember(self, tensor: torch.Tensor) -> None:
        import weakref
        storage = tensor.untyped_storage()
        key = id(storage)
        self.storages[key] = weakref.ref(storage, lambda _r, k=key: self.storages.pop(k, None))

    def run(self, value: Any) -> bool:
        """Whether ``value`` is a whole recorded run (1-D, contiguous)."""
        return (isinstance(value, torch.Tensor) and value.dim() == 1 and value.stride(0) == 1
                and self.consecutive(value))

    def consecutive(self, tensor: torch.Tensor) -> bool:
        """Whether every row of ``tensor`` reads consecutive values of one recorded run."""
        ref = self.storages.get(id(tensor.untyped_storage()))
        return (ref is not None and ref() is not None and tensor.dim() >= 1
                and tensor.stride(-1) == 1)


@contextlib.contextmanager
def hf_masks_as_trained() -> Iterator[None]:
    """Within the block, ``transformers``' packed-sequence check decides fake position ids
    from how they were made ([Note: packed-sequence detection on fake tensors]). Nothing
    happens when ``transformers`` was not imported (no Hugging Face model is traced)."""
    from torch._subclasses.fake_tensor import FakeTensor

    masking = sys.modules.get("transformers.masking_utils")
    check = getattr(masking, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    aranges = _Aranges()

    def find(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(position_ids, FakeTensor) and aranges.consecutive(position_ids):
            return None  # one sequence: what reading the values would find
        return check(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = find
    try:
        with aranges.mode:
            yield
    finally:
        masking.find_packed_sequence_indices = check
