"""A thin reference GRPO trainer: rollout -> reward -> advantage -> fused loss -> step (trainer.py).

    from grpo_kernels.trainer import TrainConfig, train
    result = train(TrainConfig.from_preset("dapo", steps=100))
    result.metrics[-1]["reward"]

The command line is `grpo-kernels train` (or `python -m grpo_kernels.train`). Needs the `train` extra
(transformers, matplotlib, tqdm, safetensors).
"""

from .config import PRESETS, TrainConfig
from .hooks import EdgeGuidedErrorCorrection, GFPOFilter, HookContext, LoptiStages, RolloutHook
from .rollout import Rollouts
from .task import REWARDS, TASKS, Task
from .trainer import TrainingDiverged, TrainingError, TrainingInterrupted, TrainResult, train

__all__ = [
    "PRESETS",
    "REWARDS",
    "TASKS",
    "EdgeGuidedErrorCorrection",
    "GFPOFilter",
    "HookContext",
    "LoptiStages",
    "RolloutHook",
    "Rollouts",
    "Task",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "TrainingError",
    "TrainingInterrupted",
    "train",
]
