"""Two processes that end while a gloo worker still holds a collective: `accelerate launch ... exit_mid_collective.py`.
Process 0 starts an all-reduce and drops both its tensor and its work handle, so that its gloo worker is the
tensor's last owner; it destroys its process group by hand (as a script that leaves cleanly does) while keeping the
group object alive (as a DDP model does: the destroy then joins no worker), and holds the GIL (a busy loop, no thread
switch, no I/O) for 2 s, then ends. Process 1 joins the all-reduce after 0.5 s: process 0's worker completes it and
waits for the GIL to free the tensor's Python object, and nothing of process 0's script lets it in. It must get the
GIL before the interpreter's teardown: asked for during it, Python ends the thread mid-unwind and the process aborts
("terminate called without an active exception", SIGABRT)."""

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from accelerate import PartialState

from hgpo_trl.runtime.collective import leave_at_exit

KEPT_GROUPS = []  # (alive until the interpreter's teardown)


def main() -> None:
    state = PartialState(cpu=True)  # (gloo, as every multi-process run here)
    leave_at_exit()  # (what HGPOTrainer registers)
    if state.process_index == 0:
        torch.distributed.all_reduce(torch.ones(1000), async_op=True)  # (the tensor and the work dropped at once)
        KEPT_GROUPS.append(torch.distributed.group.WORLD)
        torch.distributed.destroy_process_group()
        sys.setswitchinterval(100.0)  # (the busy loop below keeps the GIL)
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            pass
    else:
        time.sleep(0.5)
        torch.distributed.all_reduce(torch.ones(1000))


if __name__ == "__main__":
    main()
