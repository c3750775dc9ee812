"""Load the user's model per SPEC section 1: build it on ``meta``, make its inputs, turn output into a loss.

A ``ModelSource`` names where the model comes from (a file, ``package.module:attr`` or a
Hugging Face config) with its keyword arguments and input shape; it is what the plan file
records, so ``verify`` and ``bench`` rebuild exactly the model that was planned.
Every failure becomes a ``BadInput`` whose message names the problem and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_plan.common.errors import BadInput, Stop
from fsdp_plan.common.files import current_umask
from fsdp_plan.common.reading import check_regular_file
from fsdp_plan.model.hf import hf_default_inputs, hf_factory, is_hf_model
from fsdp_plan.model.source import (  # noqa: F401  (re-exported: callers import these from load)
    ModelSource,
    parse_model_args,
    source_digest,
    source_kind,
)
from fsdp_plan.model.user_process import UserExit, process_guarded


@dataclass
class LoadedModel:
    """A model built on ``meta`` plus the user's input and loss hooks."""

    source: ModelSource
    model: nn.Module
    make_inputs: Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
    compute_loss: Callable[[Any], torch.Tensor]
    factory: Callable[..., nn.Module]
    notes: list[str] = field(default_factory=list)
    """Assumptions the planner made to build or trace the model (stated in the report and plan)."""


# [Note: calling user code]
# Every call into the user's code (importing the model file or the factory's module,
# build_model, example_inputs, loss_fn, and the model's forward during analysis) runs inside
# ``user_code_output_to_stderr``: its print() output goes to stderr, so ``--format json``
# keeps stdout a single JSON document, and a sys.exit() in it becomes a BadInput naming the
# call and the line instead of ending the planner with the user's exit code and nothing said.
# os._exit() and os.fork() are guarded too (model/user_process.py [Note: user code and
# the process]).
# KeyboardInterrupt is left alone: Ctrl-C still stops the planner (exit 130), and so are
# fsdp-plan's own ``Stop``s (a stopping signal). Any other BaseException raised there
# (GeneratorExit, a model's ``class Boom(BaseException)``) is the model's: nothing that calls
# a model expects it, so it becomes a BadInput naming the call and the line (issue 31, S4-07).
# An os.chdir() in user code is undone, so relative output paths still name the files that
# were checked, and so is an os.umask() (outputs keep the modes the user's shell gives).

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@contextlib.contextmanager
def user_code_output_to_stderr(what: str = "the model's forward",
                               path: str | None = None) -> Iterator[None]:
    """Run user code with ``sys.stdout`` sent to ``sys.stderr`` and ``sys.exit()`` refused.

    ``what`` names the call for the message (``build_model(size='tiny')``); ``path`` is the
    user's file, whose innermost line the message shows."""
    cwd = _getcwd()
    umask = current_umask()
    try:
        with process_guarded(), contextlib.redirect_stdout(sys.stderr):
            yield
    except SystemExit as e:
        raise BadInput(f"{what} called sys.exit({e.code!r}){_user_frame_hint(e, path)}; the "
                       "planner runs this code to read the model's shapes and cannot go on. Remove "
                       "the exit (guard script code with `if __name__ == \"__main__\":`).") from e
    except UserExit as e:  # [Note: user code and the process]
        raise BadInput(f"{what} called os._exit({e.code!r}){_user_frame_hint(e, path)}, which "
                       "would end fsdp-plan at once with nothing planned or checked; the planner "
                       "runs this code to read the model's shapes. Remove the exit (guard script "
                       "code with `if __name__ == \"__main__\":`).") from e
    except (Exception, KeyboardInterrupt, Stop):  # errors have their callers; Ctrl-C stops
        raise
    except BaseException as e:  # GeneratorExit, or the model's own BaseException subclass
        raise base_exception_refusal(what, e, _user_frame_hint(e, path)) from e
    finally:
        # An os.chdir() in user code would move relative output paths after they were checked.
        if cwd is not None and _getcwd() != cwd:
            os.chdir(cwd)
        # An os.umask() in user code would change the modes of the outputs and folders made.
        if current_umask() != umask:
            os.umask(umask)


