"""Every user mistake gets its SPEC exit code, a one-paragraph message and no files.

Each row plans (or verifies) through ``main([...])`` with ``--plan`` pointing at an EXISTING
file and ``-o`` at a new one, then asserts: the exit code (2 bad input, 3 no plan fits),
the message names the value and the fix, stderr holds no Python traceback, the existing plan
file is byte-for-byte unchanged and nothing else appeared in the output folder.

Also here: untrusted text (module names, class names, ``--model-arg`` values) never becomes
code in the emitted policy, and plan files are read with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_plan.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
GPT2 = os.path.join(ROOT, "examples", "gpt2.py")
TINY = ["--model-arg", "size=tiny", "--seq-len", "32"]
KEPT = "fsdp_plan_version: 1  # an older plan the user keeps\n"

LINEAR_MODEL = """\
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
"""


@pytest.fixture
def out(tmp_path):
    """An output folder holding one existing plan file that a failed run must leave alone."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "keep.yaml").write_text(KEPT)
    return folder


def model_file(tmp_path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def plan_fails(capsys, out, argv: list[str], code: int, *needles: str) -> str:
    """Run the plan command, writing to ``out``; check the failure contract, return stderr."""
    got = main([*argv, "--plan", str(out / "keep.yaml"), "-o", str(out / "policy.py")])
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert sorted(os.listdir(out)) == ["keep.yaml"], "a failed run wrote a file"
    assert (out / "keep.yaml").read_text() == KEPT, "a failed run changed an existing file"
    return err


# --- the model file --------------------------------------------------------------------------

def test_missing_model_file(tmp_path, out, capsys):
    plan_fails(capsys, out, [str(tmp_path / "nope.py"), "--mem", "1GB"], 2,
               "does not exist", "defines build_model")


def test_unreadable_model_file_is_a_folder(tmp_path, out, capsys):
    (tmp_path / "model.py").mkdir()
    plan_fails(capsys, out, [str(tmp_path / "model.py"), "--mem", "1GB"], 2,
               "is not a readable file")


def test_unreadable_model_file_without_permission(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL)
    os.chmod(path, 0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as root: a chmod 000 file is still readable")
        plan_fails(capsys, out, [path, "--mem", "1GB"], 2, "is not a readable file")
    finally:
        os.chmod(path, 0o644)


def test_syntax_error_shows_the_users_line(tmp_path, out, capsys):
    path = model_file(tmp_path, "import torch\ndef build_model(:\n    return None\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "syntax error", "line 2", "def build_model(:")


def test_import_error_shows_the_users_line(tmp_path, out, capsys):
    path = model_file(tmp_path, "import torch\nimport definitely_not_a_package_xyz\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "No module named 'definitely_not_a_package_xyz'", "line 2",
               "import definitely_not_a_package_xyz", "install what it imports")


def test_no_build_model(tmp_path, out, capsys):
    path = model_file(tmp_path, "from torch import nn\ndef make():\n    return nn.Linear(2, 2)\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "defines no function 'build_model'", "--entry")


def test_wrong_entry_name(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL)
    plan_fails(capsys, out, [path, "--mem", "1GB", "--entry", "make_it"], 2,
               "defines no function 'make_it'")


def test_build_model_raising_shows_the_users_line(tmp_path, out, capsys):
    path = model_file(tmp_path, "def build_model(size='tiny'):\n"
                                "    raise ValueError(f'unknown size {size!r}')\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "ValueError: unknown size 'tiny'", "line 2")


def test_unknown_model_arg_names_the_factorys_parameters(out, capsys):
    plan_fails(capsys, out, [LLAMA, "--model-arg", "sizee=tiny", "--mem", "1GB"], 2,
               "sizee", "--model-arg")


def test_malformed_model_arg(out, capsys):
    plan_fails(capsys, out, [LLAMA, "--model-arg", "size", "--mem", "1GB"], 2,
               "KEY=VALUE", "--model-arg size=70b")


def test_model_calling_item_on_meta_gets_a_hint(tmp_path, out, capsys):
    path = model_file(tmp_path, """\
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)
        n = int(self.w.weight.abs().sum().item())
        self.extra = nn.Linear(4, max(n, 1))

def build_model():
    return M()
""")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "Tensor.item() cannot be called on meta tensors", "line 8",
               "torch.device('meta')", "avoid .item()")


def test_model_loading_weights_in_its_constructor_gets_a_hint(tmp_path, out, capsys):
    path = model_file(tmp_path, """\
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)
        self.load_state_dict(torch.load("/nonexistent/weights.pt"))

def build_model():
    return M()
""")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "FileNotFoundError", "/nonexistent/weights.pt", "line 8",
               "needs only shapes", "meta")


def test_model_without_parameters(tmp_path, out, capsys):
    path = model_file(tmp_path, "from torch import nn\ndef build_model():\n    return nn.ReLU()\n"
                                "def example_inputs(b, s):\n    import torch\n"
                                "    return (torch.randn(b, s),)\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2, "no parameters")


# --- inputs ---------------------------------------------------------------------------------

def test_no_example_inputs_for_a_model_not_starting_with_an_embedding(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL)
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "no example_inputs", "first layer is Linear",
               "define example_inputs(batch_size, seq_len)")


def test_inputs_the_model_rejects_show_the_shape_mismatch(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL + "\ndef example_inputs(batch_size, seq_len):\n"
                                "    return (torch.randn(batch_size, seq_len, 7),)\n")
    plan_fails(capsys, out, [path, "--mem", "1GB", "--seq-len", "16"], 2,
               "given [1, 16, 7]", "in module '0' (Linear)", "[16, 7] X [8, 16]",
               "Check example_inputs")


def test_example_inputs_raising_shows_the_users_line(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL + "\ndef example_inputs(batch_size, seq_len):\n"
                                "    raise RuntimeError('no data here')\n")
    plan_fails(capsys, out, [path, "--mem", "1GB"], 2,
               "example_inputs(1, 4096)", "no data here", "line 8")


def test_loss_fn_returning_a_vector(tmp_path, out, capsys):
    path = model_file(tmp_path, LINEAR_MODEL + "\ndef example_inputs(batch_size, seq_len):\n"
                                "    return (torch.randn(batch_size, 8),)\n"
                                "def loss_fn(output):\n    return output\n")
    plan_fails(capsys, out, [path, "--mem", "1GB", "--batch-size", "2"], 2,
               "loss_fn must return a scalar")


# --- the command line -----------------------------------------------------------------------

def test_no_model_at_all(out, capsys):
    plan_fails(capsys, out, ["--mem", "1GB"], 2, "give a MODEL")


@pytest.mark.parametrize("mem", ["lots", "12XB", "", "GB", "1.2.3GB", "0x10GB"])
def test_malformed_mem(out, capsys, mem):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", mem], 2, "is not a memory size", "70GB")


@pytest.mark.parametrize("mem", ["0", "0GB", "0.0000001B", "0.4B"])
def test_zero_mem(out, capsys, mem):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", mem], 2, "larger than zero", "80GB")


def test_negative_mem(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem=-5GB"], 2, "is not a memory size")


def test_negative_mem_as_a_separate_word(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "-5GB"], 2, "--mem")


def test_absurdly_large_mem(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1e400GB"], 2, "more than any GPU holds")


def test_headroom_larger_than_mem(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", "--headroom", "2GB"], 2,
               "leaves nothing of --mem")


def test_world_size_not_divisible_by_gpus_per_node(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", "--world-size", "12"], 2,
               "--world-size 12 is not a multiple of --gpus-per-node 8", "--world-size 8")


@pytest.mark.parametrize("flag", ["--world-size", "--gpus-per-node", "--batch-size", "--seq-len"])
def test_non_positive_counts(out, capsys, flag):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", flag, "0"], 2, flag)


def test_non_integer_world_size(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", "--world-size", "eight"], 2,
               "--world-size", "invalid int value")


def test_unknown_gpu(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", "--gpu", "tpu9"], 2,
               "unknown --gpu 'tpu9'", "h100", "--hardware")


def test_unknown_dtype(out, capsys):
    plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "1GB", "--param-dtype", "fp8"], 2,
               "--param-dtype 'fp8'", "bf16")


def test_budget_below_the_sharded_model_states_exits_3_with_the_numbers(out, capsys):
    err = plan_fails(capsys, out, [LLAMA, *TINY, "--mem", "100kB", "--world-size", "8"], 3,
                     "no plan fits --mem 100.00 kB", "limit 90.00 kB", "smallest peak",
                     "sharded parameters and optimizer states alone take", "GPUs would hold them")
    assert "MB" in err.split("smallest peak")[1]  # the smallest peak is stated in bytes units


# --- output paths ---------------------------------------------------------------------------

def test_output_folder_that_does_not_exist(tmp_path, out, capsys):
    target = tmp_path / "missing" / "policy.py"
    code = main([LLAMA, *TINY, "--mem", "1GB", "-o", str(target), "--plan", str(out / "keep.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist; create it" in err and "Traceback" not in err
    assert not target.parent.exists() and (out / "keep.yaml").read_text() == KEPT


def test_output_path_under_a_regular_file(tmp_path, out, capsys):
    (tmp_path / "file.txt").write_text("a file\n")
    code = main([LLAMA, *TINY, "--mem", "1GB", "--plan", str(tmp_path / "file.txt" / "out.yaml"),
                 "-o", str(out / "policy.py")])
    err = capsys.readouterr().err
    assert code == 2 and "is a file, not a folder" in err and "Traceback" not in err
    assert (tmp_path / "file.txt").read_text() == "a file\n"
    assert sorted(os.listdir(out)) == ["keep.yaml"]


def test_output_folder_that_cannot_be_written(tmp_path, out, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        code = main([LLAMA, *TINY, "--mem", "1GB", "-o", str(locked / "policy.py")])
        err = capsys.readouterr().err
        assert code == 2 and "cannot be written" in err and "Traceback" not in err
        assert not os.listdir(locked)
    finally:
        os.chmod(locked, 0o700)


def test_output_path_that_is_a_folder(tmp_path, out, capsys):
    (out / "policy.py").mkdir()
    code = main([LLAMA, *TINY, "--mem", "1GB", "-o", str(out / "policy.py"),
                 "--plan", str(out / "keep.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "is a folder" in err and "Traceback" not in err
    assert (out / "keep.yaml").read_text() == KEPT


def test_policy_output_must_be_python(out, capsys):
    code = main([LLAMA, *TINY, "--mem", "1GB", "-o", str(out / "policy.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "must name a .py file" in err and "Traceback" not in err
    assert sorted(os.listdir(out)) == ["keep.yaml"]


# --- Hugging Face configs (no transformers needed to fail) --------------------------------

def test_hf_config_that_does_not_exist(tmp_path, out, capsys):
    plan_fails(capsys, out, ["--hf-config", str(tmp_path / "config.json"), "--mem", "1GB"], 2,
               "does not exist", "nothing is downloaded")


def test_hf_config_that_is_not_json(tmp_path, out, capsys):
    path = model_file(tmp_path, '{"model_type": "llama",\n', "config.json")
    plan_fails(capsys, out, ["--hf-config", path, "--mem", "1GB"], 2, "is not valid JSON", "line")


def test_hf_config_without_model_type(tmp_path, out, capsys):
    path = model_file(tmp_path, '{"hidden_size": 64}', "config.json")
    plan_fails(capsys, out, ["--hf-config", path, "--mem", "1GB"], 2, "no 'model_type'")


def test_hf_config_needing_remote_code_is_refused(tmp_path, out, capsys):
    path = model_file(tmp_path, '{"model_type": "mine", "auto_map": {"AutoModel": "m.M"}}',
                      "config.json")
    plan_fails(capsys, out, ["--hf-config", path, "--mem", "1GB"], 2,
               "custom model code", "never downloads or runs")


def test_hf_config_without_transformers_installed(out, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    plan_fails(capsys, out, ["--hf-config", os.path.join(ROOT, "examples", "hf", "llama.json"),
                             "--mem", "1GB"], 2, "pip install 'fsdp-plan[hf]'")


# --- plan files given to verify / bench ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama_plan(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("plan")
    path = folder / "plan.yaml"
    assert main([LLAMA, *TINY, "--mem", "4MB", "--plan", str(path), "--format", "json"]) == 0
    return str(path)


def verify_fails(capsys, argv: list[str], *needles: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_verify_refuses_a_plan_made_for_another_model(tiny_llama_plan, capsys):
    verify_fails(capsys, ["verify", tiny_llama_plan, GPT2], "262,720", "re-plan")


def test_bench_refuses_a_plan_made_for_another_model(tiny_llama_plan, capsys):
    verify_fails(capsys, ["bench", tiny_llama_plan, GPT2, "--nproc", "2"], "262,720", "re-plan")


def test_verify_refuses_a_plan_whose_model_code_changed(tiny_llama_plan, tmp_path, capsys):
    changed = tmp_path / "llama.py"
    changed.write_text(Path(LLAMA).read_text() + "\n# edited after planning\n")
    verify_fails(capsys, ["verify", tiny_llama_plan, str(changed)], "digest", "re-plan")


def test_verify_refuses_a_plan_of_another_version(tiny_llama_plan, tmp_path, capsys):
    raw = yaml.safe_load(Path(tiny_llama_plan).read_text())
    raw["fsdp_plan_version"] = 7
    path = tmp_path / "v7.yaml"
    path.write_text(yaml.safe_dump(raw))
    verify_fails(capsys, ["verify", str(path)], "fsdp_plan_version 7", "version 1")


def test_bench_refuses_a_plan_of_another_version(tiny_llama_plan, tmp_path, capsys):
    raw = yaml.safe_load(Path(tiny_llama_plan).read_text())
    raw["fsdp_plan_version"] = 0
    path = tmp_path / "v0.yaml"
    path.write_text(yaml.safe_dump(raw))
    verify_fails(capsys, ["bench", str(path), "--nproc", "2"], "fsdp_plan_version 0")


def test_verify_refuses_a_missing_plan_file(tmp_path, capsys):
    verify_fails(capsys, ["verify", str(tmp_path / "nope.yaml")], "does not exist")


def test_a_plan_with_a_python_tag_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text("fsdp_plan_version: 1\n"
                    f"model: !!python/object/apply:os.system ['touch {marker}']\n"
                    "budget_bytes: 1\nworld_size: 1\nmesh: {shard: 1}\nunits: []\n")
    verify_fails(capsys, ["verify", str(path)], "YAML tag", "plain data")
    assert not marker.exists()


# --- untrusted text never becomes code ---------------------------------------------------

PAYLOADS = [
    'x"); import os as o; getattr(o, "system")("touch $FSDP_PLAN_PWNED") #',
    "y'''\nimport os as o\ngetattr(o, 'system')('touch $FSDP_PLAN_PWNED')\n'''",
    'z"""\\n{__import__("os")}',
]
EVIL_CLASS = 'Evil"); import os as o; getattr(o, "system")("touch $FSDP_PLAN_PWNED") #'
EVIL_MODEL = f'''
import torch
from torch import nn

KEYS = {PAYLOADS!r}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 128)

    def forward(self, x):
        return torch.relu(self.lin(x))


Evil = type({EVIL_CLASS!r}, (Block,), {{}})  # a class name is untrusted text too


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.blocks = nn.ModuleDict({{key: Evil() for key in KEYS}})
        self.head = nn.Linear(128, 64)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


def build_model(tag="plain"):
    return Model()
'''

_SPAWNED: list[str] = []
_WATCHING = [False]


def _planners_own_fork() -> bool:
    """Whether the fork being audited is the planner's own, for an analysis pass (facts/forked.py
    [Note: passes in forked children]), not one the untrusted names made."""
    frame = sys._getframe(2)
    while frame is not None:
        if (frame.f_code.co_name == "fork_planner_child"
                and frame.f_code.co_filename.endswith(os.path.join("model", "user_process.py"))):
            return True
        frame = frame.f_back
    return False


def _audit(event: str, _args: tuple) -> None:
    if _WATCHING[0] and event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn",
                                  "os.spawn", "os.fork") and not (
            event == "os.fork" and _planners_own_fork()):
        _SPAWNED.append(event)


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one only records while watching


def test_module_names_class_names_and_args_stay_strings(tmp_path, monkeypatch, capsys):
    from fsdp_plan.measure.memory import measure_peak
    from fsdp_plan.measure.runtime import source_from_plan
    from fsdp_plan.model.load import load_model
    from fsdp_plan.plan.document import read_plan
    from fsdp_plan.plan.emit import load_policy_module

    marker = tmp_path / "pwned"
    monkeypatch.setenv("FSDP_PLAN_PWNED", str(marker))
    path = model_file(tmp_path, EVIL_MODEL)
    tag = PAYLOADS[0] + "\n'''\"\"\""
    policy, plan_path = tmp_path / "policy.py", tmp_path / "plan.yaml"
    _WATCHING[0] = True
    try:
        code = main([path, "--model-arg", f"tag={tag}", "--mem", "400kB", "--world-size", "8",
                     "--seq-len", "16", "-o", str(policy), "--plan", str(plan_path)])
        assert code == 0, capsys.readouterr().err
        module = load_policy_module(str(policy))
        plan = read_plan(str(plan_path))
        # The names reach fully_shard as strings: apply the emitted policy on the fake PG.
        measure_peak(load_model(source_from_plan(plan)), plan, module)
    finally:
        _WATCHING[0] = False
    assert not marker.exists() and not _SPAWNED, _SPAWNED
    assert module.PLAN == yaml.safe_load(plan_path.read_text())  # PLAN round-trips
    assert module.PLAN["model"]["args"] == {"tag": tag}
    units = [m for u in module.PLAN["units"] for m in u["modules"]]
    assert all(f"blocks.{key}" in units for key in PAYLOADS), units


def test_a_rejected_input_is_one_paragraph_in_a_fresh_process(tmp_path):
    """A meta kernel that rejects the model's inputs makes FakeTensorMode log a whole
    traceback at ERROR level. The CLI silences that logger, but torch is imported only once a
    verb needs it, and importing it resets the levels of torch's loggers: a level set before
    let the traceback through. Only a fresh process shows it (in-process tests import torch
    first), so this one runs the command as a user does."""
    import subprocess
    model = tmp_path / "mismatch.py"
    model.write_text("""\
import torch
from torch import nn

class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return (x @ self.w.t()).sum()  # (batch, 8) @ (16, 8): the shapes do not chain

def build_model():
    return Mismatch()

def example_inputs(batch_size, seq_len):
    return (torch.randn(batch_size, 8),)
""")
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", str(model), "--mem",
                           "1GB", "--world-size", "2", "--no-cache"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    assert "failed on its example inputs" in done.stderr
    assert "Traceback" not in done.stderr and "fake_tensor.py" not in done.stderr
    debug = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", str(model), "--mem",
                            "1GB", "--world-size", "2", "--no-cache", "--debug"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           check=False)
    assert debug.returncode == 2 and "Traceback" in debug.stderr  # --debug shows it all
