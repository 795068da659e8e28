"""The order in which a neighbour sends to this rank. NCCL has no tags: a pair's messages match in
the order they are issued. So a rank must post its receives from each neighbour in exactly the
order that neighbour sends, whatever order it needs them in. Every rank can derive every rank's
action list from the schedule, hence each neighbour's send order (Megatron's P2P works the same
way: both sides of a pair follow one schedule)."""
from collections import deque

from .exchange import ACTIVATION, GRADIENT

FORWARD, BACKWARD = "F", "B"      # the two kinds of action of a schedule


def sends_to(actions, sender, receiver, pp, virtual):
    """The (kind, receiving stage, micro-batch) of every message pipeline rank `sender` sends to
    pipeline rank `receiver` while it runs `actions`, in its order. Stage c * PP + r is virtual
    stage c of rank r; activations go to the next stage, gradients to the previous one."""
    last_stage = pp * virtual - 1
    found = []
    for kind, chunk, micro_batch in actions:
        stage = chunk * pp + sender
        if kind == FORWARD and stage != last_stage and (sender + 1) % pp == receiver:
            found.append((ACTIVATION, stage + 1, micro_batch))
        elif kind == BACKWARD and stage != 0 and (sender - 1) % pp == receiver:
            found.append((GRADIENT, stage - 1, micro_batch))
    return found


class ReceiveOrder:
    """For each neighbour of this rank, the messages it will send here, not yet posted."""

    def __init__(self, actions_of, pp_rank, pp, virtual):
        """actions_of(pipeline rank) -> that rank's action list."""
        self.pp_rank, self.pp = pp_rank, pp
        neighbours = {(pp_rank - 1) % pp, (pp_rank + 1) % pp} - {pp_rank}
        self.pending = {peer: deque(sends_to(actions_of(peer), peer, pp_rank, pp, virtual))
                        for peer in neighbours}

    def sender(self, key):
        """The pipeline rank that sends message `key`: the previous one an activation."""
        return (self.pp_rank + (-1 if key[0] == ACTIVATION else 1)) % self.pp

    def up_to(self, key):
        """The messages the sender of `key` sends before it (to be posted first, in this order);
        `key` itself is taken off the list too."""
        queue, earlier = self.pending[self.sender(key)], []
        while queue and queue[0] != key:
            earlier.append(queue.popleft())
        if not queue:
            raise RuntimeError(f"pipeline message {key} is not among those rank {self.sender(key)} sends")
        queue.popleft()
        return earlier