def base_exception_refusal(what: str, error: BaseException, at: str) -> BadInput:
    """The ``BadInput`` for a ``BaseException`` that is neither Ctrl-C, an exit nor
    fsdp-plan's own ``Stop``, raised by ``what`` (the user's code) at ``at`` ([Note: calling
    user code])."""
    return BadInput(f"{what} raised {_exception_text(error)}{at}. It derives from "
                    "BaseException, not Exception, which Python keeps for leaving a program "
                    "(SystemExit, KeyboardInterrupt, GeneratorExit), so nothing that calls the "
                    "model expects it; the planner stopped with nothing written. Raise an "
                    "Exception subclass in the model's code.")


def _exception_text(error: BaseException) -> str:
    """``Boom: it broke`` (or ``Boom``) on one line, cut to a readable length."""
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _getcwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working folder was removed
        return None


def _user_frames(error: BaseException, path: str | None) -> list[traceback.FrameSummary]:
    """Traceback frames of ``error`` in the user's code: in ``path`` if given, else outside
    fsdp-plan and torch; all frames when none qualify."""
    frames = traceback.extract_tb(error.__traceback__)
    if path:
        real = os.path.realpath(path)
        mine = [f for f in frames if os.path.realpath(f.filename) == real]
    else:
        mine = [f for f in frames if not os.path.abspath(f.filename).startswith(
            (_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)) and not f.filename.startswith("<")]
    return mine or frames


