"""A background thread does the rank's all_reduce and reads its environment (torchrun: [3.0, 3.0])."""
import os
import threading

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
seen = {}


def work():
    value = torch.full((2,), float(rank + 1))
    dist.all_reduce(value)
    seen["reduced"] = value.tolist()
    seen["env_rank"] = os.environ.get("RANK")
    seen["group_rank"] = dist.get_rank()
    print(f"rank{rank}: printed_by_thread rank_tag_check", flush=True)


thread = threading.Thread(target=work)
thread.start()
thread.join()
late = threading.Thread(target=lambda: seen.setdefault("late", dist.get_world_size()))   # joined at exit
late.start()
late.join()
print(f"rank{rank}: reduced={seen['reduced']} env_rank={seen['env_rank']} group_rank={seen['group_rank']} "
      f"world={seen['late']}", flush=True)
dist.destroy_process_group()
