"""sys.stdout as a full text stream on every rank (torchrun: a TextIOWrapper)."""
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
sys.stdout.reconfigure(line_buffering=True)
sys.stdout.buffer.write(f"rank{rank}: via_buffer=True\n".encode())
sys.stdout.flush()
print(f"rank{rank}: errors={sys.stdout.errors} encoding_ok={sys.stdout.encoding.lower().replace('-', '') == 'utf8'} "
      f"fileno_int={isinstance(sys.stdout.fileno(), int)} writable={sys.stdout.writable()}")
dist.destroy_process_group()