def _show_path(filename: str) -> str:
    """A frame's file as the user would type it: relative to the working folder when inside it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith(os.pardir) else rel


def _user_frame_hint(error: BaseException, path: str | None) -> str:
    """`` (at model.py line 12: 'x = y.item()')``: the innermost line of the user's code where
    ``error`` came from, for a one-paragraph message."""
    if isinstance(error, SyntaxError):
        line = (error.text or "").strip()
        return f" (line {error.lineno}: {line!r})" if error.lineno else ""
    frames = _user_frames(error, path)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {_show_path(last.filename)} line {last.lineno}: {(last.line or '').strip()!r})"


def user_code_location(error: BaseException, loaded: LoadedModel) -> str:
    """`` (at model.py line 9: 'scale = x.max().item()')``: where in the user's code an error
    raised while running the model (forward, loss) came from; ``""`` when no frame is theirs."""
    path = _file_of(loaded.source)
    if path is None:
        try:
            path = inspect.getsourcefile(type(loaded.model))
        except (TypeError, OSError):
            path = None
    frames = traceback.extract_tb(error.__traceback__)
    if path and not any(os.path.realpath(f.filename) == os.path.realpath(path) for f in frames):
        path = None  # fall back to frames outside fsdp-plan and torch
    if not path and not any(not os.path.abspath(f.filename).startswith(
            (_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)) for f in frames):
        return ""
    return _user_frame_hint(error, path)


def import_model_file(path: str) -> types.ModuleType:
    """Import the user's model file under a private module name.

    [Note: no bytecode beside the model file]
    The planner reads the user's folder and writes only the files it was asked for (SPEC's
    outputs; nothing else is left behind, on success or failure). Python's import would write
    ``__pycache__/<model>.cpython-*.pyc`` next to the model file (and next to whatever it
    imports from its folder), unless ``PYTHONDONTWRITEBYTECODE`` is set, as it is in some
    sandboxes and CI images and not on a user's machine: the hostile-input tests, which check
    that a failed run leaves the folder as it was, failed only there. So bytecode writing is
    off while the user's module runs its import; compiling one model file again each run
    costs milliseconds."""
    if not os.path.exists(path):
        raise BadInput(f"model file {path!r} does not exist; pass the path to a .py file that "
                       "defines build_model(**kwargs).")
    if os.path.isdir(path):
        raise BadInput(f"model file {path!r} is not a readable file (it is a folder); pass the "
                       "path to a .py file that defines build_model(**kwargs).")
    check_regular_file(path, f"model file {path!r}", "Pass the path to a .py file that "
                       "defines build_model(**kwargs).")  # a FIFO would block the import
    if not os.access(path, os.R_OK):
        raise BadInput(f"model file {path!r} is not a readable file (permission denied).")
    name = "fsdp_plan_user_model_" + hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"model file {path!r} cannot be imported as Python; it must be a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(os.path.abspath(path))
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    writes_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # [Note: no bytecode beside the model file]
    try:
        with user_code_output_to_stderr(f"importing model file {path!r}", path):
            spec.loader.exec_module(module)
    except BadInput:
        sys.modules.pop(name, None)
        raise
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise BadInput(f"model file {path!r} has a syntax error: {e.msg}{_user_frame_hint(e, path)}. "
                       "Fix the file and run again.") from e
    except Exception as e:  # the user's module-level code can raise anything
        sys.modules.pop(name, None)
        raise BadInput(f"importing model file {path!r} failed with {type(e).__name__}: {e}"
                       f"{_user_frame_hint(e, path)}. Fix the file (or install what it imports) "
                       "and run again.") from e
    finally:
        sys.dont_write_bytecode = writes_bytecode
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _resolve_factory(source: ModelSource) -> tuple[Callable[..., nn.Module], types.ModuleType | None]:
    if source.kind == "import":
        module_name, _, attr = source.source.partition(":")
        try:
            with user_code_output_to_stderr(f"importing {module_name!r}"):
                module = importlib.import_module(module_name)
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(f"cannot import {module_name!r} for model {source.source!r}: "
                           f"{type(e).__name__}: {e}. Check the package is installed and on PYTHONPATH.") from e
        factory = getattr(module, attr, None)
        if factory is None or not callable(factory):
            raise BadInput(f"{module_name!r} has no callable {attr!r}; MODEL must be "
                           "package.module:factory where factory(**kwargs) returns an nn.Module.")
        return factory, module
    module = import_model_file(source.source)
    factory = getattr(module, source.entry, None)
    if factory is None or not callable(factory):
        raise BadInput(f"model file {source.source!r} defines no function {source.entry!r}; add "
                       f"`def {source.entry}(**kwargs) -> nn.Module` or name yours with --entry.")
    return factory, module


_META_HINTS = (
    "The planner builds the model under torch.device('meta'), where tensors have no values: "
    "avoid .item(), .tolist(), data-dependent control flow and loading weights in the constructor "
    "(load them after sharding instead)."
)


def _factory_name(source: ModelSource) -> str:
    """How the message names the factory: ``build_model`` or ``package.module:attr``."""
    return source.source if source.kind == "import" else source.entry


def _call_text(source: ModelSource) -> str:
    return f"{_factory_name(source)}({_fmt_args(source.args)})"


def _factory_file(factory: Callable[..., Any], source: ModelSource) -> str | None:
    """The file that defines the factory: the model file, or the module of an importable one."""
    if source.kind == "file":
        return source.source
    try:
        return inspect.getsourcefile(inspect.unwrap(factory))
    except (TypeError, ValueError):
        return None


def _check_arguments(factory: Callable[..., Any], source: ModelSource) -> None:
    """Refuse --model-arg names the factory does not take, and required arguments none gives.

    Checked against the signature before calling, so a TypeError raised inside the factory is
    never mistaken for a wrong --model-arg."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: the call itself will tell
        return
    try:
        signature.bind(**source.args)
    except TypeError as e:
        params = [n for n, p in signature.parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        accepted = f"it accepts {', '.join(params)}" if params else "it takes no keyword arguments"
        missing = [n for n, p in signature.parameters.items()
                   if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY,
                                                          p.POSITIONAL_ONLY)
                   and n not in source.args]
        extra = [k for k in source.args if k not in params]
        name = _factory_name(source)
        if extra and not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            raise BadInput(f"--model-arg {', '.join(extra)}: {name}() has no such parameter "
                           f"({e}); {accepted}. Check the --model-arg names.") from e
        if source.kind == "import" and missing:
            raise BadInput(f"MODEL {name!r} needs the argument(s) {', '.join(missing)} that no "
                           f"--model-arg gives ({e}); MODEL must be package.module:factory where "
                           "factory(**kwargs) returns a torch.nn.Module.") from e
        raise BadInput(f"{name}() cannot be called with {_fmt_args(source.args) or 'no arguments'}"
                       f" ({e}); {accepted}. Give its required arguments with --model-arg "
                       "KEY=VALUE.") from e


def _raised_by_the_call(error: BaseException) -> bool:
    """True when ``error`` came from calling the factory itself (wrong keywords: Python raised
    it while binding arguments, so the traceback has no frame inside the factory)."""
    frames = list(traceback.walk_tb(error.__traceback__))
    return bool(frames) and frames[-1][0].f_code is build_on_meta.__code__


_INITIALISERS = ("constant_", "dirac_", "eye_", "kaiming_normal_", "kaiming_uniform_", "normal_",
                 "ones_", "orthogonal_", "sparse_", "trunc_normal_", "uniform_",
                 "xavier_normal_", "xavier_uniform_", "zeros_")


