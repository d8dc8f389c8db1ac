"""The dependency rules, written once: what each action needs and what it makes.

``validate``, ``simulate``, the lowering passes (the unit-time run, where a product is sent, whom
an early receive comes from), the ZB-V list schedule, measured message latency and the
``auto_schedule`` search (its evaluation, list scheduler and CP-SAT model) read these tables; none
states a rule of its own. :meth:`Dependencies._rows` is the one statement of the rules, DESIGN.md
§2's (docs/semantics.md, "Dependencies"); everything else here is derived from it:

- F(s,m) needs the forward output of (s-1,m);
- B(s,m) and I(s,m) need F(s,m) and, unless s is the last stage, the input-gradient of (s+1,m),
  made by B or I; W(s,m) needs I(s,m);
- in a lowered schedule a product crosses ranks only as a message: a SEND needs its producer, a
  consumer on another rank needs the message sent and its own RECV.

Everything is a *key* in one numbering over ``SM`` = stages × microbatches cells (``s*M + m``):

- ``F_DONE*SM + cell``, ``X_DONE*SM + cell``, ``W_DONE*SM + cell``: the compute parts' products
  (X is the input-gradient, made by B or I). A producer's *node* is its F or X key.
- ``SENT*SM + node`` and ``RECEIVED*SM + node`` (two blocks each, for the F and X nodes): the
  message carrying ``node``'s product, sent and received.

A rule is a template per (action kind, stage) with the microbatch left out: the keys are
``base + m``. Plain integers keep every consumer linear and fast on schedules with hundreds of
thousands of actions.
"""

# ruff: noqa: N806 - S, M, SM: stages, microbatches, their product (the papers' notation)

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.actions import Action, ActionKind

__all__ = [
    "CODE",
    "F_DONE",
    "NUM_KEY_BLOCKS",
    "RECEIVED",
    "SENT",
    "W_DONE",
    "X_DONE",
    "Dependencies",
    "Ids",
    "kind_code",
]

F_DONE, X_DONE, W_DONE, SENT, RECEIVED = 0, 1, 2, 3, 5
NUM_KEY_BLOCKS = 7  # F, X, W; SENT (2 blocks: F and X nodes); RECEIVED (2 blocks)

# Kind codes by kind (an ActionKind is a str: the member and its value look up alike, hashed in C).
C_F, C_B, C_I, C_W, C_OVERLAP, C_SEND_F, C_SEND_B, C_RECV_F, C_RECV_B, C_UNSHARD, C_RESHARD, C_REDUCE = range(12)
CODE: dict[str, int] = {
    "F": C_F,
    "B": C_B,
    "I": C_I,
    "W": C_W,
    "OVERLAP_F_B": C_OVERLAP,
    "SEND_F": C_SEND_F,
    "SEND_B": C_SEND_B,
    "RECV_F": C_RECV_F,
    "RECV_B": C_RECV_B,
    "UNSHARD": C_UNSHARD,
    "RESHARD": C_RESHARD,
    "REDUCE_GRAD": C_REDUCE,
}
_NUM_RULED = C_RECV_B + 1  # kinds with a template (OVERLAP_F_B's is its parts')

# Which SEND and RECV carry a product (torch's names): F products as _F, input-gradients as _B.
_CARRIERS = ((ActionKind.SEND_F, ActionKind.RECV_F), (ActionKind.SEND_B, ActionKind.RECV_B))

Need = tuple[int, bool]
"""(key base, crosses ranks): the key is ``base + m``; a crossing need waits for the message latency."""


def kind_code(kind: ActionKind) -> int:
    return CODE[kind]


