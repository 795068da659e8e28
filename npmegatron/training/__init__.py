"""Training: the step (step.py), the Trainer whose fit() runs the iterations (trainer.py) and
what it shows (log.py). The optimizer is npmegatron.optim's, checkpoints npmegatron.checkpointing's."""
from ..config import TrainConfig
from .step import train_step
from .trainer import Trainer, TrainingDiverged, train

__all__ = ["TrainConfig", "Trainer", "TrainingDiverged", "train", "train_step"]
