"""Training a converted model: the joint forward+backward graph, loss scaling, GradScaler."""
from amp_compiler.train.network import TrainStep, build_train_network, demo_training

__all__ = ["TrainStep", "build_train_network", "demo_training"]
