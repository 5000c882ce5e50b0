import os
import sys

# The model zoo (models/) is not installed: tests import it from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# transformers and timm import torchvision when it is installed; the wheel that matches the torch pin
# needs its missing op schemas defined first (see models/torchvision_ops.py).
import models.torchvision_ops  # noqa: E402,F401
