"""What the drain stage's owner process and its copier process (kmesh.stages.drain.client) agree on about the
shared segments: the canary around every payload and the destination bytes before a copy."""

CANARY = 4096  # bytes of canary on each side of every payload in a segment
POISON = 0xA5  # destination bytes before a copy
