"""Host memory the learner gives back to the system as soon as torch frees it.

glibc's malloc serves a large allocation (a CPU tensor) from its own mapping and unmaps it on
free only while the allocation is above `M_MMAP_THRESHOLD`. That threshold starts at 128 KiB
and climbs (up to 32 MiB) each time such a block is freed, so once a step has freed its
activations, later ones of the same size land on the heap, and the heap's freed middle stays
with the process: at 0.5B on 2 FSDP2 ranks 1.4-1.5 GiB a rank, 0.2 of one full fp32 copy of
the train state (docs/results/learner.md). A fixed threshold (mallopt) keeps every
allocation of `MMAP_THRESHOLD` or more in a mapping of its own, unmapped when freed, and
stops the climb. Its price is a page fault per 4 KiB each time such memory is used afresh;
`omrl bench shards` measures it against glibc's default (learner.return_freed_memory)."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 64 << 10
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_freed_memory(enabled: bool) -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD bytes when `enabled`; True if it was set
    (False elsewhere: another C library, or turned off)."""
    if not enabled:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own rules
        done = False
    log.debug("freed host memory returned at once (allocations of %d KiB or more mapped): %s",
              MMAP_THRESHOLD >> 10, done)
    return done