@contextlib.contextmanager
def initialisers_skipped() -> Iterator[None]:
    """Make ``torch.nn.init``'s in-place initialisers return their tensor untouched.

    On the meta device they write no values, yet each call still dispatches through the
    device mode and Python decompositions: 6,668 ``nn.Linear`` took 2.1 s to build with them
    and 0.5 s without. The analysis reads shapes and dtypes only. Transformers'
    ``no_init_weights`` does the same while it builds a model whose weights it will load.
    Initialisers imported by name before the build, and tensor methods such as
    ``weight.normal_()``, still run (slower, same result)."""
    import torch.nn.init as init
    saved = {name: getattr(init, name) for name in _INITIALISERS if hasattr(init, name)}

    def skip(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor
    try:
        for name in saved:
            setattr(init, name, skip)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_on_meta(factory: Callable[..., nn.Module], source: ModelSource) -> nn.Module:
    """Call the factory under ``torch.device('meta')`` (initialisers skipped: they write no
    values there) and check it returned an ``nn.Module``."""
    _check_arguments(factory, source)
    path = _factory_file(factory, source)
    call = _call_text(source)
    try:
        with torch.device("meta"), initialisers_skipped(), user_code_output_to_stderr(call, path):
            model = factory(**source.args)
    except BadInput:
        raise
    except Exception as e:
        raise _build_failed(e, source, call, path) from e
    if not isinstance(model, nn.Module):
        raise BadInput(f"{call} returned {type(model).__name__}, not a torch.nn.Module; MODEL "
                       "must name a factory that builds the model (build_model(**kwargs) -> "
                       "nn.Module).")
    return model


def _build_failed(error: Exception, source: ModelSource, call: str, path: str | None) -> BadInput:
    """The message for an exception raised while building: the cause and the user's line."""
    if isinstance(error, TypeError) and _raised_by_the_call(error):
        return BadInput(f"{call} failed: {error}. Check the --model-arg names against the "
                        "factory's parameters.")
    text = str(error).lower()
    hint = ""
    if "meta" in text or "item" in text or isinstance(error, (NotImplementedError, RuntimeError)):
        hint = " " + _META_HINTS
    if isinstance(error, OSError):
        hint = (" The constructor reads a file, but the planner needs only shapes: load "
                "weights after building (in the training script, after sharding), or skip "
                "the load when parameters are on the meta device (if "
                "next(self.parameters()).device.type != 'meta').")
    return BadInput(f"building the model with {call} raised {type(error).__name__}: {error}"
                    f"{_user_frame_hint(error, path)}.{hint}")


def _file_of(source: ModelSource) -> str | None:
    return source.source if source.kind == "file" else None


def _fmt_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _first_leaf(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if not list(module.children()) and (list(module.parameters(recurse=False))
                                            or isinstance(module, nn.Embedding)):
            return module
    return None


def _default_inputs_for(model: nn.Module, source: ModelSource):
    if is_hf_model(model):  # --hf-config models train with their loss: SPEC 7
        return hf_default_inputs(model, source.source, labels=source.kind == "hf-config")
    leaf = _first_leaf(model)
    if not isinstance(leaf, nn.Embedding):
        kind = type(leaf).__name__ if leaf is not None else "no parameterised layer"
        raise BadInput(f"model {source.source!r} has no example_inputs(batch_size, seq_len) and its "
                       f"first layer is {kind}, not an nn.Embedding, so the planner cannot guess its "
                       "inputs; define example_inputs(batch_size, seq_len) returning a tuple of "
                       "tensors (or a dict of keyword inputs) for one micro-batch.")
    vocab = leaf.num_embeddings

    def make(batch_size: int, seq_len: int):
        return (torch.randint(0, vocab, (batch_size, seq_len)),), {}
    return make


def _wrap_example_inputs(fn: Callable[..., Any], source: ModelSource):
    path = _file_of(source)

    def make(batch_size: int, seq_len: int):
        call = f"example_inputs({batch_size}, {seq_len})"
        try:
            with user_code_output_to_stderr(f"{call} in {source.source!r}", path):
                value = fn(batch_size, seq_len)
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(f"{call} in {source.source!r} raised "
                           f"{type(e).__name__}: {e}{_user_frame_hint(e, path)}.") from e
        if isinstance(value, dict):
            return (), dict(value)
        if isinstance(value, torch.Tensor):
            return (value,), {}
        if isinstance(value, (tuple, list)):
            return tuple(value), {}
        raise BadInput(f"example_inputs must return a tuple of tensors or a dict of keyword inputs, "
                       f"got {type(value).__name__}.")
    return make


def _wrap_loss_fn(fn: Callable[[Any], torch.Tensor], source: ModelSource
                  ) -> Callable[[Any], torch.Tensor]:
    """The user's ``loss_fn`` with its output sent to stderr and sys.exit() refused; other
    exceptions pass through (the analysis names the module and inputs)."""
    path = _file_of(source)

    def compute_loss(output: Any) -> torch.Tensor:
        with user_code_output_to_stderr(f"loss_fn(output) in {source.source!r}", path):
            return fn(output)
    compute_loss.__wrapped__ = fn  # type: ignore[attr-defined]
    return compute_loss


def check_parameter_shapes(model: nn.Module, source: ModelSource) -> None:
    """Refuse 0-d (scalar) and empty parameters: FSDP2 ``fully_shard`` shards every parameter
    on dim 0 and raises on a scalar, so such a plan would crash in the training script."""
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    empty = [n for n, p in model.named_parameters() if p.dim() > 0 and p.numel() == 0]
    if not scalars and not empty:
        return
    def listed(names: list[str]) -> str:
        shown = ", ".join(repr(n) for n in names[:8])
        return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    parts = []
    if scalars:
        parts.append(f"0-dimensional (scalar) parameters {listed(scalars)}: FSDP2 fully_shard "
                     "shards every parameter on dim 0 and cannot shard a scalar. Give them shape "
                     "[1] (nn.Parameter(torch.tensor([2.0])) instead of torch.tensor(2.0)) and "
                     "index [0] where they are used")
    if empty:
        parts.append(f"parameters with no elements {listed(empty)}: remove them, give them at "
                     "least one element, or register them as buffers")
    raise BadInput(f"model {source.source!r} has " + "; and ".join(parts) + ".")


def default_loss(output: Any) -> torch.Tensor:
    """SPEC 1: a tensor is summed; a tuple uses its first item; a dict/ModelOutput uses loss, else logits."""
    if isinstance(output, torch.Tensor):
        return output.sum() if output.dim() else output
    if isinstance(output, dict) or hasattr(output, "keys"):
        for key in ("loss", "logits"):
            value = output.get(key) if hasattr(output, "get") else None
            if isinstance(value, torch.Tensor):
                return default_loss(value)
        first = next(iter(output.values()), None) if hasattr(output, "values") else None
        if isinstance(first, torch.Tensor):
            return default_loss(first)
    if isinstance(output, (tuple, list)) and output:
        return default_loss(output[0])
    raise BadInput(f"cannot turn the model output ({type(output).__name__}) into a scalar loss; "
                   "define loss_fn(output) in the model file.")


def load_model(source: ModelSource) -> LoadedModel:
    """Build the model on ``meta`` and resolve its inputs and loss, per SPEC section 1."""
    if source.kind == "hf-config":
        factory, user_module = hf_factory(source.source), None
    else:
        factory, user_module = _resolve_factory(source)
    model = build_on_meta(factory, source)
    check_parameter_shapes(model, source)
    notes = list(getattr(factory, "fsdp_plan_notes", None) or [])
    user_inputs = getattr(user_module, "example_inputs", None) if user_module else None
    user_loss = getattr(user_module, "loss_fn", None) if user_module else None
    make_inputs = (_wrap_example_inputs(user_inputs, source) if callable(user_inputs)
                   else _default_inputs_for(model, source))
    compute_loss = _wrap_loss_fn(user_loss, source) if callable(user_loss) else default_loss
    return LoadedModel(source=source, model=model, make_inputs=make_inputs,
                       compute_loss=compute_loss, factory=factory, notes=notes)


def rebuild_meta(loaded: LoadedModel) -> nn.Module:
    """A fresh meta copy of the same model (verify and the analysis each consume one).

    A deep copy (tied parameters stay tied: ``deepcopy`` keeps one copy per object) costs a
    fraction of calling the factory again, whose ``nn.Linear`` initialisation dominated
    planning a model of 10,000 modules; a model that cannot be copied is built again."""
    try:
        return copy.deepcopy(loaded.model)
    except Exception:  # noqa: BLE001  (a module holding something uncopyable: a lock, a generator)
        return build_on_meta(loaded.factory, loaded.source)
