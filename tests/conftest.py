import os
import sys

# Tests import the model zoo (models/) from the repository root as `models` (installed: amp_compiler.models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# transformers and timm import torchvision when it is installed; the wheel that matches the torch pin
# needs its missing op schemas defined first (see models/torchvision_ops.py).
import models.torchvision_ops  # noqa: E402,F401
