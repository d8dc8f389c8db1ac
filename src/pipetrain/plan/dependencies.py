"""The dependency rules, written once: what each action needs and what it makes.

``validate``, ``simulate``, the lowering passes (their unit-time run), the ZB-V list schedule and
the ``auto_schedule`` search all read these tables; none states a rule of its own. The rules are
DESIGN.md §2's (docs/semantics.md, "Dependencies"):

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
    "carried",
    "consumer",
    "cross_rank_flags",
    "kind_code",
    "route",
]

F_DONE, X_DONE, W_DONE, SENT, RECEIVED = 0, 1, 2, 3, 5
NUM_KEY_BLOCKS = 7  # F, X, W; SENT (2 blocks: F and X nodes); RECEIVED (2 blocks)

# Kind codes, looked up by the enum's value (hashing an Enum member runs Python code).
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

_COMM_KINDS = (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)

Need = tuple[int, bool]
"""(key base, crosses ranks): the key is ``base + m``; a crossing need waits for the message latency."""


def kind_code(kind: ActionKind) -> int:
    return CODE[kind._value_]


def cross_rank_flags(rank_of: Sequence[int]) -> tuple[list[bool], list[bool]]:
    """For each stage: is the previous / next stage on another rank (a message, not memory)?"""
    n = len(rank_of)
    prev = [s > 0 and rank_of[s - 1] != rank_of[s] for s in range(n)]
    nxt = [s < n - 1 and rank_of[s + 1] != rank_of[s] for s in range(n)]
    return prev, nxt


def route(action: Action, num_stages: int, num_microbatches: int) -> tuple[int, int, int]:
    """(producer node, producing stage, consuming stage) of the message a SEND or RECV carries.

    At the pipeline's ends a stage is out of range (a first stage receives no forward input).
    """
    code, s, m, M = CODE[action.kind._value_], action.stage, action.microbatch, num_microbatches
    assert m is not None
    if code == C_SEND_F:
        return s * M + m, s, s + 1
    if code == C_RECV_F:
        return (s - 1) * M + m, s - 1, s
    SM = num_stages * M
    if code == C_SEND_B:
        return SM + s * M + m, s, s - 1
    return SM + (s + 1) * M + m, s + 1, s


def carried(action: Action, num_stages: int, num_microbatches: int) -> int:
    """The producer node whose product a SEND or RECV carries; -1 where no stage makes it."""
    node, src, dst = route(action, num_stages, num_microbatches)
    return node if 0 <= src < num_stages and 0 <= dst < num_stages else -1


def consumer(node: int, num_stages: int, num_microbatches: int) -> int:
    """The compute node on the receiving stage that consumes ``node``'s message: F(s,m) feeds
    F(s+1,m), the input-gradient X(s,m) feeds X(s-1,m)."""
    return node + num_microbatches if node < num_stages * num_microbatches else node - num_microbatches


class Dependencies:
    """The rules for one layout: ``needs[code][s]`` and ``makes[code][s]`` per kind code and stage.

    ``lowered``: cross-rank inputs are messages (SENT + RECEIVED keys) rather than the producer's
    product. Same-rank inputs are the producer's product either way. ``sends[code][s]``: whether
    the product of a compute part of that kind on stage s is needed on another rank.
    """

    __slots__ = (
        "M",
        "S",
        "SM",
        "lowered",
        "make_key",
        "makes",
        "need_keys",
        "needs",
        "next_cross",
        "outgoing",
        "prev_cross",
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
        self.prev_cross, self.next_cross = cross_rank_flags(self.rank_of)
        self.needs: list[list[tuple[Need, ...]]] = [[] for _ in range(_NUM_RULED)]
        self.makes: list[list[tuple[int, ...]]] = [[] for _ in range(_NUM_RULED)]
        for s in range(S):
            cell = s * M
            fwd_in = self._input(F_DONE * SM + cell - M, self.prev_cross[s]) if s > 0 else ()
            grad_in = self._input(X_DONE * SM + cell + M, self.next_cross[s]) if s < S - 1 else ()
            own_f = ((F_DONE * SM + cell, False),)
            rows: list[tuple[tuple[Need, ...], tuple[int, ...]]] = [
                (fwd_in, (F_DONE * SM + cell,)),  # F
                (own_f + grad_in, (X_DONE * SM + cell,)),  # B
                (own_f + grad_in, (X_DONE * SM + cell,)),  # I
                (((X_DONE * SM + cell, False),), (W_DONE * SM + cell,)),  # W
                ((), ()),  # OVERLAP_F_B: its parts' rules
                (((F_DONE * SM + cell, False),), (SENT * SM + F_DONE * SM + cell,)),  # SEND_F
                (((X_DONE * SM + cell, False),), (SENT * SM + X_DONE * SM + cell,)),  # SEND_B
                ((), (RECEIVED * SM + F_DONE * SM + cell - M,)),  # RECV_F: the output of s-1
                ((), (RECEIVED * SM + X_DONE * SM + cell + M,)),  # RECV_B: the input-gradient of s+1
            ]
            for code, (need, make) in enumerate(rows):
                self.needs[code].append(need)
                self.makes[code].append(make)
        # The same without the crossing flags, and a compute part's one product, for hot loops.
        self.need_keys = [[tuple(key for key, _ in row) for row in rows] for rows in self.needs]
        self.make_key = [[row[0] if row else -1 for row in rows] for rows in self.makes]
        # The inverse of the input rules: a forward's output goes to s+1, an input-gradient to s-1.
        self.sends: list[list[bool]] = [self.next_cross, self.prev_cross, self.prev_cross, [False] * S]
        # What a compute part's product becomes when it crosses ranks: (SEND kind, RECV kind, stage
        # receiving it) per F, B and I code and stage; None where it stays on the rank.
        fwd = [(ActionKind.SEND_F, ActionKind.RECV_F, s + 1) if self.next_cross[s] else None for s in range(S)]
        grad = [(ActionKind.SEND_B, ActionKind.RECV_B, s - 1) if self.prev_cross[s] else None for s in range(S)]
        self.outgoing: list[list[tuple[ActionKind, ActionKind, int] | None]] = [fwd, grad, grad]
        # route() as templates, for SEND_F, SEND_B, RECV_F, RECV_B: (node base, source, destination).
        probe = [Action(s, kind, 0) for kind in _COMM_KINDS for s in range(S)]
        self.routes: dict[str, list[tuple[int, int, int]]] = {
            kind._value_: [route(a, S, M) for a in probe[k * S : (k + 1) * S]] for k, kind in enumerate(_COMM_KINDS)
        }

    def _input(self, producer: int, crosses: bool) -> tuple[Need, ...]:
        if crosses and self.lowered:
            return ((SENT * self.SM + producer, True), (RECEIVED * self.SM + producer, False))
        return ((producer, crosses),)

    @property
    def num_keys(self) -> int:
        return NUM_KEY_BLOCKS * self.SM

    def part_needs(self, part: Action) -> list[int]:
        """The keys a compute part waits for."""
        m = part.microbatch
        assert m is not None
        return [base + m for base, _ in self.needs[CODE[part.kind._value_]][part.stage]]

    def part_makes(self, part: Action) -> list[int]:
        m = part.microbatch
        assert m is not None
        return [base + m for base in self.makes[CODE[part.kind._value_]][part.stage]]

    def flat(self, codes: Sequence[int]) -> tuple[list[int], list[int], list[bool], list[bool], list[int]]:
        """Per-action tables for compute-only search: for action number ``j*SM + s*M + m`` of the
        ``j``-th kind code in ``codes``: its first and second need (-1: none), whether each crosses
        ranks, and what it makes (its first product)."""
        S, M, SM = self.S, self.M, self.SM
        size = len(codes) * SM
        need1, need2 = [-1] * size, [-1] * size
        cross1, cross2 = [False] * size, [False] * size
        made = [-1] * size
        for j, code in enumerate(codes):
            for s in range(S):
                base = j * SM + s * M
                needs = self.needs[code][s]
                if needs:
                    key, crosses = needs[0]
                    need1[base : base + M] = range(key, key + M)
                    cross1[base : base + M] = [crosses] * M
                if len(needs) > 1:
                    key, crosses = needs[1]
                    need2[base : base + M] = range(key, key + M)
                    cross2[base : base + M] = [crosses] * M
                made[base : base + M] = range(self.makes[code][s][0], self.makes[code][s][0] + M)
        return need1, need2, cross1, cross2, made


class Ids:
    """Node and message numbering for ``num_stages`` × ``num_microbatches`` (the keys above).

    Nodes: ``F`` at ``s*M + m``, ``X`` at ``SM + s*M + m``, ``W`` at ``2SM + s*M + m``. A message
    is named by the node whose product it carries.
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

    def message_actions(self, msg: int) -> tuple[Action, Action]:
        """The (SEND, RECV) pair carrying message ``msg``."""
        grad, rest = divmod(msg, self.SM)
        stage, mb = divmod(rest, self.M)
        if grad:
            return Action(stage, ActionKind.SEND_B, mb), Action(stage - 1, ActionKind.RECV_B, mb)
        return Action(stage, ActionKind.SEND_F, mb), Action(stage + 1, ActionKind.RECV_F, mb)
