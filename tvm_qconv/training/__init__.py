"""Float and QAT training of the int8 models (``train.py``): configuration, loop, checkpoints."""
from .checkpoint import load_checkpoint, load_float_model, read_checkpoint, save_checkpoint, set_learned_amax
from .config import DIGITS_CLASSES, MODELS, TrainConfig, build_model
from .loop import evaluate, load_digits, run_training, train_model

__all__ = ["DIGITS_CLASSES", "MODELS", "TrainConfig", "build_model", "evaluate", "load_checkpoint",
           "load_digits", "load_float_model", "read_checkpoint", "run_training", "save_checkpoint",
           "set_learned_amax", "train_model"]
