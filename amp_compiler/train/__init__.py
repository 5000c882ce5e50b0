"""Training a converted model: the joint forward+backward graph, loss scaling, GradScaler."""
from amp_compiler.train.network import TrainStep, build_train_network

__all__ = ["TrainStep", "build_train_network"]


def __getattr__(name):
    # demo_training moved to the demo (amp_compiler/cli/demo.py); the old name answers for one release
    if name == "demo_training":
        from amp_compiler.cli.demo import demo_training
        return demo_training
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
