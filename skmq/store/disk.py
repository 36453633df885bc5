"""The free space of the disk the embedded Redis appends its AOF to, read around stores.

Redis answers a write before appending it to the AOF (`appendfsync everysec`). When that
append fails (a full disk) the write lives in Redis's memory only until space comes
back: Redis refuses writes from then on, but what it acknowledged is lost if it dies
meanwhile, and a kill -9 of the broker takes its embedded Redis with it. So while the
disk has less than DISK_FREE_LIMIT free, the enqueue worker (skmq/workers/enqueue.py)
stores nothing, and a store that finds the disk low once Redis answered is not
acknowledged: the message may be stored, and sent again it is acked as a duplicate.
A Redis of REDIS_URL keeps its disk out of the broker's sight (README, "Delivery
guarantees").
"""

from __future__ import annotations

import os
from pathlib import Path


class DiskSpace:
    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit  # bytes; 0: never low

    def low(self) -> bool:
        """Less than the limit free (or the directory unreadable: nothing written there
        could be counted on)."""
        if not self.limit:
            return False
        try:
            st = os.statvfs(self.path)
        except OSError:
            return True
        return st.f_bavail * st.f_frsize < self.limit
