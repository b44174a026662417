"""Every rank polls with time.sleep for a file nobody writes, giving up after GIVE_UP_S seconds
(the first argument) with a TimeoutError (torchrun: every rank raises it; exit status 1)."""
import os
import sys
import time

give_up = time.monotonic() + float(sys.argv[1])
rank = int(os.environ["RANK"])
while not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "never-written.flag")):
    if time.monotonic() > give_up:
        raise TimeoutError(f"rank {rank}: nobody wrote the flag within {sys.argv[1]} s")
    time.sleep(0.05)
print(f"rank{rank}: found the flag", flush=True)
