"""The schedule classes have torch.distributed.pipelining's call signatures and hierarchy."""

from __future__ import annotations

from typing import Any


def test_schedule_classes_take_torchs_arguments_in_torchs_order() -> None:
    """A call written for torch.distributed.pipelining, positional arguments included, means the
    same here; the class hierarchy answers issubclass the same way."""
    import inspect

    import torch.distributed.pipelining.schedules as theirs

    import pipetrain

    names = [
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
        "PipelineScheduleSingle",
        "PipelineScheduleMulti",
    ]
    for name in names:
        # names and kinds: a keyword-only parameter there (torch 2.15's defer_reduce_grad_wait) is one here
        expected = [(p.name, p.kind) for p in inspect.signature(getattr(theirs, name).__init__).parameters.values()][1:]
        ours = [(p.name, p.kind) for p in inspect.signature(getattr(pipetrain, name).__init__).parameters.values()][1:]
        assert ours[: len(expected)] == expected, (name, expected, ours)
        for base in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
            assert issubclass(getattr(pipetrain, name), getattr(pipetrain, base)) == issubclass(
                getattr(theirs, name), getattr(theirs, base)
            ), (name, base)


def test_torchtitans_imports_exist_with_torchs_meaning() -> None:
    """torchtitan's pipeline code imports these names from torch's schedules and stage modules and
    uses ``_PipelineSchedule`` / ``_PipelineStageBase`` as the types of every schedule and stage."""
    import pipetrain
    from pipetrain.schedules import (  # torchtitan's import line, module renamed
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
        _PipelineSchedule,
        _PipelineScheduleRuntime,
        get_schedule_class,
    )
    from pipetrain.stage import _PipelineStageBase

    for cls in (PipelineScheduleMulti, PipelineScheduleSingle, ScheduleDualPipeV, ScheduleZBVZeroBubble):
        assert issubclass(cls, _PipelineSchedule)
    assert issubclass(_PipelineScheduleRuntime, PipelineScheduleMulti)
    assert get_schedule_class("zbvzerobubble") is ScheduleZBVZeroBubble
    assert issubclass(pipetrain.PipelineStage, _PipelineStageBase)


def test_stage_submod_is_assignable_like_torchs() -> None:
    """torchtitan's ``pipeline_llm`` builds stages, then assigns ``stage.submod = model_part``."""
    import torch

    from pipetrain import PipelineStage

    stage = PipelineStage(torch.nn.Linear(2, 2), 0, 2, "cpu")
    other = torch.nn.Linear(2, 3)
    stage.submod = other
    assert stage.submod is other and stage.submodule is other


def test_errors_users_are_told_to_catch_import_from_the_top() -> None:
    from pipetrain import PipelineError, ScheduleError
    from pipetrain.plan import ScheduleError as PlanScheduleError

    assert ScheduleError is PlanScheduleError
    assert issubclass(PipelineError, RuntimeError)


def test_a_registered_family_gets_its_schedule_class(monkeypatch: Any) -> None:
    """A new schedule is one generator module: its class comes from the registry."""
    import pipetrain
    import pipetrain.schedules as schedules
    from pipetrain.plan.generators import ScheduleFamily, _registry, build_schedule, register

    monkeypatch.setattr(_registry, "_FAMILIES", dict(_registry._FAMILIES))
    monkeypatch.setattr(_registry, "_LOOKUP", dict(_registry._LOOKUP))
    monkeypatch.setattr(schedules, "_CLASSES", dict(schedules._CLASSES))

    def build(p: int, m: int, v: int | None) -> Any:
        return build_schedule("GPipe", p, m, v)

    register(ScheduleFamily("TestOnlyOne", build, placement="loop", split_backward=False, stages_per_rank=1))
    register(ScheduleFamily("TestOnlyMany", build, placement="loop", split_backward=False, torch_class="MyMany"))
    try:
        one, many = pipetrain.ScheduleTestOnlyOne, schedules.get_schedule_class("testonlymany")
        assert issubclass(one, schedules.PipelineScheduleSingle) and one.schedule_name == "TestOnlyOne"
        assert issubclass(many, schedules.PipelineScheduleMulti) and not issubclass(
            many, schedules.PipelineScheduleSingle
        )
        assert many.__name__ == "MyMany" and schedules.get_schedule_class("MyMany") is many
        assert schedules.get_schedule_class("ScheduleTestOnlyOne") is one
    finally:
        for name in ("ScheduleTestOnlyOne", "MyMany"):
            vars(schedules).pop(name, None)
            vars(pipetrain).pop(name, None)


