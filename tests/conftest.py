import os
import sys

# The model zoo (models/) is not installed: tests import it from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
