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
        expected = list(inspect.signature(getattr(theirs, name).__init__).parameters)[1:]
        ours = list(inspect.signature(getattr(pipetrain, name).__init__).parameters)[1:]
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