def _two_stages() -> list[Any]:
    import torch

    from pipetrain import PipelineStage

    return [PipelineStage(torch.nn.Linear(2, 2), s, 4, "cpu") for s in (0, 2)]


def test_torch_215_schedule_keywords_are_taken_or_refused_by_name() -> None:
    """torch 2.15's new constructor keywords of the multi-stage classes: ``max_active_stages`` is
    checked as torch checks it (ValueError) and becomes the FSDP pass's cap (run in
    test_torch_parity); the others are taken at their defaults, positionally in torch's order too,
    and any other value is refused with its name (before any process group is needed)."""
    import pytest

    from pipetrain import PipelineError
    from pipetrain.schedules import ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleZBVZeroBubble

    stages = _two_stages()
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"max_active_stages must be a positive integer"):
            ScheduleInterleaved1F1B(stages, 4, max_active_stages=bad)
    with pytest.raises(PipelineError, match=r"unshard_lookahead='auto' .*lower_options=.*prefetch.* not supported"):
        ScheduleZBVZeroBubble(stages, 4, unshard_lookahead="auto")
    # torch's positional order: ..., backward_requires_autograd, defer_pp_recv, max_active_stages, unshard_lookahead
    with pytest.raises(PipelineError, match=r"unshard_lookahead=\(1, 2\)"):
        ScheduleInterleaved1F1B(stages, 4, None, None, None, None, True, True, False, 3, (1, 2))
    with pytest.raises(PipelineError, match=r"unshard_lookahead='auto'"):
        ScheduleLoopedBFS(stages, 4, None, None, True, True, False, 3, "auto")
    with pytest.raises(PipelineError, match=r"defer_reduce_grad_wait=True .*no WAIT_REDUCE_GRAD"):
        ScheduleLoopedBFS(stages, 4, defer_reduce_grad_wait=True)
    with pytest.raises(PipelineError, match=r"max_outstanding_sends=2 .*no WAIT_SEND actions"):
        ScheduleInterleaved1F1B(stages, 4, max_outstanding_sends=2)
    with pytest.raises(PipelineError, match=r"max_active_stages=2 and lower_options' max_unsharded=1 are the same"):
        ScheduleInterleaved1F1B(stages, 4, max_active_stages=2, lower_options={"fsdp": True, "max_unsharded": 1})
    # the defaults, given explicitly, change nothing: what fails next is the missing process group
    with pytest.raises(PipelineError, match=r"needs an initialised torch\.distributed process group"):
        ScheduleInterleaved1F1B(stages, 4, max_active_stages=3, unshard_lookahead="full", defer_reduce_grad_wait=False)


def test_torch_215_wait_kinds_are_named_as_absent() -> None:
    """torch 2.15's WAIT_SEND_F/WAIT_SEND_B/WAIT_REDUCE_GRAD: pipetrain's runtime waits by itself,
    and a user importing them learns why they are not there."""
    import pytest

    import pipetrain.schedules as schedules

    for name in ("WAIT_SEND_F", "WAIT_SEND_B", "WAIT_REDUCE_GRAD"):
        with pytest.raises(AttributeError, match=f"pipetrain has no {name} action"):
            getattr(schedules, name)
    with pytest.raises(ImportError):
        from pipetrain.schedules import WAIT_REDUCE_GRAD  # noqa: F401


