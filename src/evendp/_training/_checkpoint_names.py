"""Each checkpoint format's name in ``out_dir``, in one place: the formats' classes and the
strategy registry read it (the registry without torch: ``evendp train``'s launcher).

>>> WHOLE_FILE, DCP_SHARDS, DEEPSPEED_FILES
('ckpt.pt', 'ckpt.dcp', 'ckpt.ds')
"""

from __future__ import annotations

__all__ = ["DCP_SHARDS", "DEEPSPEED_FILES", "WHOLE_FILE"]

#: One file rank 0 writes (one process, DDP, zero1).
WHOLE_FILE = "ckpt.pt"
#: A torch.distributed.checkpoint folder every rank writes into (FSDP2).
DCP_SHARDS = "ckpt.dcp"
#: DeepSpeed's own checkpoint folder (every rank writes its part).
DEEPSPEED_FILES = "ckpt.ds"