class Dependencies:
    """The rules for one layout: ``needs[code][s]`` and ``makes[code][s]`` per kind code and stage.

    ``lowered``: cross-rank inputs are messages (SENT + RECEIVED keys) rather than the producer's
    product. Same-rank inputs are the producer's product either way. The rows built in
    :meth:`_rows` are the only statement of the rules; everything else here is derived from them:
    which stage a product feeds (``feeds``), which stage an input comes from (``fed_by``), whether
    a product leaves its rank (``sends``), which SEND/RECV carry it (``outgoing``), and what a SEND
    or RECV carries (:meth:`route`).
    """

    __slots__ = (
        "M",
        "S",
        "SM",
        "fed_by",
        "feeds",
        "lowered",
        "make_key",
        "makes",
        "need_keys",
        "needs",
        "outgoing",
        "rank_of",
        "routes",
        "sends",
    )

    def __init__(self, num_stages: int, num_microbatches: int, rank_of: Sequence[int], *, lowered: bool) -> None:
        S, M = num_stages, num_microbatches
        SM = S * M
        self.S, self.M, self.SM = S, M, SM
        self.rank_of = list(rank_of)
        self.lowered = lowered
        self.needs: list[list[tuple[Need, ...]]] = [[] for _ in range(_NUM_RULED)]
        self.makes: list[list[tuple[int, ...]]] = [[] for _ in range(_NUM_RULED)]
        # Products (F, X) by stage: the other stage whose part needs it, and for each stage's F
        # and X, the other stage whose product it needs (-1: none).
        self.feeds = [[-1] * S, [-1] * S]
        self.fed_by = [[-1] * S, [-1] * S]
        for s in range(S):
            for code, (need, make) in enumerate(self._rows(s, lowered)):
                self.needs[code].append(need)
                self.makes[code].append(make)
            for block, code in ((F_DONE, C_F), (X_DONE, C_I)):
                for key, _ in self._rows(s, False)[code][0]:
                    producer_block, producer_stage = key // SM, key % SM // M
                    if producer_block == block and producer_stage != s:
                        self.feeds[block][producer_stage] = s
                        self.fed_by[block][s] = producer_stage
        # The same without the crossing flags, and a compute part's one product, for hot loops.
        self.need_keys = [[tuple(key for key, _ in row) for row in rows] for rows in self.needs]
        self.make_key = [[row[0] if row else -1 for row in rows] for rows in self.makes]
        r = self.rank_of
        leaves = [[d >= 0 and r[d] != r[s] for s, d in enumerate(self.feeds[b])] for b in (F_DONE, X_DONE)]
        self.sends: list[list[bool]] = [leaves[0], leaves[1], leaves[1], [False] * S]  # F, B, I, W
        # Which SEND and RECV carry a product that leaves its rank (torch's names: _F for forward
        # outputs, _B for input-gradients), and to which stage.
        carriers = _CARRIERS
        out = [[(*carriers[b], self.feeds[b][s]) if leaves[b][s] else None for s in range(S)] for b in (F_DONE, X_DONE)]
        self.outgoing: list[list[tuple[ActionKind, ActionKind, int] | None]] = [out[0], out[1], out[1]]
        # route() as templates per SEND/RECV kind and stage: (node base, source, destination).
        self.routes: dict[str, list[tuple[int, int, int]]] = {}
        for b, (send, recv) in enumerate(carriers):
            self.routes[send] = [(b * SM + s * M, s, self.feeds[b][s]) for s in range(S)]
            self.routes[recv] = [(b * SM + self.fed_by[b][s] * M, self.fed_by[b][s], s) for s in range(S)]

    def _rows(self, s: int, lowered: bool) -> list[tuple[tuple[Need, ...], tuple[int, ...]]]:
        """What each kind of action on stage ``s`` needs and makes (DESIGN.md §2), by kind code."""
        S, M, SM = self.S, self.M, self.SM
        cell = s * M
        fwd_in = self._input(s, F_DONE * SM + cell - M, lowered) if s > 0 else ()
        grad_in = self._input(s, X_DONE * SM + cell + M, lowered) if s < S - 1 else ()
        own_f = ((F_DONE * SM + cell, False),)
        return [
            (fwd_in, (F_DONE * SM + cell,)),  # F: the output of s-1
            (own_f + grad_in, (X_DONE * SM + cell,)),  # B: its forward, the input-gradient of s+1
            (own_f + grad_in, (X_DONE * SM + cell,)),  # I: the same
            (((X_DONE * SM + cell, False),), (W_DONE * SM + cell,)),  # W: its I
            ((), ()),  # OVERLAP_F_B: its parts' rules
            (((F_DONE * SM + cell, False),), (SENT * SM + F_DONE * SM + cell,)),  # SEND_F
            (((X_DONE * SM + cell, False),), (SENT * SM + X_DONE * SM + cell,)),  # SEND_B
            ((), (RECEIVED * SM + F_DONE * SM + cell - M,)),  # RECV_F: the output of s-1
            ((), (RECEIVED * SM + X_DONE * SM + cell + M,)),  # RECV_B: the input-gradient of s+1
        ]

    def _input(self, stage: int, producer: int, lowered: bool) -> tuple[Need, ...]:
        """How a part on ``stage`` waits for ``producer``'s product: directly, or (lowered, from
        another rank) as a message sent and received."""
        crosses = self.rank_of[producer % self.SM // self.M] != self.rank_of[stage]
        if crosses and lowered:
            return ((SENT * self.SM + producer, True), (RECEIVED * self.SM + producer, False))
        return ((producer, crosses),)

    @property
    def num_keys(self) -> int:
        return NUM_KEY_BLOCKS * self.SM

    def part_needs(self, part: Action) -> list[int]:
        """The keys a compute part waits for."""
        m = part.microbatch
        assert m is not None
        return [base + m for base, _ in self.needs[CODE[part.kind]][part.stage]]

    def part_makes(self, part: Action) -> list[int]:
        m = part.microbatch
        assert m is not None
        return [base + m for base in self.makes[CODE[part.kind]][part.stage]]

    def flat(
        self, codes: Sequence[int], *, cross_offset: int = 0
    ) -> tuple[list[int], list[int], list[bool], list[bool], list[int]]:
        """Per-action tables for compute-only search: for action number ``j*SM + s*M + m`` of the
        ``j``-th kind code in ``codes``: its first and second need (-1: none), whether each crosses
        ranks, and what it makes. Unlowered rules only: a lowered input is two keys.
        ``cross_offset`` is added to the keys of needs that cross ranks (validate waits for a
        lowered schedule's crossing input as its message received: ``RECEIVED * SM`` on)."""
        return self._flat(codes, cross_offset, True)

    def flat_needs(self, codes: Sequence[int], *, cross_offset: int = 0) -> tuple[list[int], list[int]]:
        """The first two tables of :meth:`flat` alone (validate's run reads nothing else)."""
        need1, need2, _, _, _ = self._flat(codes, cross_offset, False)
        return need1, need2

    def _flat(
        self, codes: Sequence[int], cross_offset: int, full: bool
    ) -> tuple[list[int], list[int], list[bool], list[bool], list[int]]:
        assert not self.lowered, "flat tables hold at most two needs per action: use unlowered rules"
        S, M, SM = self.S, self.M, self.SM
        size = len(codes) * SM
        need1, need2 = [-1] * size, [-1] * size
        cross1, cross2 = ([False] * size, [False] * size) if full else ([], [])
        made = [-1] * size if full else []
        for j, code in enumerate(codes):
            for s in range(S):
                base = j * SM + s * M
                for (key, crosses), keys, flags in zip(
                    self.needs[code][s], (need1, need2), (cross1, cross2), strict=False
                ):
                    if crosses:
                        key += cross_offset
                    keys[base : base + M] = range(key, key + M)
                    if full:
                        flags[base : base + M] = [crosses] * M
                if full:
                    made[base : base + M] = range(self.make_key[code][s], self.make_key[code][s] + M)
        return need1, need2, cross1, cross2, made

    def route(self, action: Action) -> tuple[int, int, int]:
        """(producer node, producing stage, consuming stage) of the message a SEND or RECV carries;
        a stage is -1 at the pipeline's ends (a first stage receives no forward input)."""
        node, src, dst = self.routes[action.kind][action.stage]
        return node + action.microbatch, src, dst  # type: ignore[operator]

    def carried(self, action: Action) -> int:
        """The producer node whose product a SEND or RECV carries; -1 where no stage makes it."""
        node, src, dst = self.route(action)
        return node if src >= 0 and dst >= 0 else -1

    def message_actions(self, node: int) -> tuple[Action, Action]:
        """The (SEND, RECV) pair carrying ``node``'s product to the stage it feeds."""
        block, cell = divmod(node, self.SM)
        stage, m = divmod(cell, self.M)
        send, recv = _CARRIERS[block]
        return Action(stage, send, m), Action(self.feeds[block][stage], recv, m)

    def consumer(self, node: int) -> int:
        """The compute node on another stage that consumes ``node``'s product (F or X)."""
        block, cell = divmod(node, self.SM)
        stage, m = divmod(cell, self.M)
        return block * self.SM + self.feeds[block][stage] * self.M + m


class Ids:
    """Node numbering for ``num_stages`` × ``num_microbatches`` (the keys above): ``F`` at
    ``s*M + m``, ``X`` at ``SM + s*M + m``, ``W`` at ``2SM + s*M + m``. A message is named by the
    node whose product it carries (:meth:`Dependencies.message_actions`).
    """

    __slots__ = ("M", "S", "SM")

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.S = num_stages
        self.M = num_microbatches
        self.SM = num_stages * num_microbatches

    def node_action(self, node: int) -> Action:
        """The compute action a node stands for (X is written as B; callers refine it)."""
        group, rest = divmod(node, self.SM)
        stage, mb = divmod(rest, self.M)
        return Action(stage, (ActionKind.F, ActionKind.B, ActionKind.W)[group], mb)
