"""Training: the step (step.py), the Trainer whose fit() runs the iterations (trainer.py) and
what it shows (log.py), AdamW and the learning-rate schedule (optimizer.py), checkpoints
(checkpoint.py) and the --save folder's claim (save_folder.py)."""
from ..config import TrainConfig
from .step import train_step
from .trainer import Trainer, TrainingDiverged, train

__all__ = ["TrainConfig", "Trainer", "TrainingDiverged", "train", "train_step"]
