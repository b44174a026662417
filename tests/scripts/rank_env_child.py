"""What C code and child processes see of a rank's environment: torchrun's variables and the ones
the script sets (torchrun: each rank's own, in getenv, a child process and a shell)."""
import ctypes
import os
import subprocess
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
os.environ["MY_SETTING"] = f"v{rank}"
os.environ.pop("SIMCOMM_TEST_UNSET_ME", None)
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
c_rank = libc.getenv(b"RANK").decode()
c_setting = libc.getenv(b"MY_SETTING").decode()
dist.barrier()                                  # the other rank runs in between
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['RANK'], os.environ['MY_SETTING'], "
                        "os.environ.get('SIMCOMM_TEST_UNSET_ME', '-'))"],
                       capture_output=True, text=True, check=True).stdout.split()
shell = subprocess.run("echo $LOCAL_RANK-$MY_SETTING", shell=True, capture_output=True, text=True).stdout.strip()
print(f"rank{rank}: c_rank={c_rank} c_setting={c_setting} child_rank={child[0]} child_setting={child[1]} "
      f"child_unset={child[2]} shell={shell}", flush=True)
dist.destroy_process_group()
