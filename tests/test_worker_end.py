"""How a measuring worker ends: its process group is never destructed, and a hang report names
the main thread's frame ([Note: ending a worker's process group], measure/launch.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fsdp_plan.measure.launch import _MAIN_THREAD, _stuck_frame

_DDP_TO_ITS_END = textwrap.dedent("""
    import gc, os, sys, tempfile, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fsdp_plan.measure.worker_setup import end_worker_process_group

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    ddp = DDP(torch.nn.Linear(8, 8))
    ddp(torch.randn(4, 8)).sum().backward()
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": 0})
    dist.barrier()
    if sys.argv[1] == "kept":
        end_worker_process_group()
    else:
        time.sleep(1)  # gloo's run loop drops the last work first, or this destructor may hang
        dist.destroy_process_group()
    del ddp  # the bench worker's model went with its target's return: DDP's Reducer held the group
    gc.collect()
    threads = [open(f"/proc/self/task/{t}/comm").read().strip()
               for t in os.listdir("/proc/self/task")]
    print(sum(name.startswith("pt_gloo_runloop") for name in threads))
    os._exit(0)
""")


def _gloo_run_loops_after_the_model_went(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _DDP_TO_ITS_END, mode], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_ddp_model_freed_after_the_end_does_not_destruct_the_gloo_group():
    """``~ProcessGroupGloo`` joins gloo's run-loop threads; run from DDP's ``Reducer`` in the
    main thread with the GIL held, it deadlocked 1 bench in 10-20. After
    ``end_worker_process_group`` the model's going leaves every run loop standing: the
    destructor never ran. The plain ``destroy_process_group`` it replaced let it run (the run
    loops are gone), which is what this test would see if the group were not kept."""
    assert _gloo_run_loops_after_the_model_went("destroyed") == 0
    assert _gloo_run_loops_after_the_model_went("kept") > 0


def test_a_hang_names_the_main_threads_frame_whichever_thread_took_the_signal():
    dump = (f"{_MAIN_THREAD}0x7f085d8a1b80\n"
            "Current thread 0x00007f08466d46c0 (most recent call first):\n"
            "  <no Python frame>\n\n"
            "Thread 0x00007f0840000640 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n\n'
            "Thread 0x00007f085d8a1b80 (most recent call first):\n"
            '  File "/x/fsdp_plan/measure/launch.py", line 324 in _child_main\n'
            '  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run\n')
    assert _stuck_frame(dump) == '"/x/fsdp_plan/measure/launch.py", line 324 in _child_main'
    # a dump with no header line (or no main-thread block): the first block with a frame
    assert _stuck_frame(dump.partition("\n")[2]).endswith("line 327 in wait")
    assert _stuck_frame("") == "unknown frame"
