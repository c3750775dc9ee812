"""Hostile and careless input to the plan command: the model file, flags and output files.

Every failure here must keep the SPEC 2 contract: the exit code, a one-paragraph message that
names the value and the fix, no Python traceback, and no file written, changed or left behind
(modes included). Checks that must happen "before any work" use a model file that leaves a
marker file when it is imported: the marker must not appear.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

from fsdp_plan.cli.main import main
from fsdp_plan.common.errors import BadInput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
TINY = ["--model-arg", "size=tiny", "--seq-len", "32"]

# Imported => leaves a marker (so a test can tell the model was never imported).
MARKED = """\
import os
from torch import nn
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported.marker"), "w").close()

def build_model(size="tiny"):
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
"""

SMALL = """\
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

def example_inputs(batch_size, seq_len):
    return (torch.randn(batch_size, 8),)
"""


def write(folder, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def snapshot(folder) -> dict[str, tuple[bytes, int]]:
    """Every file in ``folder``: bytes and mode (a failed run must change neither)."""
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(folder.iterdir()) if p.is_file()}


def fails(capsys, argv: list[str], code: int, *needles: str) -> str:
    got = main(argv)
    captured = capsys.readouterr()
    assert got == code, captured.err
    assert "Traceback" not in captured.err, captured.err
    assert captured.out == "", captured.out  # no report, and no print() of the model's
    for needle in needles:
        assert needle in captured.err, captured.err
    return captured.err


# --- 1. no output may be an input or another output ---------------------------------------

@pytest.mark.parametrize("flag", ["-o", "--plan", "--trace"])
def test_output_that_is_the_model_file_is_refused_before_any_work(tmp_path, capsys, flag):
    victim = write(tmp_path, "victim.py", MARKED)
    os.chmod(victim, 0o640)
    before = snapshot(tmp_path)
    fails(capsys, [victim, "--mem", "80GB", flag, victim], 2, flag, "victim.py",
          "replace an input", "Choose another path")
    assert snapshot(tmp_path) == before  # not overwritten, mode kept, no temporaries, no marker


def test_output_that_is_a_hard_link_or_symlink_to_the_model_is_refused(tmp_path, capsys):
    victim = write(tmp_path, "victim.py", MARKED)
    os.link(victim, tmp_path / "hard.py")
    os.symlink(victim, tmp_path / "soft.py")
    before = snapshot(tmp_path)
    for alias in ("hard.py", "soft.py"):
        fails(capsys, [victim, "--mem", "80GB", "-o", str(tmp_path / alias)], 2, "replace an input")
    assert snapshot(tmp_path) == before


def test_output_that_is_the_hardware_file_is_refused(tmp_path, capsys):
    model = write(tmp_path, "model.py", MARKED)
    hw = write(tmp_path, "x.yaml", "peak_flops: 989e12\n")
    before = snapshot(tmp_path)
    fails(capsys, [model, "--mem", "80GB", "--hardware", hw, "--plan", hw], 2,
          "--plan", "--hardware", "replace an input")
    assert snapshot(tmp_path) == before


def test_output_that_is_the_hf_config_is_refused(tmp_path, capsys):
    config = write(tmp_path, "config.json", "{}\n")
    before = snapshot(tmp_path)
    fails(capsys, ["--hf-config", config, "--mem", "80GB", "--trace", config], 2,
          "--hf-config", "replace an input")
    assert snapshot(tmp_path) == before


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    model = write(tmp_path, "model.py", MARKED)
    before = snapshot(tmp_path)
    fails(capsys, [model, "--mem", "80GB", "-o", str(tmp_path / "same.py"),
                   "--plan", str(tmp_path / "same.py")], 2, "same file", "own path")
    assert snapshot(tmp_path) == before


def test_check_outputs_unit():
    from fsdp_plan.common.files import check_outputs
    check_outputs([("MODEL", "a.py"), ("--hardware", None)], [("-o", "b.py"), ("--plan", None)])
    with pytest.raises(BadInput, match="is the MODEL"):
        check_outputs([("MODEL", "a.py")], [("-o", "./a.py")])
    with pytest.raises(BadInput, match="same file"):
        check_outputs([], [("-o", "dir/../b.py"), ("--trace", "b.py")])


# --- 4. modes: a new file follows the umask, a replaced file keeps its mode ---------------

def test_new_outputs_follow_umask_and_replaced_files_keep_their_mode(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL)
    policy, plan = tmp_path / "policy.py", tmp_path / "plan.yaml"
    plan.write_text("old\n")
    os.chmod(plan, 0o755)
    old = os.umask(0o022)
    try:
        assert main([model, "--mem", "1GB", "-o", str(policy), "--plan", str(plan)]) == 0, \
            capsys.readouterr().err
    finally:
        os.umask(old)
    assert stat.S_IMODE(policy.stat().st_mode) == 0o644
    assert stat.S_IMODE(plan.stat().st_mode) == 0o755
    assert plan.read_text().startswith("fsdp_plan_version")
    assert sorted(os.listdir(tmp_path)) == ["model.py", "plan.yaml", "policy.py"]


def test_atomic_write_modes_unit(tmp_path):
    from fsdp_plan.common.files import atomic_write_text
    old = os.umask(0o027)
    try:
        atomic_write_text(str(tmp_path / "new.txt"), "x")
        existing = tmp_path / "old.txt"
        existing.write_text("y")
        os.chmod(existing, 0o604)
        atomic_write_text(str(existing), "z")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE(existing.stat().st_mode) == 0o604 and existing.read_text() == "z"


# --- 19. write failures name the user's path and the reason -------------------------------

@pytest.mark.parametrize("code,words", [
    (errno.ENOSPC, "disk is full"), (errno.EACCES, "permission denied"),
    (errno.EROFS, "read-only"), (errno.EDQUOT, "quota"),
])
def test_write_failure_names_the_path_and_the_reason(tmp_path, monkeypatch, code, words):
    from fsdp_plan.common import files as outputs
    target = tmp_path / "policy.py"
    target.write_text("keep\n")

    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(outputs.os, "fsync", failing_fsync)
    with pytest.raises(BadInput) as info:
        outputs.atomic_write_all([(str(target), "new")])
    message = str(info.value)
    assert repr(str(target)) in message and words in message and "nothing was written" in message
    assert ".tmp" not in message and "Free space" not in message
    assert os.listdir(tmp_path) == ["policy.py"] and target.read_text() == "keep\n"


def test_output_in_an_unwritable_place_fails_before_planning(tmp_path, capsys):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", "-o", "/proc/p.py"], 2, "/proc/p.py",
          "cannot be written")
    assert not (tmp_path / "imported.marker").exists()


def test_a_long_legal_file_name_is_writable(tmp_path):
    from fsdp_plan.common.files import atomic_write_text, check_writable
    path = str(tmp_path / ("p" * 247 + ".py"))  # 250 bytes: legal on every common file system
    check_writable(path, "-o")
    atomic_write_text(path, "x = 1\n")
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    with pytest.raises(BadInput, match="longer than"):
        check_writable(str(tmp_path / ("p" * 300 + ".py")), "-o")


def test_output_path_with_a_trailing_slash_is_refused(tmp_path, capsys):
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", "--plan", str(tmp_path / "newdir") + "/"], 2,
          "names a folder", "plan.yaml")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_output_that_is_a_device_is_refused(capsys, tmp_path):
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", "--trace", "/dev/null"], 2, "not a regular file")
    assert os.path.exists("/dev/null") and not stat.S_ISREG(os.stat("/dev/null").st_mode)


# --- 7. sys.exit() in user code -----------------------------------------------------------

@pytest.mark.parametrize("where,call", [
    ("import", "sys.exit(0)"), ("build", "sys.exit(3)"), ("build", "sys.exit('msg')"),
    ("inputs", "sys.exit(0)"), ("loss", "sys.exit(0)"),
])
def test_sys_exit_in_user_code_is_bad_input(tmp_path, capsys, where, call):
    lines = {"import": "", "build": "", "inputs": "", "loss": ""}
    lines[where] = f"    {call}\n" if where != "import" else f"{call}\n"
    text = ("import sys\nimport torch\nfrom torch import nn\n" + lines["import"]
            + "def build_model():\n" + lines["build"]
            + "    return nn.Sequential(nn.Linear(8, 4))\n"
            + "def example_inputs(batch_size, seq_len):\n" + lines["inputs"]
            + "    return (torch.randn(batch_size, 8),)\n"
            + "def loss_fn(output):\n" + lines["loss"] + "    return output.sum()\n")
    model = write(tmp_path, "model.py", text)
    err = fails(capsys, [model, "--mem", "1GB", "--plan", str(tmp_path / "p.yaml")], 2,
                "sys.exit(", "model.py line", call.replace("sys.exit(", "").rstrip(")"))
    assert "__main__" in err
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_keyboard_interrupt_in_build_model_stays_ctrl_c(tmp_path, capsys):
    model = write(tmp_path, "model.py", "def build_model():\n    raise KeyboardInterrupt\n")
    assert main([model, "--mem", "1GB", "--plan", str(tmp_path / "p.yaml")]) == 130
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


# --- 8. scalar and empty parameters -------------------------------------------------------

def test_scalar_and_empty_parameters_are_refused(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace(
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))",
        "    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n"
        "    m.scale = nn.Parameter(torch.tensor(2.0))\n"
        "    m.nothing = nn.Parameter(torch.empty(0, 4))\n"
        "    return m"))
    fails(capsys, [model, "--mem", "1GB", "--plan", str(tmp_path / "p.yaml")], 2,
          "'scale'", "0-dimensional", "shape [1]", "'nothing'", "no elements")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


# --- 9. dtype clashes that fake tensors let through ---------------------------------------

def test_int64_inputs_to_a_linear_fail_planning(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace("torch.randn(batch_size, 8)",
                                                      "torch.randint(0, 5, (batch_size, 8))"))
    fails(capsys, [model, "--mem", "1GB", "--plan", str(tmp_path / "p.yaml")], 2,
          "mixes dtypes", "int64", "addmm", "'0'", "nn.Embedding")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_importing_the_model_file_writes_no_bytecode_beside_it(tmp_path, monkeypatch):
    """[Note: no bytecode beside the model file]: where Python writes bytecode (a user's
    machine, not a sandbox with PYTHONDONTWRITEBYTECODE), neither the model file nor what it
    imports from its folder gets a ``__pycache__``, and the setting is as it was after."""
    from fsdp_plan.model.load import import_model_file
    write(tmp_path, "helper.py", "WIDTH = 8\n")
    model = write(tmp_path, "model.py", "from helper import WIDTH\n" + SMALL)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert import_model_file(model).WIDTH == 8
    assert sys.dont_write_bytecode is False
    assert sorted(os.listdir(tmp_path)) == ["helper.py", "model.py"]
    sys.modules.pop("helper", None)


# --- 10. bounded counts -------------------------------------------------------------------

@pytest.mark.parametrize("flags,needles", [
    (["--world-size", "1000000000"], ["--world-size", "1,048,576", "real clusters"]),
    (["--world-size", "2147483648"], ["--world-size", "1,048,576"]),
    (["--world-size", "0"], ["--world-size"]),
    (["--gpus-per-node", "4096"], ["--gpus-per-node", "1,024"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--batch-size", "1073741824"], ["--batch-size", "16,777,216"]),
    (["--seq-len", "1073741824"], ["--seq-len", "67,108,864"]),
    (["--batch-size", "65536", "--seq-len", "1048576"], ["tokens per micro-batch"]),
    (["--top", "-1"], ["--top"]),
    (["--entry", "not a name"], ["--entry"]),
    (["--entry", "__class__"], ["--entry", "dunder"]),
    (["--headroom", "100%"], ["--headroom", "0% up to"]),
    (["--headroom", "80GB"], ["--headroom", "leaves nothing"]),
    (["--mem", "nan"], ["--mem", "not a memory size"]),
])
def test_out_of_range_counts_fail_before_any_work(tmp_path, capsys, flags, needles):
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", *flags, "--plan", str(tmp_path / "p.yaml")], 2,
          *needles)
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


@pytest.mark.parametrize("headroom,expected", [("0", 0), ("0GB", 0), ("25%", 250_000_000)])
def test_headroom_zero_or_a_share_is_allowed(tmp_path, capsys, headroom, expected):
    model = write(tmp_path, "model.py", SMALL)
    plan = tmp_path / "p.yaml"
    assert main([model, "--mem", "1GB", "--headroom", headroom, "--plan", str(plan)]) == 0, \
        capsys.readouterr().err
    import yaml
    assert yaml.safe_load(plan.read_text())["headroom_bytes"] == expected


# --- 12. the model's print() never reaches stdout -----------------------------------------

@pytest.mark.slow
def test_json_stdout_stays_json_when_the_model_prints(tmp_path):
    model = write(tmp_path, "model.py", """\
