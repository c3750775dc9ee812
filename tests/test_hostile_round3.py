"""Hostile input, round 3 (issue 21): the planning-path defects, through the real entry points.

Each case asserts the SPEC 2 contract: the exit code, the message's words, no Python
traceback, and no file written, changed or left behind (and, where model code starts
processes or threads, none left running). A model file that leaves a marker file when it is
imported tells whether user code ran.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import cli_checks
import pytest
import yaml

from fsdp_plan.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
BUNDLED = os.path.join(ROOT, "policies", "llama8b_h100x8.yaml")
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def tree(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (a refused run must change none)."""
    found = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def fails(capsys, argv: list[str], code: int, *needles: str) -> str:
    """``cli_checks.refused`` with the exit code first, as this file's cases read."""
    return cli_checks.refused(capsys, argv, *needles, code=code)


# --- S3-01: a plan's relative model is never searched for above its folder -----------------

PLANTED = """\
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted.marker"), "w").close()
from torch import nn

def build_model(size="8b"):
    return nn.Linear(2, 2)
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A clone at ``tmp_path/share/clone`` holding ``t/deep/a/b/plan.yaml`` (the bundled 8B
    plan naming ``planted_model.py``), and that file planted two folders above the clone, in
    ``tmp_path``; the working folder is the clone."""
    clone = tmp_path / "share" / "clone"
    folder = clone / "t" / "deep" / "a" / "b"
    folder.mkdir(parents=True)
    with open(BUNDLED) as f:
        document = yaml.safe_load(f)
    document["model"]["source"] = "planted_model.py"
    (folder / "plan.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    (tmp_path / "planted_model.py").write_text(PLANTED)
    monkeypatch.chdir(clone)
    return tmp_path, os.path.join("t", "deep", "a", "b", "plan.yaml")


@pytest.mark.parametrize("verb,extra", [("predict", []), ("verify", []),
                                        ("tune", ["--out", "tuned"]), ("bench", ["--nproc", "2"])])
def test_a_model_planted_above_the_plan_is_never_run(planted, capsys, verb, extra):
    top, plan = planted
    before = tree(top)
    fails(capsys, [verb, plan, *extra], 2, "'planted_model.py' was not found",
          os.path.join(str(top), "share", "clone", "t", "deep", "a", "b", "planted_model.py"),
          os.path.join(str(top), "share", "clone", "planted_model.py"),
          "folders above them are never searched", "MODEL")
    assert not (top / "planted.marker").exists()  # the planted code did not run
    assert tree(top) == before  # nothing written (no tune results, no bench JSON)


def test_the_planted_model_is_not_found_from_a_subprocess_either(planted):
    top, plan = planted
    before = tree(top)
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", "predict", plan],
                          capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert done.returncode == 2, done.stderr
    assert "was not found" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == "" and tree(top) == before


# --- S3-03: an explicit --strategy is never replaced, --allow-offload or not ----------------

TINY = [LLAMA, "--model-arg", "size=tiny", "--headroom", "0", "--seq-len", "8"]


@pytest.mark.parametrize("world,instead", [
    ("2", "--strategy full (or auto) with --allow-offload fits (device peak"),
    ("8", "--strategy full (or auto) fits on the device (peak")])
def test_ddp_with_allow_offload_that_does_not_fit_exits_3_and_says_what_would(tmp_path, capsys,
                                                                              world, instead):
    out = tmp_path / "out"
    out.mkdir()
    err = fails(capsys, [*TINY, "--mem", "3MB", "--world-size", world, "--strategy", "ddp",
                         "--allow-offload", "--plan", str(out / "p.yaml"), "-o",
                         str(out / "p.py")], 3,
                "no --strategy ddp plan fits --mem 3.00 MB",
                "smallest peak any --strategy ddp plan reached is", "(ddp ",
                "DDP has no CPU offload", "The strategy was kept as asked", instead)
    assert re.search(r"ddp plan reached is \d+\.\d\d MB", err), err
    assert "more GPUs" not in err  # a replica's peak does not fall with more GPUs
    assert os.listdir(out) == []


@pytest.mark.parametrize("strategy,mem,world", [("none", "3MB", 16), ("hybrid", "1.3MB", 16),
                                                ("grad-op", "1.3MB", 16), ("full", "1.1MB", 16)])
def test_other_strategies_offload_within_their_own_strategy(tmp_path, capsys, strategy, mem,
                                                            world):
    """Where only offload fits, the offloaded plan keeps the strategy asked for (these once came
    back as fully sharded plans for none, hybrid and grad-op)."""
    plan = tmp_path / "p.yaml"
    assert main([*TINY, "--mem", mem, "--world-size", str(world), "--strategy", strategy,
                 "--allow-offload", "--plan", str(plan)]) == 0, capsys.readouterr().err
    document = yaml.safe_load(plan.read_text())
    assert document["strategy"] == strategy
    assert document["offload"] == {"params": True, "optimizer": True}
    assert document["predicted"]["peak_bytes"] <= int(float(mem[:-2]) * 10**6)


def test_an_explicit_strategy_that_cannot_fit_even_offloaded_names_itself(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    err = fails(capsys, [*TINY, "--mem", "1.1MB", "--world-size", "16", "--strategy", "grad-op",
                         "--allow-offload", "--plan", str(out / "p.yaml")], 3,
                "no --strategy grad-op plan fits", "smallest peak any --strategy grad-op plan",
                "Even CPU offload (--allow-offload) does not fit")
    assert "(--allow-offload: FSDP2" not in err  # not suggested again: it was given
    assert os.listdir(out) == []


# --- S3-09: integers past Python's 4,300-digit limit --------------------------------------

def test_a_model_arg_past_the_int_digit_limit_is_bad_input_before_any_work(tmp_path, capsys):
    marked = tmp_path / "model.py"
    marked.write_text(PLANTED)
    err = fails(capsys, [str(marked), "--mem", "80GB", "--model-arg", "size=" + "9" * 5000,
                         "--plan", str(tmp_path / "p.yaml")], 2,
                "--model-arg size=99999999999999999999...99999999", "5,000 characters",
                "too long for Python to read as an integer", "4300 digits",
                "quote it to pass it as text")
    assert "set_int_max_str_digits" not in err  # Python's hint is for programmers, not users
    assert sorted(os.listdir(tmp_path)) == ["model.py"]  # not imported, nothing written


def test_an_hf_config_number_past_the_int_digit_limit_is_bad_input(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_layer": ' + "9" * 5000 + "}")
    fails(capsys, ["--hf-config", str(config), "--mem", "80GB", "--plan",
                   str(tmp_path / "p.yaml")], 2,
          f"Hugging Face config {str(config)!r} holds a number too long to read",
          "4300 digits", "Fix the value")
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


# --- S3-10: any accepted --global-batch-size answers -----------------------------------------

def test_divisors_by_trial_division_to_the_square_root():
    from fsdp_plan.search.batching import divisors
    for n in range(1, 3000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(2**44) == [2**i for i in range(45)]  # the largest accepted global batch
    assert divisors(17592186044399) == [1, 17592186044399]  # a prime near it


@pytest.mark.parametrize("global_batch,world,seq_len,count", [
    (2**40, 8, 64, 8), (2**44, 1, 1, 1), (720720, 1, 1, 20), (2**40, 2**20, 4096, 21)])
def test_micro_batches_tried_are_bounded_whatever_the_global_batch(global_batch, world, seq_len,
                                                                   count):
    """Divisors of the per-rank batch that a plan can hold (at most 2^24 samples and 2^32
    tokens a micro-batch, 2^20 accumulation steps), each at least twice the last."""
    from types import SimpleNamespace

    from fsdp_plan.common.limits import MAX_BATCH_SIZE, MAX_GRAD_ACCUM_STEPS, MAX_TOKENS
    from fsdp_plan.search.batching import divisors, micro_batch_sizes
    request = SimpleNamespace(global_batch_size=global_batch, world_size=world,
                              source=SimpleNamespace(seq_len=seq_len))
    sizes = micro_batch_sizes(request)
    per_rank = global_batch // world
    allowed = [b for b in divisors(per_rank) if b <= MAX_BATCH_SIZE
               and b * seq_len <= MAX_TOKENS and per_rank // b <= MAX_GRAD_ACCUM_STEPS]
    assert len(sizes) == count and set(sizes) <= set(allowed)
    assert sizes[0] == allowed[0] and sizes[-1] == allowed[-1]  # both ends are always tried
    assert all(later >= 2 * earlier for earlier, later in itertools.pairwise(sizes[:-1]))


@pytest.mark.parametrize("global_batch,world,seq_len", [(17592186044399, 1, 64),
                                                        (2**44, 1, 4096)])
def test_a_global_batch_no_micro_batch_can_hold_is_bad_input(global_batch, world, seq_len,
                                                             tmp_path, capsys):
    marked = tmp_path / "model.py"
    marked.write_text(PLANTED)
    fails(capsys, [str(marked), "--mem", "80GB", "--world-size", str(world), "--seq-len",
                   str(seq_len), "--global-batch-size", str(global_batch), "--plan",
                   str(tmp_path / "p.yaml")], 2,
          f"--global-batch-size {global_batch} over {world} ranks",
          "at most 1,048,576 accumulation steps", "can be the micro-batch")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]  # refused before the model was imported


def test_a_global_batch_of_2_to_the_40_answers_with_the_micro_batch_it_needs(tmp_path, capsys):
    """2^37 samples per rank need micro-batches of at least 2^17 (2^20 accumulation steps at
    most): exit 3 saying so, after one analysis, not a count to 2^37."""
    out = tmp_path / "out"
    out.mkdir()
    fails(capsys, [LLAMA, "--model-arg", "size=tiny", "--mem", "2MB", "--headroom", "0",
                   "--seq-len", "64", "--strategy", "full", "--world-size", "8",
                   "--global-batch-size", str(2**40), "--plan", str(out / "p.yaml")], 3,
          "no --strategy full plan fits", "(137,438,953,472 samples per rank)",
          "the smallest micro-batch is 131,072 x 1,048,576 accumulation steps")
    assert os.listdir(out) == []


# --- S3-26: --batch-size N with --global-batch-size is the micro-batch ----------------------

def test_batch_size_with_a_global_batch_is_the_micro_batch(tmp_path, capsys):
    """As DeepSpeed and torchtitan read both: micro-batch N, accumulation makes up the rest."""
    path = tmp_path / "p.yaml"
    assert main([LLAMA, "--model-arg", "size=tiny", "--seq-len", "32", "--mem", "6MB",
                 "--world-size", "2", "--strategy", "full", "--global-batch-size", "16",
                 "--batch-size", "2", "--plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "why: micro-batch 2 as --batch-size gives, x 4 accumulation step(s)" in out
    document = yaml.safe_load(path.read_text())
    assert document["model"]["batch_size"] == 2 and document["grad_accum_steps"] == 4
    assert document["predicted"]["global_batch_size"] == 16


@pytest.mark.parametrize("flags,needles", [
    (["--global-batch-size", "16", "--batch-size", "3"],
     ["--batch-size 3 does not divide the 8 samples each rank takes per step",
      "e.g. --batch-size 1", "leave --batch-size out"]),
    (["--global-batch-size", "24", "--batch-size", "16"],
     ["--batch-size 16 does not divide the 12 samples", "e.g. --batch-size 4"]),
    (["--global-batch-size", str(2**40), "--batch-size", "4"],
     ["needs 137,438,953,472 accumulation steps, more than 1,048,576"]),
])
def test_batch_size_that_cannot_make_up_the_global_batch_is_refused_before_any_work(
        tmp_path, capsys, flags, needles):
    marked = tmp_path / "model.py"
    marked.write_text(PLANTED)
    fails(capsys, [str(marked), "--mem", "80GB", "--world-size", "2", *flags, "--plan",
                   str(tmp_path / "p.yaml")], 2, *needles)
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


# --- S3-24: a model path that is not valid text --------------------------------------------

@pytest.mark.parametrize("argv", [
    lambda model: [model, "--mem", "1GB", "--plan", "p.yaml"],
    lambda model: ["predict", BUNDLED, model],
    lambda model: ["--hf-config", model[:-3] + ".json", "--mem", "1GB"],
])
def test_a_model_path_with_undecodable_bytes_is_bad_input(tmp_path, argv):
    name = b"m\xff.py"
    with open(os.path.join(os.fsencode(str(tmp_path)), name), "w") as f:
        f.write(PLANTED)
    before = sorted(os.listdir(os.fsencode(str(tmp_path))))
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main",
                           *argv(os.fsdecode(name))], capture_output=True, cwd=tmp_path,
                          timeout=300, env=ENV, check=False)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, err
    assert "Traceback" not in err and "UnicodeEncodeError" not in err and done.stdout == b""
    assert "path 'm\\xff.py' is not valid text" in err or "path 'm\\xff.json' is" in err, err
    assert "Rename the file" in err
    assert sorted(os.listdir(os.fsencode(str(tmp_path)))) == before  # not imported, no plan


# --- the model's code and the process: exits, threads, forks, descriptor 1 -----------------

SMALL = """\
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

def example_inputs(batch_size, seq_len):
    return (torch.randn(batch_size, 8),)
"""


def cli(argv: list[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """``fsdp-plan ARGV`` as the console script runs it (entry(), not main())."""
    return subprocess.run([sys.executable, "-c", "from fsdp_plan.cli.main import entry; entry()",
                           *argv], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=ENV, check=False)


@pytest.fixture
def small_plan(tmp_path_factory):
    """A plan of SMALL at world size 2 without its code digest, so a model file of the same
    shape with other code (one that exits, forks, prints) can be given as MODEL."""
    folder = tmp_path_factory.mktemp("small")
    (folder / "small.py").write_text(SMALL)
    path = folder / "plan.yaml"
    assert main([str(folder / "small.py"), "--mem", "1GB", "--world-size", "2", "--seq-len",
                 "8", "--strategy", "full", "--plan", str(path)]) == 0
    document = yaml.safe_load(path.read_text())
    del document["model"]["digest"]
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.mark.parametrize("verb,where,code", [
    ("plan", "import", "import os\nos._exit(0)\n" + SMALL),
    ("plan", "build_model()", SMALL.replace("def build_model():\n",
                                            "def build_model():\n    import os; os._exit(0)\n")),
    ("predict", "build_model()", SMALL.replace("def build_model():\n",
                                               "def build_model():\n    import os; os._exit(0)\n")),
    ("verify", "loss_fn(output)",
     SMALL + "\ndef loss_fn(output):\n    import os\n    os._exit(0)\n"),
])
def test_os_exit_in_model_code_is_bad_input_not_a_silent_success(tmp_path, small_plan, capsys,
                                                                   verb, where, code):
    model = tmp_path / "model.py"
    model.write_text(code)
    argv = ([str(model), "--mem", "1GB", "--seq-len", "8", "--plan", str(tmp_path / "p.yaml")]
            if verb == "plan" else [verb, str(small_plan), str(model)])
    done = cli(argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "called os._exit(0)" in done.stderr and "Traceback" not in done.stderr
    assert "would end fsdp-plan at once with nothing planned or checked" in done.stderr
    assert ("importing model file" if where == "import" else where) in done.stderr
    assert "model.py line" in done.stderr  # the user's line is named
    assert done.stdout == "" and sorted(os.listdir(tmp_path)) == ["model.py"]


def test_os_exit_outside_model_code_is_the_real_one():
    """Only the planner's own process is guarded while user code runs: outside that, os._exit
    is the real one."""
    from fsdp_plan.model.user_process import UserExit, process_guarded
    with pytest.raises(UserExit) as caught, process_guarded():
        os._exit(3)
    assert caught.value.code == 3 and os._exit.__module__ == "posix"


NOISY = """\
import atexit, os, sys, threading, time
print("PRINTED")
os.write(1, b"FD-ONE\\n")
sys.__stdout__.write("DUNDER-STDOUT\\n")
sys.__stdout__.flush()
atexit.register(lambda: print("ATEXIT-PRINT"))
atexit.register(lambda: os.write(1, b"ATEXIT-FD\\n"))

def tick():
    while True:
        print("TICK", flush=True)
        time.sleep(0.05)

threading.Thread(target=tick, daemon=True).start()
""" + SMALL


@pytest.mark.parametrize("verb", ["plan", "predict", "verify", "bench"])
def test_json_is_alone_on_stdout_whatever_the_model_writes(tmp_path, small_plan, verb):
    """S3-16 (os.write(1), sys.__stdout__, atexit, a model's thread) and S3-15 (bench)."""
    model = tmp_path / "noisy.py"
    model.write_text(NOISY)
    argv = {"plan": [str(model), "--mem", "1GB", "--seq-len", "8", "--world-size", "2"],
            "predict": ["predict", str(small_plan), str(model)],
            "verify": ["verify", str(small_plan), str(model)],
            "bench": ["bench", str(small_plan), str(model), "--nproc", "2", "--steps", "2",
                      "--warmup", "1", "--out", str(tmp_path / "results")]}[verb]
    done = cli([*argv, "--format", "json"], tmp_path)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # one JSON document and nothing else
    assert isinstance(document, dict) and "Traceback" not in done.stderr
    for word in ("PRINTED", "FD-ONE", "DUNDER-STDOUT", "ATEXIT-PRINT", "ATEXIT-FD"):
        assert word in done.stderr, word


def test_a_model_that_forks_at_import_plans_once(tmp_path):
    """S3-32: the child that os.fork() makes comes back into the planner and ends there; only
    the original process plans, writes and prints."""
    model = tmp_path / "forks.py"
    # one write(2) each, so the two processes' lines cannot interleave
    model.write_text("import os\nos.write(2, b'FORKED %d\\n' % (os.fork() == 0))\n" + SMALL)
    done = cli([str(model), "--mem", "1GB", "--seq-len", "8", "--plan", "p.yaml"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "FORKED 1" in done.stderr and "FORKED 0" in done.stderr  # both imported it
    assert done.stderr.count("fsdp-plan: wrote p.yaml") == 1, done.stderr
    assert done.stdout.count("chosen:") == 1 and "Traceback" not in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["forks.py", "p.yaml"]


def _alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by its new parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("verb", ["plan", "bench"])
def test_processes_the_model_forks_do_not_outlive_the_command(tmp_path, small_plan, verb):
    """S3-33: a child forked by the model that never returns (it sleeps) is ended when the
    command is done, in the planner and in every bench worker; else it held the output pipes
    open and the command's caller waited for it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    model = work / "sleeper.py"
    model.write_text(f"""\
import os, time
if os.fork() == 0:
    open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
    time.sleep(600)
""" + SMALL)
    argv = ([str(model), "--mem", "1GB", "--seq-len", "8", "--world-size", "2"]
            if verb == "plan" else ["bench", str(small_plan), str(model), "--nproc", "2",
                                    "--steps", "2", "--warmup", "1", "--out", "results"])
    try:
        done = cli(argv, work, timeout=400)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        started = [int(p) for p in os.listdir(pids)]
        assert len(started) == (1 if verb == "plan" else 3)  # the planner (and each worker)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        for pid in (int(p) for p in os.listdir(pids)):
            if _alive(pid):
                os.kill(pid, 9)


@pytest.mark.parametrize("verb", ["plan", "predict"])
def test_a_thread_the_model_leaves_running_does_not_hold_up_the_exit(tmp_path, small_plan,
                                                                     verb):
    """S3-23: the plan is written and the process ends with its own exit code, saying so,
    instead of waiting forever for a non-daemon thread the model started."""
    work = tmp_path / "work"
    work.mkdir()
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    model = work / "threads.py"
    model.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(600,), "
                     "name='model-sleeper').start()\n" + SMALL)
    argv = ([str(model), "--mem", "1GB", "--seq-len", "8", "--world-size", "2", "--plan",
             "p.yaml"] if verb == "plan" else ["predict", str(small_plan), str(model)])
    done = subprocess.run([sys.executable, "-c", "from fsdp_plan.cli.main import entry; entry()",
                           *argv, "--format", "json"], capture_output=True, text=True, cwd=work,
                          timeout=300, env={**ENV, "TMPDIR": str(temporary)}, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) and "Traceback" not in done.stderr
    assert "left 1 thread(s) running ('model-sleeper')" in done.stderr
    assert "does not wait for them and exits with code 0" in done.stderr
    assert sorted(os.listdir(work)) == (["p.yaml", "threads.py"] if verb == "plan"
                                        else ["threads.py"])
    # torch's own compile cache folder appears on any run; nothing of fsdp-plan's is left
    assert [n for n in os.listdir(temporary) if n != "torchinductor_root"] == []


@pytest.mark.parametrize("with_torch", [False, True])
def test_the_end_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path, with_torch):
    """[Note: ending the process]: with torch imported or not (a plan from cached facts), the
    process ends by ``os._exit`` after the ``atexit`` handlers ran and the buffered report was
    flushed, with the command's exit code."""
    flag = tmp_path / "handlers-ran"
    code = ("import atexit, sys\n"
            + ("import torch\n" if with_torch else "")
            + "from fsdp_plan.cli.process import end_process\n"
            "atexit.register(lambda: open(sys.argv[1], 'w').write('ran'))\n"
            "sys.stdout.write('the report, still buffered')\n"
            "assert ('torch' in sys.modules) == " + str(with_torch) + "\n"
            "end_process(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(flag)], capture_output=True,
                          text=True, timeout=120, env=ENV, check=False)
    assert (done.returncode, done.stdout) == (3, "the report, still buffered"), done.stderr
    assert flag.read_text() == "ran" and "Traceback" not in done.stderr


def test_a_lingering_thread_keeps_a_failures_exit_code(tmp_path):
    model = tmp_path / "threads.py"
    model.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(600,))"
                     ".start()\n" + SMALL)
    done = cli([str(model), "--mem", "1kB", "--seq-len", "8", "--plan", "p.yaml"], tmp_path)
    assert done.returncode == 3, done.stderr
    assert "no plan fits" in done.stderr and "exits with code 3" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["threads.py"]


def test_a_thread_printing_while_the_report_closes_does_not_crash_the_planner():
    """[Note: streams taken off sys.stdout stay alive]: a model's thread in print() while the
    main thread takes the report off ``sys.stdout`` wrote through a freed stream (a segfault
    at exit; this script failed 6 runs in 6 before the fix). Each cycle is one command's open
    and close; the thread's lines all reach stderr, the first report stdout."""
    code = ("import sys, threading\n"
            "from fsdp_plan.cli.process import ReportChannel, end_process\n"
            "opened = threading.Event()\n"
            "def tick():\n"
            "    opened.wait()\n"  # as in a command: the model runs with the report open
            "    while True:\n"
            "        print('TICK', flush=True)\n"
            "threading.Thread(target=tick, daemon=True).start()\n"
            "for _ in range(2000):\n"
            "    channel = ReportChannel()\n"
            "    channel.open()\n"
            "    opened.set()\n"
            "    print('report')\n"
            "    channel.close()\n"
            "print('done', file=sys.stderr)\n"
            # as a command ends: no interpreter shutdown under a printing daemon thread, which
            # CPython may abort ('could not acquire lock for <stderr> at interpreter shutdown')
            "end_process(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=ENV, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # descriptor 1 stays on stderr after the first command, so only its report is on stdout
    assert done.stdout == "report\n" and "done" in done.stderr  # its newline may come later
    assert re.sub("TICK|report|done", "", done.stderr).strip() == "", done.stderr[-2000:]