def test_forward_context_wraps_every_forward_as_torch_215s() -> None:
    """``PipelineStage.register_forward_context``: one context at a time around each forward
    (training and no-grad), told the stage and microbatch; removable; may not swallow errors."""
    import contextlib
    import dataclasses

    import pytest
    import torch

    import pipetrain
    from pipetrain import PipelineError, PipelineStage, PipelineStageInfo

    seen: list[tuple[PipelineStageInfo, bool]] = []

    @contextlib.contextmanager
    def record(info: PipelineStageInfo) -> Any:
        seen.append((info, torch.is_grad_enabled()))
        yield

    stage = PipelineStage(torch.nn.Linear(2, 2), 1, 3, "cpu")
    handle = stage.register_forward_context(record)
    with pytest.raises(PipelineError, match="already registered"):
        stage.register_forward_context(record)
    stage.forward_one_chunk(5, (torch.randn(2, 2),))
    with torch.no_grad():
        stage.forward_one_chunk(6, (torch.randn(2, 2),))
    assert seen == [
        (PipelineStageInfo(stage_index=1, microbatch_index=5), True),
        (PipelineStageInfo(stage_index=1, microbatch_index=6), False),
    ]
    assert not seen[0][0].is_metadata_inference
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen[0][0].stage_index = 2  # type: ignore[misc]
    handle.remove()
    stage.forward_one_chunk(7, (torch.randn(2, 2),))
    assert len(seen) == 2

    @contextlib.contextmanager
    def swallow(info: PipelineStageInfo) -> Any:
        with contextlib.suppress(RuntimeError):
            yield

    bad = PipelineStage(torch.nn.Linear(2, 2), 0, 2, "cpu")
    bad.register_forward_context(swallow)
    with pytest.raises(PipelineError, match="suppressed the forward's exception"):
        bad.forward_one_chunk(0, (torch.randn(2, 3),))  # shape mismatch inside the module
    assert pipetrain.PipelineStageInfo is PipelineStageInfo

    # A schedule's forwards go through it too, in one process.
    calls: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def count(info: PipelineStageInfo) -> Any:
        calls.append((info.stage_index, info.microbatch_index))
        yield

    pipe = pipetrain.LocalPipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], "1F1B", 2, num_ranks=2)
    for st in pipe.stages:
        st.register_forward_context(count)
    pipe.step(torch.randn(4, 2))
    assert sorted(calls) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_step_takes_torch_215s_finalize_gradients() -> None:
    """``step(..., finalize_gradients=False)`` is torch 2.15's: not a keyword input of the model.
    Every step reduces what it adds here, so the gradients are the same either way (with FSDP:
    test_torch_parity)."""
    import torch
    from torch import nn

    import pipetrain

    torch.manual_seed(0)
    layers = [nn.Linear(3, 3), nn.Linear(3, 3)]
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    grads = []
    for finalize in (True, False):
        mods = [nn.Linear(3, 3) for _ in layers]
        for m, ref in zip(mods, layers, strict=True):
            m.load_state_dict(ref.state_dict())
        pipe = pipetrain.LocalPipeline(mods, "1F1B", 2, loss_fn=nn.functional.mse_loss, num_ranks=2)
        pipe.step(x, target=y, finalize_gradients=finalize)
        grads.append([p.grad for m in mods for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_activation_liveness_as_torch_215s() -> None:
    """``analyze_pipeline_activation_liveness``: a lifetime runs from F to B (or to W where the
    backward is split; I alone frees nothing), both ends inclusive; lifetimes that never overlap
    share a slot. Where torch has the function (2.15), its slots for its own orders equal ours
    for the same orders read here (the positions differ only by the communication actions)."""
    import importlib

    import pytest

    import _torch_reference
    import pipetrain
    from pipetrain.plan import Action, Schedule, build_schedule
    from pipetrain.schedules import PipelineActivationLiveness, analyze_pipeline_activation_liveness

    assert pipetrain.analyze_pipeline_activation_liveness is analyze_pipeline_activation_liveness

    def order(rows: dict[int, list[str | None]]) -> Schedule:
        return Schedule({r: [None if c is None else Action.parse(c) for c in row] for r, row in rows.items()})

    # rank 0 of 1F1B on 2 ranks, 3 microbatches: F0 F1 B0 F2 B1 B2 (F0..B0 overlaps F1..B1 only)
    s = order(
        {0: ["0F0", "0F1", None, "0B0", "0F2", "0B1", "0B2"], 1: [None, "1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]}
    )
    live = analyze_pipeline_activation_liveness(s, pp_rank=0, stage_indices=[0], granularity="stage_microbatch")
    assert isinstance(live, PipelineActivationLiveness)
    assert live.get_activation_lifetime(0, 0) == (0, 3) and live.get_activation_lifetime(0, 2) == (4, 6)
    assert dict(live.slot_by_stage_and_microbatch) == {(0, 0): 0, (0, 1): 1, (0, 2): 0} and live.num_slots == 2
    assert live.slot_for(0, 2) == 0
    with pytest.raises(ValueError, match="no activation slot for stage 1"):
        live.slot_for(1, 0)
    # split backward: W frees, I does not; an OVERLAP_F_B's parts are one position
    s = order({0: ["0F0", "0F1", "0I0", "(0F2;0W0)OVERLAP_F_B", "0I1", "0W1", "0I2", "0W2"]})
    live = analyze_pipeline_activation_liveness(s, pp_rank=0, stage_indices=(0,), granularity="stage_microbatch")
    assert [live.get_activation_lifetime(0, m) for m in range(3)] == [(0, 3), (1, 5), (3, 7)]
    assert live.num_slots == 3  # (0,3) and (3,7) share position 3
    # microbatch granularity: the stages of a microbatch share one lifetime and slot
    zbv = build_schedule("ZBVZeroBubble", 2, 4, 2)
    live = analyze_pipeline_activation_liveness(zbv, pp_rank=0, stage_indices=[0, 3], granularity="microbatch")
    assert all(live.slot_for(0, m) == live.slot_for(3, m) for m in range(4))
    lowered = analyze_pipeline_activation_liveness(
        zbv.lower(), pp_rank=0, stage_indices=[0, 3], granularity="microbatch"
    )
    assert dict(lowered.slot_by_stage_and_microbatch) == dict(live.slot_by_stage_and_microbatch)
    for bad, message in (
        ({"stage_indices": [0], "granularity": "layer"}, "granularity must be"),
        ({"stage_indices": [], "granularity": "microbatch"}, "at least one stage"),
        ({"stage_indices": [0, 0], "granularity": "microbatch"}, "must not repeat"),
        ({"stage_indices": [1], "granularity": "microbatch"}, r"forward actions do not match.*missing="),
    ):
        with pytest.raises(ValueError, match=message):
            analyze_pipeline_activation_liveness(zbv, pp_rank=0, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 5 is not in the schedule"):
        analyze_pipeline_activation_liveness(zbv, pp_rank=5, stage_indices=[0], granularity="microbatch")

    theirs_fn = getattr(
        importlib.import_module("torch.distributed.pipelining"), "analyze_pipeline_activation_liveness", None
    )
    if theirs_fn is None:
        return  # torch before 2.15
    compared = 0
    for name, v in (("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("InterleavedZeroBubble", 2)):
        for p, m in ((2, 4), (4, 8)):
            theirs = _torch_reference.torch_schedule_object(name, p, m, v)
            assert theirs is not None
            mine = _torch_reference.to_pipetrain(theirs)
            for rank in range(p):
                held = mine.stages_of(rank)
                for granularity in ("microbatch", "stage_microbatch"):
                    a = theirs_fn(theirs, pp_rank=rank, stage_indices=held, granularity=granularity)
                    b = analyze_pipeline_activation_liveness(
                        mine, pp_rank=rank, stage_indices=held, granularity=granularity
                    )
                    assert dict(b.slot_by_stage_and_microbatch) == dict(a.slot_by_stage_and_microbatch), (name, p, rank)
                    assert b.num_slots == a.num_slots
                    compared += 1
    assert compared == 48