import torch
from torch import nn
print("import")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        print("init")
        self.lin = nn.Linear(8, 4)
    def forward(self, x):
        print("forward", x.shape)
        return self.lin(x)

def build_model():
    print("build")
    return Net()

def example_inputs(batch_size, seq_len):
    print("inputs")
    return (torch.randn(batch_size, 8),)

def loss_fn(output):
    print("loss")
    return output.sum()
""")
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", model, "--mem", "1GB",
                           "--format", "json", "--verify"], check=False, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # one JSON document, nothing else
    assert report["plan"]["model"]["params"] == 36
    for word in ("import", "init", "build", "inputs", "forward", "loss"):
        assert word in done.stderr


# --- 13. hardware files -------------------------------------------------------------------

@pytest.mark.parametrize("text,needles", [
    ("peak_flops: fast\n", ["peak_flops", "'fast'", "FLOP/s"]),
    ("peak_flops: [1, 2]\n", ["peak_flops", "list", "FLOP/s"]),
    ("peak_flops: 0\n", ["peak_flops", "out of range", "from 1e+06"]),
    ("hbm_bandwidth: .nan\n", ["hbm_bandwidth", "nan", "bytes/s"]),
    ("intra_node_bandwidth: -5\n", ["intra_node_bandwidth", "-5", "bytes/s"]),
    ("efficiency: 1.5\n", ["efficiency", "1.5", "fraction"]),
    ("collective_latency_s: .inf\n", ["collective_latency_s", "inf", "seconds"]),
    ("peak_flop: 1e15\n", ["unknown fields peak_flop", "peak_flops"]),
    ("- 1\n- 2\n", ["mapping", "list"]),
    ("name: [x]\n", ["name"]),
    ("a: [\n", ["cannot be read as YAML"]),
    ("a: !!python/object:os.system x\n", ["YAML tag", "constructs no tagged values"]),
])
def test_bad_hardware_files(tmp_path, capsys, text, needles):
    model = write(tmp_path, "model.py", MARKED)
    hw = write(tmp_path, "hw.yaml", text)
    fails(capsys, [model, "--mem", "80GB", "--hardware", hw, "--plan", str(tmp_path / "p.yaml")],
          2, "--hardware", *needles)
    assert sorted(os.listdir(tmp_path)) == ["hw.yaml", "model.py"]


def test_hardware_file_that_is_binary_a_pipe_or_huge(tmp_path, capsys):
    model = write(tmp_path, "model.py", MARKED)
    (tmp_path / "bin.yaml").write_bytes(b"peak_flops: \xff\n")
    os.mkfifo(tmp_path / "pipe.yaml")  # reading it would block forever
    (tmp_path / "big.yaml").write_text("# padding\n" * 200_000)
    for name, words in (("bin.yaml", "not UTF-8"), ("pipe.yaml", "not a regular file"),
                        ("big.yaml", "a few lines")):
        fails(capsys, [model, "--mem", "80GB", "--hardware", str(tmp_path / name)], 2, words)
    assert not (tmp_path / "imported.marker").exists()


def test_hardware_values_in_range_are_read():
    from fsdp_plan.cost.hardware import hardware_for
    hw = hardware_for("a100", {"peak_flops": "989e12", "contention": 0, "name": "mine"})
    assert hw.peak_flops == 989e12 and hw.contention == 0.0 and hw.name == "mine"


def test_unknown_gpu_lists_the_presets(tmp_path, capsys):
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", "--gpu", "tpu"], 2, "'tpu'", "h100", "a100", "b200")


# --- 14 and 23. --model-arg values are YAML scalars, kept exactly ---------------------------

def test_model_arg_values_are_plain_scalars():
    from fsdp_plan.model.source import parse_model_args
    parsed = parse_model_args(["when=2020-01-01", "b=!!binary aGVsbG8=", "t=!custom x",
                               "n=~", "n2=null", "n3=NULL", "e=", "nl=a\nb", "i=4", "f=1.5",
                               "yes=true", "s=70b", "lst=[1, 2]", "q='quoted'", "t2=1:30",
                               "blank=  "])
    assert parsed == {"when": "2020-01-01", "b": "!!binary aGVsbG8=", "t": "!custom x",
                      "n": None, "n2": None, "n3": None, "e": "", "nl": "a\nb", "i": 4,
                      "f": 1.5, "yes": True, "s": "70b", "lst": "[1, 2]", "q": "quoted",
                      "t2": "1:30", "blank": "  "}


def test_model_arg_given_twice_is_refused():
    from fsdp_plan.model.source import parse_model_args
    with pytest.raises(BadInput, match="size is given twice"):
        parse_model_args(["size=tiny", "size=70b"])


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", ".NaN"])
def test_model_arg_nan_and_inf_are_refused_before_any_work(tmp_path, capsys, value):
    model = write(tmp_path, "model.py", MARKED)
    fails(capsys, [model, "--mem", "80GB", "--model-arg", f"x={value}",
                   "--plan", str(tmp_path / "p.yaml")], 2, f"x={value}", "finite")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_model_arg_date_and_binary_reach_the_policy_as_strings(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace("def build_model():",
                                                      "def build_model(when=None, blob=None):"))
    policy, plan = tmp_path / "p.py", tmp_path / "p.yaml"
    assert main([model, "--mem", "1GB", "--model-arg", "when=2020-01-01", "--model-arg",
                 "blob=!!binary aGVsbG8=", "-o", str(policy), "--plan", str(plan)]) == 0, \
        capsys.readouterr().err
    from fsdp_plan.plan.emit import load_policy_module
    assert load_policy_module(str(policy)).PLAN["model"]["args"] == {
        "when": "2020-01-01", "blob": "!!binary aGVsbG8="}


def test_model_source_plan_dict_round_trip():
    from fsdp_plan.model.source import ModelSource
    source = ModelSource(source="m.py", args={"size": "tiny", "n": None}, batch_size=2, seq_len=8)
    assert ModelSource.from_plan_dict(source.to_plan_dict()) == source
    assert ModelSource.from_plan_dict({"source": "m.py", "args": {"x": [1]}}).args == {"x": [1]}
    with pytest.raises(BadInput, match=r"model.args.x\[1\]"):
        ModelSource.from_plan_dict({"source": "m.py", "args": {"x": [1, float("nan")]}})
    with pytest.raises(BadInput, match="batch_size"):
        ModelSource.from_plan_dict({"source": "m.py", "batch_size": "two"})


# --- 18. the real cause, and where it is --------------------------------------------------

def test_type_error_inside_build_model_names_the_line_not_model_arg(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace(
        "def build_model():\n", "def build_model():\n    width = 'a' + 1\n"))
    err = fails(capsys, [model, "--mem", "1GB"], 2, "TypeError", "model.py line 5",
                "width = 'a' + 1")
    assert "--model-arg" not in err


def test_wrong_model_arg_name_lists_the_parameters(tmp_path, capsys):
    fails(capsys, [LLAMA, "--model-arg", "sizee=tiny", "--mem", "1GB"], 2,
          "--model-arg sizee", "no such parameter", "size, n_layers")


def test_importable_callable_that_is_not_a_factory(tmp_path, capsys):
    fails(capsys, ["json:loads", "--mem", "1GB"], 2, "json:loads", "needs the argument", "s",
          "nn.Module")
    fails(capsys, ["json:loads", "--model-arg", "s={}", "--mem", "1GB"], 2,
          "json:loads(s='{}') returned dict, not a torch.nn.Module")


# --- --help -------------------------------------------------------------------------------

def test_help_shows_units_defaults_and_presets(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("70GB (10^9 bytes)", "default: 10% of --mem", "1..1,048,576 (default: 8)",
                   "h100, h200, a100, b200", "(default: 4096)", "FLOP/s", "--model-arg",
                   "(default: bf16; fp32 with --autocast)", "(default: table)"):
        assert needle in text, needle


def test_item_in_forward_is_named_with_its_line_not_blamed_on_inputs(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace(
        "def build_model():",
        "class Net(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        scale = x.abs().max().item()\n"
        "        return super().forward(x) / scale\n\n"
        "def build_model():\n    return Net(8, 2)\n\ndef unused():"))
    err = fails(capsys, [model, "--mem", "1GB"], 2, ".item()", "fake tensors",
                "model.py line 6", "scale = x.abs().max().item()")
    assert "--batch-size" not in err and "example_inputs" not in err


def test_error_in_forward_names_the_users_line(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace(
        "def build_model():",
        "class Net(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return super().forward(x).view(3, 5, 7)\n\n"
        "def build_model():\n    return Net(8, 2)\n\ndef unused():"))
    fails(capsys, [model, "--mem", "1GB"], 2, "model.py line 6", ".view(3, 5, 7)")


def test_importable_factory_module_is_an_input_and_its_exit_is_refused(tmp_path, capsys,
                                                                      monkeypatch):
    write(tmp_path, "hostile_factory_mod.py",
          "import sys\nprint('imported')\n\ndef make(**kwargs):\n    sys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = snapshot(tmp_path)
    fails(capsys, ["hostile_factory_mod:make", "--mem", "1GB",
                   "-o", str(tmp_path / "hostile_factory_mod.py")], 2,
          "module of MODEL hostile_factory_mod:make", "replace an input")
    assert snapshot(tmp_path) == before
    err = fails(capsys, ["hostile_factory_mod:make", "--mem", "1GB"], 2,
                "hostile_factory_mod:make() called sys.exit(4)", "hostile_factory_mod.py line 5")
    assert "imported" in err  # the module's print went to stderr (fails() checks stdout)
    monkeypatch.delitem(sys.modules, "hostile_factory_mod", raising=False)


def test_chdir_in_user_code_does_not_move_relative_outputs(tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    model = write(tmp_path, "model.py", SMALL.replace(
        "def build_model():\n", f"def build_model():\n    import os\n    os.chdir({str(elsewhere)!r})\n"))
    monkeypatch.chdir(work)
    assert main([model, "--mem", "1GB", "--plan", "p.yaml"]) == 0, capsys.readouterr().err
    assert os.listdir(work) == ["p.yaml"] and os.listdir(elsewhere) == []
    assert os.getcwd() == str(work)


def test_sys_exit_in_forward_is_bad_input(tmp_path, capsys):
    model = write(tmp_path, "model.py", SMALL.replace(
        "def build_model():",
        "class Net(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        raise SystemExit(0)\n\n"
        "def build_model():\n    return Net(8, 2)\n\ndef unused():"))
    fails(capsys, [model, "--mem", "1GB", "--plan", str(tmp_path / "p.yaml")], 2,
          "the model's forward called sys.exit(0)", "model.py line 6")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_replaced_file_keeps_its_owner_when_root(tmp_path):
    from fsdp_plan.common.files import atomic_write_text
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    target = tmp_path / "shared.yaml"
    target.write_text("old\n")
    os.chown(target, 12345, 23456)
    atomic_write_text(str(target), "new\n")
    st = target.stat()
    assert (st.st_uid, st.st_gid) == (12345, 23456) and target.read_text() == "new\n"


def test_text_that_is_not_unicode_is_refused_without_a_trace(tmp_path):
    from fsdp_plan.common.files import atomic_write_text
    with pytest.raises(BadInput, match="not valid Unicode"):
        atomic_write_text(str(tmp_path / "p.yaml"), "args: \udcff\n")
    assert os.listdir(tmp_path) == []
